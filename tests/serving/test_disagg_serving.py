"""Disaggregated serving end to end on CPU: `python -m k3jax.serve --role prefill` and
`--role decode --prefill-peer` as two processes (tiny model, float64). Greedy tokens through the decode server
equal those the prefill server gives as one ordinary server, with prefix hits on either side, and a prefill peer
killed mid-run leaves the decode server prefilling locally without losing a request."""
import httpx
import numpy as np
import pytest

from tests.support.server_fixture import API_KEY, ServerProcess

pytestmark = pytest.mark.integration

H = {"authorization": f"Bearer {API_KEY}"}


def _complete(server, prompt):
    r = httpx.post(server.url + "/v1/completions", headers=H, timeout=120, json={
        "model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_decode_server_matches_one_server_and_survives_its_peer(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    tmp = str(tmp_path_factory.mktemp("disagg"))
    common = ("--dtype", "float64", "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--no-vision")
    prefill = ServerProcess(tmp, "--role", "prefill", *common)
    decode = None
    try:
        decode = ServerProcess(tmp, "--role", "decode", "--prefill-peer", f"127.0.0.1:{prefill.port}",
                               "--prefill-timeout", "20", *common)
        rng = np.random.RandomState(0)
        shared = rng.randint(1, 1000, 70).tolist()
        prompts = [shared + rng.randint(1, 1000, n).tolist() for n in (30, 11, 45, 20)]
        got = [_complete(decode, prompts[0])]          # the peer computes it from scratch
        ref = [_complete(prefill, p) for p in prompts]  # one ordinary server (hits its own cache for prompt 0)
        got += [_complete(decode, p) for p in prompts[1:3]]   # the peer hits the shared prefix, or the whole prompt
        assert got == ref[:3]
        assert decode.metric("k3jax:disagg_remote_prefills") == 3
        assert decode.metric("k3jax:disagg_transfer_bytes") > 0
        assert prefill.metric("k3jax:prefix_cache_hit_tokens") > 0
        for bad in ({"prompt_token_ids": "x"}, {"prompt_token_ids": [1, 10**9]}, {}):   # 400s in OpenAI's shape
            r = httpx.post(prefill.url + "/internal/prefill", headers=H, json=bad, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        prefill.proc.kill()                             # the peer dies mid-run
        prefill.proc.wait(30)
        assert _complete(decode, prompts[3]) == ref[3]  # prefilled locally
        assert _complete(decode, prompts[0]) == ref[0]  # and a repeat hits the decode side's own cache
        assert decode.metric("k3jax:disagg_peer_failures") >= 1
        assert decode.metric("k3jax:disagg_remote_prefills") == 3
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()
