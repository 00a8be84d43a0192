"""MoE kernels: grouped matmul (bf16, MXFP4), routing permutation, fused expert MLP."""
from pallas_kernels.moe.mlp import expert_mlp, expert_mlp_mxfp4
from pallas_kernels.moe.grouped import gmm, gmm_mxfp4, gmm_mxfp4_reference, gmm_reference
from pallas_kernels.moe.kernel import glu_activation
from pallas_kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from pallas_kernels.moe.routing import combine, sort_by_expert
from pallas_kernels.moe.schedule import Tiling

__all__ = [
    "Tiling", "combine", "dequantize_mxfp4", "expert_mlp", "expert_mlp_mxfp4",
    "glu_activation", "gmm", "gmm_mxfp4", "gmm_mxfp4_reference", "gmm_reference",
    "quantize_mxfp4", "sort_by_expert",
]
