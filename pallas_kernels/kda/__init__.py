"""KDA (Kimi Delta Attention): Pallas kernels (GPU/Triton) with a pure-jnp reference.

Public ops: chunk_kda (prefill), fused_recurrent_kda (decode against a state pool),
fused_recurrent_kda_positions (a verification chunk's tokens decoded in order, a state kept per position),
plus the reference ops and the gate / l2norm helpers.
"""
from pallas_kernels.kda.ops import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_positions  # noqa: F401
from pallas_kernels.kda.reference import (  # noqa: F401
    chunk_kda_reference, kda_gate, l2norm, recurrent_kda_reference)
