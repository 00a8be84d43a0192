"""Speculative verification's step program, lowered for the GPU (no GPU needed: jax lowers for "cuda" on CPU), at
Kimi-Linear-48B's shapes in the engine's c1 bucket (16 tokens, 4 sequences): every matmul XLA runs on the rows of a
verification step has a shape that the decode step's program also runs. A verified token rounds as decoding it
only if its rows meet the same GEMMs; one of another shape (a [T, D] LM head over all positions at once, a
projection over a gathered subset of rows) gets another kernel from XLA and flips near-ties of greedy decoding."""
import re

import jax
import jax.numpy as jnp

from k3jax.cache import SeqChunk, make_step_batch, pool_shapes
from k3jax.config import ModelConfig
from k3jax.nnx_model import make_step
from k3jax.params import param_shapes
from k3jax.presets import preset_config_dict
from pallas_kernels.backend import Backend

_DOT = re.compile(r"stablehlo\.dot_general (.*?) : (\(.*?\) -> tensor<[^>]*>)")


def _row_gemms(text: str) -> set:
    """(operand and result types) of the program's matmuls without batch dimensions."""
    return {types for attrs, types in _DOT.findall(text) if "batching_dims" not in attrs}


def test_verification_rows_meet_decodes_gemm_shapes():
    c = ModelConfig.from_dict(preset_config_dict("kimi-linear-48b-a3b"))
    backend = Backend(kernels=True, platform="gpu", device="gpu", mla_decode="mosaic", dense_in_place=True)
    params = param_shapes(c, jnp.bfloat16)
    pools = pool_shapes(c, 258, 16, 6, jnp.bfloat16)
    pages = list(range(1, 41))
    decode = make_step_batch([SeqChunk([5], 600, pages, 1, 1)], 16, num_tokens=16, num_seqs=4, max_pages=256)
    verify = make_step_batch([SeqChunk([5, 6, 7, 8, 9], 600, pages, 1, 1, spec_slots=[2, 3, 4, 5, 1])], 16,
                             num_tokens=16, num_seqs=4, max_pages=256, spec_width=5)
    assert decode.decode_only and not verify.decode_only
    step = jax.jit(make_step(c, backend))

    def gemms(batch):
        return _row_gemms(step.trace(params, pools, batch).lower(lowering_platforms=("cuda",)).as_text())

    dec, ver = gemms(decode), gemms(verify)
    # the projections of every layer kind, the router, the dense and shared MLPs and the LM head
    assert len(dec) >= 10
    assert "(tensor<4x2304xbf16>, tensor<2304x163840xbf16>) -> tensor<4x163840xf32>" in dec
    assert ver == dec, f"only in verification: {sorted(ver - dec)}; only in decode: {sorted(dec - ver)}"
