"""The engine's step programs as the GPU runs them, lowered on CPU (jax lowers for "cuda" without a GPU; the step's
Backend names its target, so every op picks the GPU's kernel) at Kimi-Linear-48B's shapes in the c1 bucket
(16 tokens, 4 sequences): a decode step and a speculative verification step of one sequence.

- Every matmul XLA runs on a verification step's rows has a shape the decode step also runs. A verified token
  rounds as decoding it only if its rows meet the same GEMMs; one of another shape (a [T, D] LM head over all
  positions at once, a projection over a gathered subset of rows) gets another kernel from XLA.
- The only device loop is the layer scan: index math (which sequence a token or tile belongs to) is one fused
  compare, not jnp.searchsorted's default binary search, a while loop of its own in every step.
- Routed experts, KDA and MLA run on their Pallas kernels; a verification chunk's KDA tokens in one launch.
- Neither program branches on device values: a conditional (lax.cond / lax.switch) in a GPU program that runs
  outside a command buffer copies its predicate to the host and waits for it, a pipeline drain per layer. A verification of short chunks runs KDA's
  decode recurrence only (no chunk kernel, whose tiling switch is such a branch) and MLA's decode rows; the
  general verification program (a prefill chunk beside the drafts) keeps the chunk path."""
import re

import jax
import jax.numpy as jnp
import pytest

from k3jax.cache import SeqChunk, make_step_batch, pool_shapes
from k3jax.config import ModelConfig
from k3jax.nnx_model import make_step
from k3jax.params import param_shapes
from k3jax.presets import preset_config_dict
from pallas_kernels.backend import Backend

_DOT = re.compile(r"stablehlo\.dot_general (.*?) : (\(.*?\) -> tensor<[^>]*>)")


@pytest.fixture(scope="module")
def programs():
    """{"decode": text, "verify": text, "verify-mixed": text}: the step programs lowered for CUDA (the last: the
    general verification program, which also runs chunks longer than the drafts)."""
    c = ModelConfig.from_dict(preset_config_dict("kimi-linear-48b-a3b"))
    backend = Backend(kernels=True, platform="gpu", device="gpu", mla_decode="mosaic", dense_in_place=True)
    params = param_shapes(c, jnp.bfloat16)
    pools = pool_shapes(c, 258, 16, 6, jnp.bfloat16)
    pages = list(range(1, 41))
    decode = make_step_batch([SeqChunk([5], 600, pages, 1, 1)], 16, num_tokens=16, num_seqs=4, max_pages=256)
    verify = make_step_batch([SeqChunk([5, 6, 7, 8, 9], 600, pages, 1, 1, spec_slots=[2, 3, 4, 5, 1])], 16,
                             num_tokens=16, num_seqs=4, max_pages=256, spec_width=5)
    assert decode.decode_only and not verify.decode_only and verify.verify_only
    step = jax.jit(make_step(c, backend))
    out = {name: step.trace(params, pools, batch).lower(lowering_platforms=("cuda",)).as_text()
           for name, batch in (("decode", decode), ("verify", verify),
                               ("verify-mixed", verify.replace(verify_only=False)))}
    jax.clear_caches()          # nothing traced for the GPU is reused by a later CPU call
    return out


def _row_gemms(text: str) -> set:
    """(operand and result types) of the program's matmuls without batch dimensions."""
    return {types for attrs, types in _DOT.findall(text) if "batching_dims" not in attrs}


def test_verification_rows_meet_decodes_gemm_shapes(programs):
    dec, ver = _row_gemms(programs["decode"]), _row_gemms(programs["verify"])
    # the projections of every layer kind, the router, the dense and shared MLPs and the LM head
    assert len(dec) >= 10
    assert "(tensor<4x2304xbf16>, tensor<2304x163840xbf16>) -> tensor<4x163840xf32>" in dec
    assert ver == dec, f"only in verification: {sorted(ver - dec)}; only in decode: {sorted(dec - ver)}"


@pytest.mark.parametrize("name", ["decode", "verify"])
def test_the_layer_scan_is_the_only_device_loop(programs, name):
    assert programs[name].count("stablehlo.while") == 1


@pytest.mark.parametrize("name", ["decode", "verify"])
def test_steps_run_on_the_kernels(programs, name):
    text = programs[name]
    assert "ragged_dot" not in text                            # routed experts: the MoE kernels
    for kernel in ("moe_gmm_bf16", "kda_decode", "mla_paged", "stacked_matmuls"):
        assert f'name = "{kernel}' in text, kernel
    assert 'name = "kda_intra' not in text                     # short chunks: no chunk kernel
    # KDA's recurrence: the decode kernel, or for a verification chunk's tokens one launch of the positions kernel
    # (not the decode kernel once per position, with a gather and a scatter around each launch)
    positions = 'name = "kda_decode_positions"' in text
    assert positions == (name == "verify") and ('name = "kda_decode"' in text) == (name == "decode")


@pytest.mark.parametrize("name", ["decode", "verify"])
def test_steps_do_not_branch_on_device_values(programs, name):
    assert "stablehlo.case" not in programs[name] and "stablehlo.if" not in programs[name]


def test_the_general_verification_keeps_the_chunk_path(programs):
    text = programs["verify-mixed"]
    assert 'name = "kda_intra' in text and "stablehlo.case" in text
