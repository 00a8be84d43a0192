"""The routed experts' serving layout: gate and up as one merged weight (w13), built once at load.

The fused expert MLP then runs one matmul of 2 bn columns per tile instead of two of bn
(pallas_kernels/moe/layout.py; faster at prefill, docs/performance.md "Tuning of record"; MXFP4 with h
handed to the down kernel in its operand order). Checkpoints keep w1 / w3: `split_gate_up`
is applied on the way out (k3jax.api.Model.checkpoint_params). Works on either layer layout (a list
of layers, or k3jax.layer_stack's stacked one: stacked expert leaves [L, E, ...]).

load_model merges only when asked (merged_experts=True, `--merged-experts`) (opt-in until the merged kernels are measured end to
end on the GPU). Only for single-device models running the GPU kernels: the MXFP4 merged rows hold the features in
halves order over the whole intermediate width, which a tensor-parallel split of that width would cut
into the wrong features; expert parallelism (sharding/moe_ep.py) keeps the checkpoint layout.
"""
from __future__ import annotations

from pallas_kernels.moe import layout

_MXFP4 = ("w1_packed", "w1_scale", "w3_packed", "w3_scale")


def _map_experts(params, fn):
    """params with fn applied to every routed-experts dict (the "experts" entries of MoE layers)."""
    if isinstance(params, dict):
        return {k: fn(v) if k == "experts" and isinstance(v, dict) else _map_experts(v, fn)
                for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(_map_experts(v, fn) for v in params)
    return params


def merge_experts(pe: dict) -> dict:
    """One routed-experts dict with w1 / w3 (bf16 or MXFP4) merged into w13 (others: unchanged)."""
    rest = {k: v for k, v in pe.items() if k not in ("w1", "w3") + _MXFP4}
    if "w1" in pe:
        return {"w13": layout.merge_gate_up(pe["w1"], pe["w3"]), **rest}
    if "w1_packed" in pe:
        p, s = layout.merge_gate_up_mxfp4((pe["w1_packed"], pe["w1_scale"]), (pe["w3_packed"], pe["w3_scale"]))
        return {"w13_packed": p, "w13_scale": s, **rest}
    return pe


def split_experts(pe: dict) -> dict:
    """Inverse of merge_experts: w13 split back into w1 / w3, bit for bit."""
    rest = {k: v for k, v in pe.items() if k not in ("w13", "w13_packed", "w13_scale")}
    if "w13" in pe:
        w1, w3 = layout.split_gate_up(pe["w13"], pe["w13"].ndim - 1)
        return {"w1": w1, "w3": w3, **rest}
    if "w13_packed" in pe:
        (p1, s1), (p3, s3) = layout.unmerge_gate_up_mxfp4((pe["w13_packed"], pe["w13_scale"]))
        return {"w1_packed": p1, "w1_scale": s1, "w3_packed": p3, "w3_scale": s3, **rest}
    return pe


def merge_gate_up(params):
    """The parameter tree with every routed-experts dict's w1 / w3 (bf16 or MXFP4) merged into w13."""
    return _map_experts(params, merge_experts)


def split_gate_up(params):
    """Inverse of merge_gate_up (bit for bit): the checkpoint's w1 / w3 back."""
    return _map_experts(params, split_experts)


def experts_merged(params) -> bool:
    """Whether the tree's routed experts are in the merged layout."""
    found = []
    _map_experts(params, lambda pe: found.append("w13" in pe or "w13_packed" in pe) or pe)
    return any(found)
