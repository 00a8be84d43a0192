"""`python -m k3jax.plan`: does a model fit a mesh of devices, and how many sequences of what context?

  python -m k3jax.plan --model kimi-k3 --mesh data=8,expert=64 --device h200 [--page-size 64] [--context 131072]

The memory model is the engine's (serving/engine_args.py): JAX's allocator holds ALLOCATOR_MEMORY_FRACTION of
each device; after the weights and the largest step's activations, `memory_fraction` of the rest is the
cache. Defaults (page size, memory fraction, step tokens) are the engine's, so a plan describes what
`k3jax.serve` with the same settings allocates.

Per-device bytes are computed from shapes only (jax.eval_shape: `param_shapes`, `pool_shapes`)
and the partition rules of `sharding.rules` (per-device shard shapes from the same specs that
place the real arrays), so the plan and the allocation cannot drift. Activations are an
estimate (see `activation_bytes`). Nothing is allocated.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cli_help import DefaultsHelpFormatter
from k3jax.cache import pool_shapes
from k3jax.config import ModelConfig
from k3jax.params import param_shapes
from serving.engine_args import (ACCELERATOR_BATCH_DEFAULTS, ALLOCATOR_MEMORY_FRACTION, CHOICES, EngineArgs,
                                 field_default)

GiB = 1 << 30
# Nominal HBM per device (GiB); the engine's allocator holds ALLOCATOR_MEMORY_FRACTION of it.
DEVICES = {"h100": 80, "h200": 141, "b200": 192, "tpu-v5p": 95, "tpu-v6e": 32}


def _tree_device_bytes(tree, specs, sizes) -> int:
    """Bytes one device holds of a tree placed with specs (shards are equal: the rules divide evenly)."""
    from sharding.rules import shard_shape
    leaves = jax.tree_util.tree_leaves(tree)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return sum(int(np.prod(shard_shape(x.shape, s, sizes))) * jnp.dtype(x.dtype).itemsize
               for x, s in zip(leaves, spec_leaves))


_weights_cache: dict = {}
_shapes_cache: dict = {}


def _param_shapes(c: ModelConfig, dtype):
    key = (repr(c), jnp.dtype(dtype).name)
    if key not in _shapes_cache:
        _shapes_cache[key] = param_shapes(c, dtype)
    return _shapes_cache[key]


def weight_bytes(c: ModelConfig, sizes: dict, dtype=jnp.bfloat16) -> int:
    """Per-device parameter bytes on a mesh of these axis sizes (memoized: K3 traces ~3000 leaves)."""
    from sharding.rules import param_specs
    key = (repr(c), tuple(sorted(sizes.items())), jnp.dtype(dtype).name)
    if key not in _weights_cache:
        _weights_cache[key] = _tree_device_bytes(_param_shapes(c, dtype), param_specs(c, sizes), sizes)
    return _weights_cache[key]


def vision_bytes(c: ModelConfig, sizes: dict, dtype=jnp.bfloat16) -> int:
    """Per-device bytes of the vision tower (0 for text-only configs), by the axes its parameters declare."""
    if not c.vision:
        return 0
    from k3jax.vision.config import VisionConfig
    from k3jax.vision.tower import vision_param_spec
    from k3jax.params import is_leaf
    from sharding.rules import spec_tree_specs
    spec = vision_param_spec(VisionConfig.from_dict(c.vision, text_hidden_size=c.hidden_size), c.hidden_size)
    shapes = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype(dtype)), spec,
                                    is_leaf=is_leaf)
    return _tree_device_bytes(shapes, spec_tree_specs(spec, sizes), sizes)


def pool_bytes(c: ModelConfig, sizes: dict, num_pages: int, page_size: int, num_slots: int,
               dtype=jnp.bfloat16, mla_dtype=None) -> dict:
    """Per-device bytes of the cache pools: {"mla": ..., "kda": ...} (ids 0 included); mla_dtype: the MLA
    pages' (EngineArgs.mla_cache_dtype; float8_e4m3fn: packed FP8 rows)."""
    from sharding.rules import pool_specs
    shapes = pool_shapes(c, num_pages, page_size, num_slots, dtype, mla_dtype=mla_dtype)
    specs = pool_specs(shapes, sizes)
    mla = _tree_device_bytes(shapes.mla_kv, specs.mla_kv, sizes)
    kda = _tree_device_bytes([shapes.kda_state, shapes.kda_conv], [specs.kda_state, specs.kda_conv], sizes)
    return {"mla": mla, "kda": kda}


def activation_bytes(c: ModelConfig, sizes: dict, step_tokens: int, max_seqs: int, dtype=jnp.bfloat16) -> int:
    """Estimate of one step's peak activations per device (not exact: XLA's buffer reuse varies).

    Tokens are split over data*expert. Resident across layers: the AttnRes block sums (fp32).
    Peak inside one layer: the larger of attention (q/k/v/gate fp32, per-head chunk temporaries)
    and MoE (dropless all-to-all buffers, grouped-matmul rows, dequantized local MXFP4 experts),
    plus the logits of max_seqs rows.
    """
    b = jnp.dtype(dtype).itemsize
    dp, n, t = sizes["data"] * sizes["expert"], sizes["expert"], sizes["tensor"]
    T = -(-step_tokens // dp)
    D, Dp = c.hidden_size, c.expert_hidden
    blocks = (c.num_layers // c.attn_res_block_size + 2) if c.attn_res_block_size else 2
    resident = blocks * T * D * 4
    heads = max(c.kda_num_heads * c.kda_head_dim, c.mla_num_heads * (c.qk_head_dim + c.v_head_dim)) // t
    attn = T * heads * 4 * 6 + T * (c.kda_num_heads // t) * c.kda_head_dim * 64 * 4
    rows = n * T * c.num_experts_per_token                    # dropless receive buffer rows
    I_local = c.moe_intermediate_size // t if c.moe_intermediate_size % t == 0 else c.moe_intermediate_size
    moe = 4 * rows * Dp * b + 3 * rows * I_local * b
    if c.expert_format == "mxfp4" and c.num_experts % n == 0:
        moe += 3 * (c.num_experts // n) * Dp * I_local * b   # local experts dequantized per layer
    mlp = T * (c.intermediate_size // t) * b * 3
    logits = max_seqs * (-(-c.vocab_size // t)) * 4
    return resident + max(attn, moe, mlp) + logits


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan(config: ModelConfig, mesh_spec, device: str | None = "h200", *, page_size: int = field_default("page_size"),
         context: int = 131072, batch: int | None = None, dtype=jnp.bfloat16,
         memory_fraction: float = field_default("memory_fraction"), memory_gib: float | None = None,
         step_tokens: int = ACCELERATOR_BATCH_DEFAULTS[1], extra_slots: int = 0,
         kv_cache_dtype: str = field_default("kv_cache_dtype")) -> dict:
    """Per-device memory plan. Returns a dict of bytes and the largest batch/context that fit.

    mesh_spec: "data=8,expert=64" / dict (sizes must be explicit; the product is the device count).
    batch None: find the largest batch at `context`; else also report pools for that batch.
    memory_fraction: EngineArgs.memory_fraction, the cache's share of the memory the allocator holds
    after the weights and activations. step_tokens: the largest step (EngineArgs.max_num_batched_tokens).
    extra_slots: KDA checkpoint slots kept for prefix caching (on top of one per sequence).
    kv_cache_dtype: EngineArgs.kv_cache_dtype ("fp8_e4m3": smaller MLA pages, more tokens in the budget).
    """
    from sharding.mesh import parse_mesh_spec, spec_items
    for name, value, low in (("page_size", page_size, 1), ("context", context, 1), ("step_tokens", step_tokens, 1),
                             ("batch", 1 if batch is None else batch, 1), ("extra_slots", extra_slots, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if memory_gib is not None and not memory_gib > 0:
        raise ValueError(f"memory_gib must be positive, got {memory_gib!r}")
    given = spec_items(mesh_spec or {})
    if any(v < 1 for v in given.values()):
        raise ValueError(f"mesh {mesh_spec!r}: the plan needs explicit sizes >= 1 (the product is the device count)")
    sizes = parse_mesh_spec(given, math.prod(given.values()))
    if memory_gib is None:
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)} (or memory_gib=)")
        memory_gib = DEVICES[device]
    budget = int(memory_gib * GiB * ALLOCATOR_MEMORY_FRACTION)       # what the engine's allocator holds
    cache_args = EngineArgs(kv_cache_dtype=kv_cache_dtype)
    cache_dtype, mla_dtype = cache_args.cache_dtype(dtype), cache_args.mla_cache_dtype(dtype)
    split = sizes["data"] * sizes["expert"]                    # pages and slots split over these
    w = weight_bytes(config, sizes, dtype)
    vis = vision_bytes(config, sizes, dtype)

    def seqs_fit(B: int, L: int) -> tuple[int, dict, int, int, bool]:
        pages = _round_up(B * -(-L // page_size) + 1, split)
        slots = _round_up(B + extra_slots + 1, split)
        pb = pool_bytes(config, sizes, pages, page_size, slots, cache_dtype, mla_dtype)
        act = activation_bytes(config, sizes, step_tokens, max(B, 1), dtype)
        fixed = w + vis + act
        fits = pb["mla"] + pb["kda"] <= (budget - fixed) * memory_fraction     # the engine's cache budget
        return fixed + pb["mla"] + pb["kda"], pb, pages, slots, fits

    def largest(fn, hi: int) -> int:
        """Largest x in [0, hi] with fn(x) true (fn monotone decreasing)."""
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fn(mid) else (lo, mid - 1)
        return lo

    act1 = activation_bytes(config, sizes, step_tokens, 1, dtype)
    fixed_fits = w + vis + act1 <= budget
    max_batch = largest(lambda B: seqs_fit(B, context)[4], 1 << 20) if fixed_fits else 0
    b_ctx = batch or 1
    max_ctx_pages = largest(lambda p: seqs_fit(b_ctx, p * page_size)[4],
                            -(-config.max_position_embeddings // page_size)) if fixed_fits else 0
    B = batch if batch is not None else max_batch
    total, pb, pages, slots, fits = seqs_fit(B, context)
    act = activation_bytes(config, sizes, step_tokens, max(B, 1), dtype)
    per_seq = pool_bytes(config, sizes, -(-context // page_size) * split, page_size, split, cache_dtype, mla_dtype)
    return {
        "model_layers": config.num_layers, "mesh": sizes, "devices": math.prod(sizes.values()),
        "device": device, "device_bytes": int(memory_gib * GiB), "budget_bytes": budget,
        "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
        "context": context, "batch": B, "num_pages": pages, "num_slots": slots,
        "weights_bytes": w, "vision_bytes": vis, "mla_pages_bytes": pb["mla"], "kda_states_bytes": pb["kda"],
        "activations_bytes": act, "total_bytes": total, "headroom_bytes": budget - total,
        "memory_fraction": memory_fraction, "cache_budget_bytes": int(max(budget - w - vis - act, 0) * memory_fraction),
        "fits": bool(fits and fixed_fits), "fixed_fits": bool(fixed_fits),
        "per_sequence_bytes": {"mla": per_seq["mla"] // split, "kda": per_seq["kda"] // split},
        "max_batch_at_context": max_batch, "max_context_at_batch": max_ctx_pages * page_size,
        "context_batch": b_ctx,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f} GiB" if abs(n) >= GiB or n == 0 else f"{n / (1 << 20):9.2f} MiB"


def format_plan(r: dict) -> str:
    m = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"mesh {m} ({r['devices']} devices of {r['device']}, {r['device_bytes'] / GiB:.0f} GiB; "
        f"allocator {r['budget_bytes'] / GiB:.1f} GiB per device)",
        f"  weights            {_gib(r['weights_bytes'])}",
        f"  vision tower       {_gib(r['vision_bytes'])}   (replicated)",
        f"  MLA pages          {_gib(r['mla_pages_bytes'])}   ({r['num_pages']} pages of {r['page_size']} tokens, "
        f"cache {r['kv_cache_dtype']})",
        f"  KDA states         {_gib(r['kda_states_bytes'])}   ({r['num_slots']} slots)",
        f"  activations (est.) {_gib(r['activations_bytes'])}",
        f"  total              {_gib(r['total_bytes'])}   headroom {_gib(r['headroom_bytes'])}",
        f"  cache budget       {_gib(r['cache_budget_bytes'])}   (memory fraction {r['memory_fraction']:.2f} of what "
        f"the weights and activations leave)",
        f"  per sequence of {r['context']} tokens: MLA {_gib(r['per_sequence_bytes']['mla'])}, "
        f"KDA {_gib(r['per_sequence_bytes']['kda'])} (per device, spread over data*expert)",
    ]
    if not r["fixed_fits"]:
        lines.append("DOES NOT FIT: weights + activations exceed the per-device budget; "
                     "use more devices (expert/tensor) or a bigger device")
    else:
        lines.append(f"largest batch at context {r['context']}: {r['max_batch_at_context']} sequences")
        lines.append(f"largest context at batch {r['context_batch']}: {r['max_context_at_batch']} tokens")
        if not r["fits"]:
            lines.append(f"DOES NOT FIT: batch {r['batch']} at context {r['context']} exceeds the budget")
        elif r["max_batch_at_context"] == 0:
            lines.append(f"DOES NOT FIT: not even one sequence of {r['context']} tokens")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m k3jax.plan", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="kimi-k3", help="preset name or checkpoint directory")
    ap.add_argument("--mesh", required=True, help="axis sizes, e.g. data=8,expert=64 (product = devices)")
    ap.add_argument("--device", default="h200", help=f"one of {', '.join(DEVICES)}")
    ap.add_argument("--memory-gib", type=float, default=None, help="override the device's memory")
    ap.add_argument("--memory-fraction", type=float, default=field_default("memory_fraction"),
                    help="the cache's share of the memory left after the weights and activations (as k3jax.serve's)")
    ap.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)      # the old spelling, deprecated
    ap.add_argument("--page-size", type=int, default=field_default("page_size"), help="tokens per MLA cache page")
    ap.add_argument("--context", type=int, default=131072, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default: the largest that fits)")
    ap.add_argument("--step-tokens", type=int, default=ACCELERATOR_BATCH_DEFAULTS[1],
                    help="tokens of the largest engine step (activations; k3jax.serve's --max-num-batched-tokens)")
    ap.add_argument("--extra-slots", type=int, default=0, help="KDA checkpoint slots for prefix caching")
    ap.add_argument("--kv-cache-dtype", choices=CHOICES["kv_cache_dtype"], default=field_default("kv_cache_dtype"),
                    help="as k3jax.serve's (fp8_e4m3: MLA pages in FP8 with scales)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from k3jax.presets import resolve_config
    try:
        cfg = resolve_config(args.model)
        r = plan(cfg, args.mesh, args.device, page_size=args.page_size, context=args.context, batch=args.batch,
                 memory_fraction=args.memory_fraction, memory_gib=args.memory_gib, step_tokens=args.step_tokens,
                 extra_slots=args.extra_slots, kv_cache_dtype=args.kv_cache_dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else format_plan(r))
    return 0 if r["fits"] and r["fixed_fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
