"""Multi-host faults end fast and clearly (serving/multihost_watch.py).

End to end: `python -m k3jax.serve` as 2 processes x 4 fake CPU devices (mesh data=2,expert=4
across both) where process 1 raises while loading, is killed during warm-up, or is killed while
requests are in flight. Each run must end within seconds with process 0 naming process 1, its
stage and the cause, a non-zero exit, no C++ abort trace, and (serving) every request answered:
streams end with a 503-style error event and [DONE], whole requests get a 503, /health says why.
Unit: the watch's verdicts on a fake store and clock (failed key, silence, start-up and step
timeouts, abort), which the end-to-end runs do not reach in their time budget; and a stuck engine
thread (a collective that never returns) whose requests all get the cause.
"""
import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.support.mp_common import SERVE_ARGS, group_args, kill_all, log_tail, serve_env, start_server, wait_ready
from serving.multihost_watch import PREFIX, Watch, WatchSettings
from tests.support.server_fixture import free_port
from tests.support.tiers import slow_case

pytestmark = pytest.mark.integration

HEARTBEAT_S = 3            # --heartbeat-timeout of the end-to-end runs
ABORT_TRACE = ("Check failure stack trace", "Shutdown barrier has failed", "detected fatal errors")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla"))


def _start_group(tmp_path, xla_cache, fault: str, *extra):
    coord, port = f"127.0.0.1:{free_port()}", free_port()
    group = [start_server(tmp_path, f"proc{i}", ["--port", str(port), "--mesh", "data=2,expert=4",
                                                 *group_args(coord, 2, i), *SERVE_ARGS,
                                                 "--heartbeat-timeout", str(HEARTBEAT_S),
                                                 "--compilation-cache-dir", xla_cache, *extra], serve_env(4),
                          fault=fault)
             for i in range(2)]
    return group, f"http://127.0.0.1:{port}"


def _wait_ended(group, timeout):
    """Exit codes and full logs once both processes ended (killing stragglers, which fails the test)."""
    t0 = time.time()
    try:
        codes = [p.wait(max(1.0, timeout - (time.time() - t0))) for p, _ in group]
    finally:
        kill_all(group)
    logs = [log_tail(path, 10**6) for _, path in group]
    for log in logs:
        assert not any(trace in log for trace in ABORT_TRACE), log[-3000:]
    return codes, logs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, codes, cause", [
    ("1:load:raise", [1, 1], "process 1 failed during load: RuntimeError: injected fault"),
    # killed on receiving its first warm-up step (its fault points: the stage, "init", then the step)
    slow_case("1:warmup:kill:2", [1, -9], "process 1 lost during warmup: no heartbeat for", id="killed_during_warmup"),
], ids=["raise_during_load", "killed_during_warmup"])
def test_follower_fault_during_startup_ends_every_process(tmp_path, xla_cache, fault, codes, cause):
    t0 = time.time()
    group, _ = _start_group(tmp_path, xla_cache, fault)
    got, logs = _wait_ended(group, 60)
    took = time.time() - t0
    assert got == codes, logs[0][-3000:]
    assert cause in logs[0], logs[0][-3000:]
    if codes[1] == 1:        # the failing follower logged its own traceback
        assert "Traceback" in logs[1] and "injected fault" in logs[1]
    print(f"both ended {took:.1f}s after start")


async def _requests_through_a_kill(url, follower):
    """Two streams and one whole request in flight, then SIGKILL the follower and send one more request.
    Returns (streams' (status, events), whole requests' (status, body), /health answers after the kill,
    seconds from the kill until every request was answered and the server gone)."""
    body = {"model": "tiny-random", "prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    first_token = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def stream(prompt):
            events = []
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_token.set()
                return r.status_code, events

        async def whole(prompt):
            r = await client.post("/v1/completions", json={**body, "prompt": prompt})
            return r.status_code, r.json()

        in_flight = [asyncio.create_task(stream([5, 6, 7])), asyncio.create_task(stream([9, 10, 11, 12]))]
        wholes = [asyncio.create_task(whole([42, 42]))]
        await asyncio.wait_for(first_token.wait(), 90)
        follower.kill()
        killed_at = time.time()
        wholes.append(asyncio.create_task(whole([7, 7, 7])))     # waits for an engine that never comes back
        health = []           # until the requests are answered and the server is gone
        while not (all(t.done() for t in in_flight + wholes) and health and health[-1][0] is None):
            try:
                r = await client.get("/health", timeout=2)
                health.append((r.status_code, r.json()))
            except httpx.HTTPError as e:
                health.append((None, repr(e)))
            await asyncio.sleep(0.1)
        answered = time.time() - killed_at
        return [t.result() for t in in_flight], [t.result() for t in wholes], health, answered


# slow (CI's time budget): a two-process group's whole warm-up first; the default run keeps the group's start-up
# faults above, and the requests' answers on a failed engine in test_failing_a_stuck_engine_answers_every_request
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_follower_killed_while_serving_fails_requests_and_ends(tmp_path, xla_cache):
    group, url = _start_group(tmp_path, xla_cache, "", "--no-warmup")
    try:
        wait_ready(url, group, 60)
        streams, wholes, health, answered = asyncio.run(_requests_through_a_kill(url, group[1][0]))
        codes, logs = _wait_ended(group, 30)
    finally:
        kill_all(group)
    assert codes == [1, -9], logs[0][-3000:]
    assert "process 1 lost during serve: no heartbeat for" in logs[0], logs[0][-3000:]
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_unavailable" and "process 1 lost during serve" in err["message"], err
        assert len(events) - 2 < 200                       # cut short: the stream did not finish its tokens
    for status, body in wholes:
        assert status == 503 and "process 1 lost" in body["error"]["message"], body
    down = [answer["error"] for status, answer in health if status == 503]
    assert down and "process 1 lost during serve" in down[-1], health
    print(f"every request answered {answered:.1f}s after the kill; /health answers {[s for s, _ in health]}")


# ---------------------------------------------------------------------- the watch's verdicts

class FakeStore:
    """The coordination service's key-value calls the watch uses, on a dict."""

    def __init__(self):
        self.kv, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        return sorted((k, v) for k, v in self.kv.items() if k.startswith(prefix))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _watch(me, store, clock, **settings):
    w = Watch(store, me, 3, WatchSettings(heartbeat_timeout_s=10, startup_timeout_s=100, step_timeout_s=50, **settings),
              exit=lambda code: None, clock=clock)
    w._beat()
    w._read()
    return w


def _beat(store, i, stage, seq, count):
    store.key_value_set(f"{PREFIX}beat/{i}", f"{stage}|{seq}|{count}")


def test_watch_verdicts_on_process0():
    store, clock = FakeStore(), Clock()
    w = _watch(0, store, clock)
    assert w.verdict() is None
    # followers beating in their stages: slow is not dead, however long the stage lasts
    for t in range(1, 60):
        clock.t += 1
        _beat(store, 1, "load", 0, t)
        _beat(store, 2, "warmup", 3, t)
        w._read()
        assert w.verdict() is None
    # process 2 falls silent: lost after the heartbeat timeout, in its last stage
    for t in range(60, 71):
        clock.t += 1
        _beat(store, 1, "load", 0, t)
        w._read()
    assert w.verdict() == "process 2 lost during warmup: no heartbeat for 11s (killed, crashed or unreachable)"
    _beat(store, 2, "warmup", 3, 99)
    w._read()
    assert w.verdict() is None
    # start-up over its timeout: names who is still where
    clock.t = w.started_at + 101
    _beat(store, 1, "load", 0, 100)
    _beat(store, 2, "warmup", 3, 100)
    w._read()
    assert w.verdict() == "start-up did not finish in 100s (process 0 in start, process 1 in load, process 2 in warmup)"
    w.set_stage("serve")
    assert w.verdict() is None
    # one message unfinished over the step timeout: the followers that have not finished it
    w.message_started(4)
    clock.t += 51
    _beat(store, 1, "serve", 4, 101)
    _beat(store, 2, "serve", 3, 101)
    w._read()
    assert w.verdict() == "multi-host message 4 unfinished after 51s (step timeout): process(es) 2 have not finished it"
    _beat(store, 2, "serve", 4, 102)
    w._read()
    assert w.verdict().endswith("every follower finished it: process 0 itself is stuck")
    w.message_finished(4)
    assert w.verdict() is None
    # a follower's failure report wins over everything else
    store.key_value_set(f"{PREFIX}failed/1", "serve|XlaRuntimeError: out of memory")
    w._read()
    assert w.verdict() == "process 1 failed during serve: XlaRuntimeError: out of memory"
    # a clean exit judges nothing
    w.stop()
    assert w.verdict() is None


def test_watch_ends_run_and_follower_exits():
    store, clock = FakeStore(), Clock()
    ended, exits = [], []
    lead = _watch(0, store, clock, flush_s=0.0)
    lead._exit = exits.append
    lead.on_abort(ended.append)
    follower = _watch(1, store, clock)
    lead.own_error = "process 0 then raised during serve: JaxRuntimeError: connection reset"   # its echo
    lead.end("process 2 lost during serve")
    reason = "process 2 lost during serve; process 0 then raised during serve: JaxRuntimeError: connection reset"
    assert ended == [reason] and exits == [1]
    follower._read()
    assert follower.verdict() == f"process 0 ended the run: {reason}"
    follower._exit = exits.append
    follower._follower_exit(follower.verdict())
    assert exits == [1, 1] and store.kv[f"{PREFIX}ack/1"] == "1"
    # a follower of another run: process 0's store stops answering (process 0 killed)
    store = FakeStore()
    other = _watch(2, store, clock)
    _beat(store, 0, "serve", 9, 1)
    other._read()
    assert other.verdict() is None
    store.down = True
    clock.t += 5
    with pytest.raises(RuntimeError):
        other._read()
    assert other.verdict() is None                  # not yet: a slow answer is not a dead process
    clock.t += 6
    try:
        other._read()
    except RuntimeError as e:
        other.last_error = e
    assert other.verdict() == "lost process 0: the coordination service stopped answering (UNAVAILABLE: connection refused)"


# ---------------------------------------------------------------------- a stuck engine thread

class StuckEngine:
    """An LLMEngine whose step never returns, as process 0's does when a follower dies inside a
    collective that does not notice (NCCL on GPUs, or gloo when the peer is stopped, not killed)."""

    def __init__(self):
        self.requests, self.in_step, self.release = [], threading.Event(), threading.Event()

    def add_request(self, prompt, params, request_id, **extras):
        self.requests.append(request_id)

    def abort(self, request_id):
        return False

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        self.in_step.set()
        self.release.wait()
        return []

    def stats(self):
        return {}

    def cache_usage(self):
        return {}


def test_failing_a_stuck_engine_answers_every_request():
    from serving.async_engine import AsyncEngine, EngineDeadError
    from serving.sampling_params import SamplingParams

    async def run():
        engine = AsyncEngine(StuckEngine())
        streams = [engine.submit([1, 2], SamplingParams(max_tokens=4), f"r{i}") for i in range(2)]
        await asyncio.gather(*(s.admitted() for s in streams))
        await asyncio.get_running_loop().run_in_executor(None, engine.engine.in_step.wait, 5)
        waiting = engine.submit([3], SamplingParams(max_tokens=4), "queued")   # never taken by the engine
        threading.Thread(target=engine.fail, args=("process 1 lost during serve",)).start()
        outcomes = []
        for s in streams + [waiting]:
            with pytest.raises(EngineDeadError) as e:
                await asyncio.wait_for(s.admitted(), 5)
                async for _ in s:
                    pass
            outcomes.append(str(e.value))
        with pytest.raises(EngineDeadError) as late:
            engine.submit([4], SamplingParams(max_tokens=4), "late")
        result = outcomes, str(late.value), engine.alive, engine.dead_reason
        engine.engine.release.set()          # let the engine thread end (it stops: the engine failed)
        await asyncio.get_running_loop().run_in_executor(None, engine._thread.join, 5)
        return result + (engine._thread.is_alive(),)

    outcomes, late, alive, reason, thread_left = asyncio.run(asyncio.wait_for(run(), 20))
    assert outcomes == ["process 1 lost during serve"] * 3
    assert late == "engine stopped: process 1 lost during serve"
    assert not alive and reason == "process 1 lost during serve" and not thread_left
