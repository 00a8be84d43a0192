"""KDA (Kimi Delta Attention) ops: pure-jnp reference now, Pallas kernels to follow."""
from pallas_kernels.kda.reference import (  # noqa: F401
    chunk_kda_reference, kda_gate, l2norm, recurrent_kda_reference)
