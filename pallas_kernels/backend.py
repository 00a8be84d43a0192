"""How a model step runs its heavy ops, as one value: built once per model / runner and closed over by
the jitted step, so nothing is read from globals or the environment while a step is traced.

`detect()` builds it from the choices below (the engine's `kernels` / `mla_prefill` / `mla_decode`
fields, serving/engine_args.py; every one "auto" by default) and the JAX backend. `kernels`:
  "auto": Pallas kernels on GPU/TPU, the pure-jnp references on CPU;
  "reference": always the references; "pallas": always the kernels (interpret mode on CPU).
`mla_prefill` is the MLA prefill form (k3jax/layers/mla.py): "auto" (expanded for
large prefill steps when the GPU kernel is there), "absorbed" or "expanded".
`mla_decode` is the GPU kernel of decode-only MLA steps: "mosaic"
(pallas_kernels/mla/mosaic_gpu.py, Hopper's wgmma and TMA, at >= 64 heads and 16-bit caches where its tiling
fits; the Triton kernel elsewhere), "triton", or "auto" (default): "mosaic" on compute capability 9.x,
else "triton". K3's 96 heads as MLA.step calls it: 1.5-1.9x the Triton kernel (docs/performance.md).
`platform` picks the kernel family ("gpu": Triton, "tpu": Mosaic); tests pass "tpu" to run the TPU
kernels in interpret mode on CPU. sharding.moe_ep.expert_parallel(backend, mesh) adds expert
parallelism (`routed_experts`), so the model's layers never import sharding (no moe <-> moe_ep cycle).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

# (no module-level jax import: the CLIs read these choices to build their --help without starting JAX)
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
                                      # | "cudnn-split" (one sequence's prefix unmasked + its chunk causal in
                                      # cuDNN, else "triton"; pallas_kernels/mla/long_prefix_split.py)
    experts_in_place: bool = True     # scanned layers: the MoE kernels read a layer's experts in the stack
    dense_in_place: bool = False      # scanned layers: few-row steps' dense matmuls read the layer's weight
                                      # in the stack (GPU kernels, unsharded weights: serving.runner sets it
                                      # unless EngineArgs.dense_in_place is False)
    routed_experts: Optional[Callable] = None   # (pe, z, weights, ids, c, backend) -> y: expert parallel

    def replace(self, **kw) -> "Backend":
        return dataclasses.replace(self, **kw)


def check_choice(value: str, what: str, choices: tuple) -> str:
    """value if it is one of choices, else a ValueError naming `what`."""
    if value not in choices:
        raise ValueError(f"{what} {value!r}: expected one of {choices}")
    return value


def detect(mode: str = "auto", platform: str | None = None, mla_prefill: str = "auto",
           mla_decode: str = "auto") -> Backend:
    """The backend for this process's default JAX device. mode: the kernels choice (MODES);
    mla_prefill: MLA_PREFILL_FORMS; mla_decode: MLA_DECODE_KERNELS ("auto": Mosaic on Hopper)."""
    import jax
    check_choice(mode, "kernels", MODES)
    check_choice(mla_prefill, "mla_prefill", MLA_PREFILL_FORMS)
    check_choice(mla_decode, "mla_decode", MLA_DECODE_KERNELS)
    device = jax.default_backend()
    if mla_decode == "auto":
        mla_decode = "mosaic" if device == "gpu" and _hopper() else "triton"
    kernels = mode == "pallas" or (mode == "auto" and device != "cpu")
    return Backend(kernels=kernels, interpret=kernels and device == "cpu", platform=platform or device,
                   device=device, pool_bits=device == "cpu", mla_prefill=mla_prefill, mla_decode=mla_decode)


def _hopper() -> bool:
    """Compute capability 9.x (H100 / H200): what the Mosaic GPU MLA decode kernel is written for."""
    import jax
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return cc.split(".")[0] == "9"


def resolve(backend: Backend | None) -> Backend:
    """backend, or (for direct calls of an op or layer outside a model step) the detected default."""
    return detect() if backend is None else backend
