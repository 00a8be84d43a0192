"""Probe: cuDNN's fused attention (through jax) at MLA prefill shapes, next to the Triton expanded kernel.

  python -m benchmarks.probe_cudnn_mla [--heads 32] [--chunk 4096]

MLA's expanded prefill is multi-head attention with q/k head dim 192 (128 nope + 64 rope) and v head
dim 128. A long prompt's chunk attends to (a) its whole earlier context, no mask, and (b) itself,
causal; (a) can run in key blocks whose partial results merge by log-sum-exp. This checks that
cuDNN takes those shapes on this GPU (q/v head dims differ: cuDNN >= 9.10 on Hopper), that its
log-sum-exp output merges blocks exactly, and how fast each part runs (TFLOP/s, causal FLOPs counted).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import time

import jax
import jax.numpy as jnp

from jax._src.cudnn import fused_attention_stablehlo as cudnn_attn


def bench(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def reference(q, k, v, scale, causal):
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        t, s_len = q.shape[1], k.shape[1]
        mask = jnp.arange(t)[:, None] + (s_len - t) >= jnp.arange(s_len)[None, :]
        s = jnp.where(mask[None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                       # [b, h, t]
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    return o, lse


def cudnn(q, k, v, scale, causal):
    mask = cudnn_attn.MaskType.CAUSAL if causal else cudnn_attn.MaskType.NO_MASK
    return cudnn_attn.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                            return_residual=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--keys", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# probe_cudnn_mla {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}, commit {commit}, host {platform.node()}")
    scale = 192 ** -0.5
    key = jax.random.PRNGKey(0)

    # correctness, small: causal square and a no-mask block, lse included; then a two-block merge
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, 256, 4, 192), jnp.bfloat16)
    k = jax.random.normal(kk, (1, 768, 4, 192), jnp.bfloat16)
    v = jax.random.normal(kv, (1, 768, 4, 128), jnp.bfloat16)
    for causal, kk_ in ((True, k[:, :256]), (False, k)):
        vv = v[:, :kk_.shape[1]]
        o, lse = cudnn(q, kk_, vv, scale, causal)
        ro, rlse = reference(q, kk_, vv, scale, causal)
        lse = jnp.asarray(lse, jnp.float32)
        lse = lse if lse.shape == rlse.shape else jnp.swapaxes(lse, 1, 2)
        print(f"RESULT check causal={causal} out_err={float(jnp.max(jnp.abs(o.astype(jnp.float32) - ro))):.3e} "
              f"lse_shape={tuple(lse.shape)} lse_err={float(jnp.max(jnp.abs(lse - rlse))):.3e}")
    # merge: prefix (no mask, keys 0..511) + chunk causal (keys 512..767) == causal with offset
    o1, l1 = cudnn(q, k[:, :512], v[:, :512], scale, False)
    o2, l2 = cudnn(q, k[:, 512:], v[:, 512:], scale, True)
    l1 = jnp.asarray(l1, jnp.float32)
    l2 = jnp.asarray(l2, jnp.float32)
    if l1.shape[1] != q.shape[1]:                   # [b, h, t] -> [b, t, h]
        l1, l2 = jnp.swapaxes(l1, 1, 2), jnp.swapaxes(l2, 1, 2)
    m = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - m)[..., None], jnp.exp(l2 - m)[..., None]
    merged = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    ro, _ = reference(q, k, v, scale, True)
    print(f"RESULT merge err={float(jnp.max(jnp.abs(merged - ro))):.3e}")

    print("| heads | part | queries | keys | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for h in args.heads:
        t = args.chunk
        q = jax.random.normal(kq, (1, t, h, 192), jnp.bfloat16)
        for s in args.keys:
            k = jax.random.normal(kk, (1, s, h, 192), jnp.bfloat16)
            v = jax.random.normal(kv, (1, s, h, 128), jnp.bfloat16)
            for causal in ((True, False) if s == t else (False,)):
                f = jax.jit(lambda q, k, v, c=causal: cudnn(q, k, v, scale, c))
                try:
                    sec = bench(f, q, k, v)
                except Exception as e:      # noqa: BLE001  (a probe: report and go on)
                    print(f"| {h} | {'causal' if causal else 'prefix'} | {t} | {s} | failed: {type(e).__name__}: {str(e)[:120]} | |")
                    continue
                pairs = t * s / (2 if causal else 1)
                flops = 2 * pairs * h * (192 + 128)
                print(f"| {h} | {'causal' if causal else 'prefix'} | {t} | {s} | {sec * 1e3:.3f} | {flops / sec / 1e12:.0f} |")


if __name__ == "__main__":
    main()
