"""How a model step runs its heavy ops, as one value: built once per model / runner and closed over by
the jitted step, so nothing is read from globals or the environment while a step is traced.

`detect()` builds the default from `K3JAX_KERNELS` and the JAX backend:
  "auto" (default): Pallas kernels on GPU/TPU, the pure-jnp references on CPU;
  "reference": always the references; "pallas": always the kernels (interpret mode on CPU).
`mla_prefill` is the MLA prefill form (`K3JAX_MLA_PREFILL`, k3jax/layers/mla.py): "auto" (expanded for
large prefill steps when the GPU kernel is there), "absorbed" or "expanded".
`mla_decode` is the GPU kernel of decode-only MLA steps (`K3JAX_MLA_DECODE`): "mosaic"
(pallas_kernels/mla/mosaic_gpu.py, Hopper's wgmma and TMA, at >= 64 heads and 16-bit caches where its tiling
fits; the Triton kernel elsewhere), "triton", or "auto" (default): "mosaic" on compute capability 9.x,
else "triton". H200, K3's 96 heads as MLA.step calls it: 1.5-1.9x the Triton kernel (docs/benchmarks.md).
`platform` picks the kernel family ("gpu": Triton, "tpu": Mosaic); tests pass "tpu" to run the TPU
kernels in interpret mode on CPU. sharding.moe_ep.expert_parallel(backend, mesh) adds expert
parallelism (`routed_experts`), so the model's layers never import sharding (no moe <-> moe_ep cycle).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import jax

MODES = ("auto", "reference", "pallas")
MLA_PREFILL_FORMS = ("auto", "absorbed", "expanded")
MLA_DECODE_KERNELS = ("auto", "mosaic", "triton")


@dataclasses.dataclass(frozen=True)
class Backend:
    kernels: bool = False             # the Pallas kernels (False: the jnp references)
    interpret: bool = False           # kernels in Pallas interpret mode (no accelerator)
    platform: str = "cpu"             # kernel family: "gpu" (Triton), "tpu" (Mosaic); "cpu": none
    device: str = "cpu"               # where the step runs (jax.default_backend() when detected)
    mxfp4_decoder: str = "ptx8"       # the GPU kernel's in-register MXFP4 decoder (moe/mxfp4.py)
    pool_bits: bool = False           # 16-bit float pools stored as uint16 bits (pallas_kernels/scatter.py:
                                      # XLA:CPU converts whole bf16 pools in scatters and looped gathers)
    mla_prefill: str = "auto"         # MLA prefill form: "auto" | "absorbed" | "expanded"
    mla_decode: str = "triton"        # decode-only MLA kernel: "triton" | "mosaic" (Hopper; detect() picks)
    mla_prefix_kernel: str = "triton" # GPU attention of the expanded MLA form's key windows: "triton" (Pallas)
                                      # | "cudnn" (jax's cuDNN fused attention; pallas_kernels/mla/long_prefix_cudnn.py)
    experts_in_place: bool = True     # scanned layers: the MoE kernels read a layer's experts in the stack
    dense_in_place: bool = False      # scanned layers: few-row steps' dense matmuls read the layer's weight
                                      # in the stack (GPU kernels, unsharded weights: serving.runner sets it)
    routed_experts: Optional[Callable] = None   # (pe, z, weights, ids, c, backend) -> y: expert parallel

    def replace(self, **kw) -> "Backend":
        return dataclasses.replace(self, **kw)


def _choice(value: str | None, env: str, what: str, choices: tuple) -> str:
    """value, else the environment variable env (default "auto"), checked against choices."""
    from_env = value is None
    value = os.environ.get(env, "auto") if from_env else value
    if value not in choices:
        raise ValueError(f"{env + '=' if from_env else what + ' '}{value!r}: expected one of {choices}")
    return value


def detect(mode: str | None = None, platform: str | None = None, mla_prefill: str | None = None,
           mla_decode: str | None = None) -> Backend:
    """The backend for this process's default JAX device. mode: None reads K3JAX_KERNELS (default auto);
    mla_prefill: None reads K3JAX_MLA_PREFILL (default auto); mla_decode: None reads K3JAX_MLA_DECODE
    (default auto)."""
    mode = _choice(mode, "K3JAX_KERNELS", "kernel mode", MODES)
    mla_prefill = _choice(mla_prefill, "K3JAX_MLA_PREFILL", "MLA prefill form", MLA_PREFILL_FORMS)
    mla_decode = _choice(mla_decode, "K3JAX_MLA_DECODE", "MLA decode kernel", MLA_DECODE_KERNELS)
    device = jax.default_backend()
    if mla_decode == "auto":
        mla_decode = "mosaic" if device == "gpu" and _hopper() else "triton"
    kernels = mode == "pallas" or (mode == "auto" and device != "cpu")
    return Backend(kernels=kernels, interpret=kernels and device == "cpu", platform=platform or device,
                   device=device, pool_bits=device == "cpu", mla_prefill=mla_prefill, mla_decode=mla_decode)


def _hopper() -> bool:
    """Compute capability 9.x (H100 / H200): what the Mosaic GPU MLA decode kernel is written for."""
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return cc.split(".")[0] == "9"


def resolve(backend: Backend | None) -> Backend:
    """backend, or (for direct calls of an op or layer outside a model step) the detected default."""
    return detect() if backend is None else backend
