"""Multi-host serving end to end on CPU: `python -m k3jax.serve` as 2 processes x 4 fake devices
(jax.distributed over 127.0.0.1, gloo), mesh data=2,expert=4 spanning both processes. Process 0
serves HTTP and broadcasts every step; process 1 follows. Greedy completions and chat answers
must equal those of a single-process server on 1 device, and a SIGTERM to process 0 must end
both processes with status 0."""
import asyncio
import signal
import time

import openai
import pytest

from tests.support.mp_common import SERVE_ARGS, group_args, kill_all, log_tail, serve_env, start_server, wait_ready
from tests.support.server_fixture import free_port

pytestmark = pytest.mark.integration

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700, 10, 11, 12, 13], [42, 42, 42]]
CHAT = [{"role": "user", "content": "Hello there"}]


def _image_chat():
    """A chat turn with one small image: its embeddings come from process 0's tower inside the step batch."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (60, 90, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


async def _answers(url):
    """Completions with logprobs (token strings + logprobs stand in for ids) and a chat answer, concurrently."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def completion(prompt):
        r = await client.completions.create(model="tiny-random", prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                            extra_body={"ignore_eos": True})
        c = r.choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs

    async def chat(messages):
        r = await client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, extra_body={"chat_template_kwargs": {"thinking": False}})
        c = r.choices[0]
        return c.message.content, [e.token for e in c.logprobs.content], [e.logprob for e in c.logprobs.content]

    try:
        return await asyncio.gather(*(completion(p) for p in PROMPTS), chat(CHAT), chat(_image_chat()))
    finally:
        await client.close()


async def _both(*urls):
    return await asyncio.gather(*(_answers(u) for u in urls))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_process_server_matches_one_device(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    port, ref_port = free_port(), free_port()
    cache = ["--compilation-cache-dir", str(tmp_path / "xla")]
    t0 = time.time()
    group = [start_server(tmp_path, f"proc{i}", ["--port", str(port), "--mesh", "data=2,expert=4",
                                                 *group_args(coord, 2, i), *SERVE_ARGS, *cache], serve_env(4))
             for i in range(2)]
    # the reference compiles on demand (fewer shapes); the multi-host server warms up through the followers
    ref = start_server(tmp_path, "ref", ["--port", str(ref_port), "--no-warmup", *SERVE_ARGS, *cache], serve_env(1))
    try:
        url, ref_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ref_port}"
        wait_ready(ref_url, [ref], 200)
        wait_ready(url, group, 200)
        ready = time.time() - t0
        want, got = asyncio.run(_both(ref_url, url))
        served = time.time() - t0 - ready
        assert [len(toks) for _, toks, _ in got[:len(PROMPTS)]] == [8] * len(PROMPTS) and got[-1][1] and got[-2][1]
        for (text, toks, lps), (rtext, rtoks, rlps) in zip(got, want):
            assert toks == rtoks and text == rtext
            assert max(abs(a - b) for a, b in zip(lps, rlps)) < 2e-3, (lps, rlps)
        # a follower logged that it is following and has run steps; process 0 stops both on SIGTERM
        group[0][0].send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p, _ in group]
        assert codes == [0, 0], "\n".join(log_tail(log) for _, log in group)
        follower = log_tail(group[1][1], 100000)
        assert "following process 0" in follower and "shutdown from process 0" in follower
        print(f"ready {ready:.1f}s, requests {served:.1f}s, shutdown {time.time() - t0 - ready - served:.1f}s")
    finally:
        kill_all(group + [ref])


@pytest.mark.timeout(120)
def test_follower_exits_when_process0_dies(tmp_path):
    """SIGKILL process 0 of an idle 2-process server: the follower, waiting for the next step inside a
    collective, must exit non-zero within seconds (its own log line, or JAX's coordination service
    ending it), not hang."""
    coord, port = f"127.0.0.1:{free_port()}", free_port()
    group = [start_server(tmp_path, f"proc{i}", ["--port", str(port), "--mesh", "data=2,expert=4", "--no-warmup",
                                                 *group_args(coord, 2, i), *SERVE_ARGS], serve_env(4))
             for i in range(2)]
    try:
        wait_ready(f"http://127.0.0.1:{port}", group, 100)
        group[0][0].kill()
        t = time.time()
        code = group[1][0].wait(60)
        log = log_tail(group[1][1], 100000)
        assert code != 0, log
        assert "lost process 0" in log or "JAX distributed service detected fatal errors" in log, log
        print(f"follower exited with {code} {time.time() - t:.1f}s after process 0 was killed")
    finally:
        kill_all(group)
