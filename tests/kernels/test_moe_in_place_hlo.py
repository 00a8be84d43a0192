"""The MoE layer as the model calls it (MoE.__call__ over experts stacked over scanned layers, layer traced)
lowered for the GPU from CPU, at K3's real shapes (112 local MXFP4 experts, merged gate/up): the Triton
kernels take the stacked expert arrays themselves, and no op outside them copies, slices, pads or
gathers anything of a layer's experts' size. Stacks whose arrays hold 2-4 GiB of one-byte elements
(grouped.overflows_i32_offsets) are the one case that copies the layer's slice: checked too, so the
detector is seen to find a copy. Shapes only: nothing is allocated."""
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks.kernels_moe import STACK_WINDOW, case_config, stack_depth
from k3jax.layers.moe import MoE
from k3jax.params import moe_spec, random_values
from pallas_kernels.backend import Backend
from pallas_kernels.moe import grouped as gm

_TENSOR = re.compile(r"tensor<((?:\d+x)+)(\w+)>")


def _elements(dims: str) -> int:
    n = 1
    for d in dims.rstrip("x").split("x"):
        n *= int(d)
    return n


def _lowered(c, experts, depth, tokens):
    """StableHLO text of the MoE layer over the stacked experts, lowered for CUDA (the Triton kernels)."""
    backend = Backend(kernels=True, platform="gpu", device="gpu")
    spec = moe_spec(c, merged_experts=True)
    key = jax.random.key(0)
    values = jax.eval_shape(lambda: random_values({k: v for k, v in spec.items() if k != "experts"}, key))
    values["experts"] = experts
    x = jax.ShapeDtypeStruct((tokens, c.hidden_size), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    fn = jax.jit(lambda v, x, r: MoE.of(c, v, merged_experts=True)(x, c, r, backend))
    return fn.trace(values, x, layer).lower(lowering_platforms=("cuda",)).as_text()


def _layer_sized_ops(text: str, layer_elements: int):
    """Lines of ops other than the Triton calls and reshapes (merging the stack's leading axes: a bitcast
    in XLA) whose result holds >= one layer's smallest expert array."""
    out = []
    for line in text.splitlines():
        if "=" not in line or "xla.gpu.triton" in line or "func.func" in line or "stablehlo.reshape" in line:
            continue
        result = line.split("->")[-1] if "->" in line else line.split(":")[-1]
        if any(_elements(dims) >= layer_elements for dims, _ in _TENSOR.findall(result)):
            out.append(line.strip()[:200])
    return out


@pytest.mark.parametrize("tokens", [16])
def test_k3_moe_layer_reads_the_stacked_experts_in_place(tokens):
    c = case_config("kimi-k3", 112, False)
    spec = moe_spec(c, merged_experts=True)["experts"]
    one = jax.eval_shape(lambda: random_values(spec, jax.random.key(1)))
    smallest = min(a.size for a in jax.tree_util.tree_leaves(one))      # w2's scales: 38.5M elements

    def stacked(depth):
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((depth,) + a.shape, a.dtype), one)

    depth = stack_depth(spec, tiny=False)           # the models' regime: no array in the 2-4 GiB window
    assert depth > STACK_WINDOW
    text = _lowered(c, stacked(depth), depth, tokens)
    assert _layer_sized_ops(text, smallest) == []
    # both kernels (up: merged gate/up; down) take the whole flat stacks [depth * E, ...] as operands
    calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
    assert len(calls) == 2
    flat = {f"{depth * 112}x{'x'.join(map(str, a.shape[1:]))}xui8" for a in jax.tree_util.tree_leaves(one)}
    operands = set(re.findall(r"tensor<([\dx]+xui8)>", " ".join(calls)))
    assert flat <= operands, (flat, operands)

    # 4 layers: the down projection's stack holds 2.47e9 one-byte elements: its slice is copied
    window = stacked(STACK_WINDOW)
    assert any(gm.overflows_i32_offsets((a.shape[0] * a.shape[1],) + a.shape[2:], a.dtype)
               for a in jax.tree_util.tree_leaves(window))
    copies = _layer_sized_ops(_lowered(c, window, STACK_WINDOW, tokens), smallest)
    assert copies and all("dynamic_slice" in line for line in copies), copies
