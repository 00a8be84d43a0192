"""How a model step runs its heavy ops, as one value: built once per model / runner and closed over by
the jitted step, so nothing is read from globals or the environment while a step is traced.

`detect()` builds the default from `K3JAX_KERNELS` and the JAX backend:
  "auto" (default): Pallas kernels on GPU/TPU, the pure-jnp references on CPU;
  "reference": always the references; "pallas": always the kernels (interpret mode on CPU).
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


@dataclasses.dataclass(frozen=True)
class Backend:
    kernels: bool = False             # the Pallas kernels (False: the jnp references)
    interpret: bool = False           # kernels in Pallas interpret mode (no accelerator)
    platform: str = "cpu"             # kernel family: "gpu" (Triton), "tpu" (Mosaic); "cpu": none
    device: str = "cpu"               # where the step runs (jax.default_backend() when detected)
    mxfp4_decoder: str = "ptx8"       # the GPU kernel's in-register MXFP4 decoder (moe/mxfp4.py)
    scatter_bits: bool = False        # 16-bit pool scatters as uint16 bits (XLA:CPU converts bf16 pools)
    experts_in_place: bool = True     # scanned layers: the MoE kernels read a layer's experts in the stack
    routed_experts: Optional[Callable] = None   # (pe, z, weights, ids, c, backend) -> y: expert parallel

    def replace(self, **kw) -> "Backend":
        return dataclasses.replace(self, **kw)


def detect(mode: str | None = None, platform: str | None = None) -> Backend:
    """The backend for this process's default JAX device. mode: None reads K3JAX_KERNELS (default auto)."""
    env = mode is None
    mode = os.environ.get("K3JAX_KERNELS", "auto") if env else mode
    if mode not in MODES:
        raise ValueError(f"{'K3JAX_KERNELS=' if env else 'kernel mode '}{mode!r}: expected one of {MODES}")
    device = jax.default_backend()
    kernels = mode == "pallas" or (mode == "auto" and device != "cpu")
    return Backend(kernels=kernels, interpret=kernels and device == "cpu", platform=platform or device,
                   device=device, scatter_bits=device == "cpu")


def resolve(backend: Backend | None) -> Backend:
    """backend, or (for direct calls of an op or layer outside a model step) the detected default."""
    return detect() if backend is None else backend
