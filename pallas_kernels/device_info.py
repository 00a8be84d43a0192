"""Facts about the accelerator that kernel tilings depend on."""
from __future__ import annotations

import jax


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H200; elsewhere a guess)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


# Opt-in shared memory per thread block (bytes), by CUDA compute capability
_SMEM_PER_BLOCK = {"8.0": 163 * 1024, "8.7": 163 * 1024, "8.6": 99 * 1024, "8.9": 99 * 1024,
                   "9.0": 227 * 1024, "10.0": 227 * 1024, "12.0": 99 * 1024}
HOPPER_SMEM_PER_BLOCK = 227 * 1024  # H100 / H200: 232448 bytes


def smem_per_block() -> int:
    """Shared memory one kernel block may use on the default device. Off GPU (CPU interpret
    mode) the H200's, so tests see the tiling the GPU gets."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return _SMEM_PER_BLOCK.get(str(cc), HOPPER_SMEM_PER_BLOCK)
