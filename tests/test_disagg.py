"""Prefill/decode disaggregation (issue 21 item 1) on CPU, in one process: a prefill engine computes each prompt,
its prefix-cache entry travels to a decode engine over jax.experimental.transfer (two transfer servers), and the
decode engine's greedy tokens equal those of one engine without any cache. float64, so that any difference is a
bug, not rounding."""
import numpy as np
import pytest

import jax

from engine_workloads import run_one
from k3jax import load_model
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.kv_transfer import Transport, export_prefix, import_prefix
from serving.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    with jax.enable_x64(True):
        yield load_model("tiny", dtype="float64")


def _engine(model, tmp_path_factory, **kw):
    args = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256, page_size=16, prefix_match_unit=16,
                state_block_size=64, num_pages=120, num_slots=24, token_buckets=(128,), seq_buckets=(4,), warmup=False,
                host_cache_bytes=16 << 20, compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla"),
                vision=False)
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def test_decode_engine_continues_from_the_transferred_entry_and_refuses_a_foreign_one(model, tmp_path_factory):
    with jax.enable_x64(True):
        prefill, decode = _engine(model, tmp_path_factory), _engine(model, tmp_path_factory)
        single = _engine(model, tmp_path_factory, enable_prefix_caching=False)
        sender, receiver = Transport(), Transport()
        rng = np.random.RandomState(3)
        shared = rng.randint(0, 1024, 80).tolist()
        prompts = [shared + rng.randint(0, 1024, n).tolist() for n in (23, 40, 9)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(prompts):
            run_one(prefill, p, SamplingParams(temperature=0.0, max_tokens=1), f"p{i}")
            desc, flat = export_prefix(prefill, p)
            got = receiver.fetch(sender.address, sender.offer(flat), desc)
            assert [list(x.shape) for x in got] == [s for s, _ in desc["specs"]]
            assert import_prefix(decode, p, desc, got)
            out = run_one(decode, p, params, f"d{i}")
            ref = run_one(single, p, params, f"s{i}")
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
            assert out.num_cached_tokens == desc["num_tokens"] == (len(p) - 1) // 16 * 16
        # prompts 1 and 2 hit the shared prefix on the prefill side (1 at the state block, 64; prompt 1 then plans a
        # checkpoint at the junction, 80, which 2 hits); on the decode side the imported entries reuse the shared
        # pages already there
        assert prefill.stats()["prefix_hit_tokens"] == 64 + 80
        assert decode.stats()["host_restored"] == 3
        # an entry offered for another prompt (its chain differs from the first unit on) is refused
        other = [prompts[0][0] ^ 1] + prompts[0][1:]
        assert not import_prefix(decode, other, desc, got)
        assert export_prefix(prefill, other) is None      # nothing cached for it on the prefill side either

