"""The server's stream plumbing in-process: the response that ends a request's engine work however
its stream ends (serving/openai/sse.py), and the per-choice output queue that stays bounded when the
client reads slower than the engine writes (serving/openai/generation.py)."""
import asyncio
import time

from serving.openai.generation import LatestOutputs
from serving.openai.sse import EventStreamResponse
from serving.request import CompletionOutput, RequestOutput

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "headers": []}


class FakeStream:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def _events(log: list, forever=False):
    async def gen():
        try:
            log.append("started")
            for k in range(10**9 if forever else 3):
                await asyncio.sleep(0)
                yield f"data: {k}\n\n"
        finally:
            log.append("closed")
    return gen()


async def _never():
    await asyncio.Event().wait()


def _run(events, streams, receive, send, timeout=None):
    async def main():
        t0 = time.perf_counter()
        await asyncio.wait_for(EventStreamResponse(events, streams, send_timeout=timeout)(SCOPE, receive, send), 10)
        return time.perf_counter() - t0
    return asyncio.run(main())


def test_all_events_sent_then_streams_closed():
    sent, log, streams = [], [], [FakeStream(), FakeStream()]

    async def send(message):
        sent.append(message)
    _run(_events(log), streams, _never, send)
    assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert log == ["started", "closed"] and [s.closed for s in streams] == [1, 1]


def test_client_gone_before_the_first_byte_still_closes_the_streams():
    """The events were never pulled (their generator never started), so only the response can close them."""
    log, streams = [], [FakeStream()]

    async def gone():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0.05)
    _run(_events(log, forever=True), streams, gone, send)
    assert streams[0].closed == 1 and log in ([], ["started", "closed"])


def test_a_stalled_reader_ends_after_the_send_timeout():
    """A client that keeps the connection open and reads nothing: a send that never completes."""
    log, streams, sends = [], [FakeStream()], []

    async def stalled_send(message):
        sends.append(message["type"])
        if len(sends) > 3:
            await _never()
    elapsed = _run(_events(log, forever=True), streams, _never, stalled_send, timeout=0.3)
    assert 0.3 <= elapsed < 3, elapsed
    assert streams[0].closed == 1 and log == ["started", "closed"] and len(sends) == 4


def _out(ids: list, new: list, finished=False):
    comp = CompletionOutput(0, "x" * len(ids), list(ids), None, "length" if finished else None)
    return RequestOutput("r", None, [1], [comp], finished, metrics={"new_token_ids": list(new)})


def test_latest_outputs_keeps_one_output_per_choice_waiting():
    q = LatestOutputs()
    for t in range(1, 6):                      # choice 0 runs 5 tokens ahead of the reader
        q.put_output(0, _out(range(t), [t - 1], finished=t == 5))
    q.put_output(1, _out([7], [7]))
    q.put(None)

    async def drain():
        return [await q.get() for _ in range(3)]
    (i0, o0), (i1, o1), end = asyncio.run(drain())
    assert (i0, i1, end) == (0, 1, None)
    assert o0.finished and o0.outputs[0].token_ids == [0, 1, 2, 3, 4] and o0.metrics["new_token_ids"] == [0, 1, 2, 3, 4]
    assert o1.metrics["new_token_ids"] == [7]
    q.put_output(0, _out([0, 1, 2, 3, 4, 9], [9]))      # a slot already taken is not merged into
    i, again = asyncio.run(q.get())
    assert i == 0 and again.metrics["new_token_ids"] == [9]
