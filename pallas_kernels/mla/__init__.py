"""Paged MLA attention (absorbed form) over the 576-wide latent cache.

Public API:
  write_kv_pages(kv_pages, new_kv, slot_mapping) -> kv_pages
  mla_paged_decode(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale, interpret=None)
  ragged_paged_mla(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                   interpret=None)
  ragged_paged_mla_reference / mla_decode_reference: pure-jnp references.
"""
from pallas_kernels.mla.paged import mla_paged_decode, ragged_paged_mla
from pallas_kernels.mla.reference import (mla_decode_reference, ragged_paged_mla_reference,
                                          write_kv_pages)

__all__ = ["write_kv_pages", "mla_paged_decode", "ragged_paged_mla",
           "ragged_paged_mla_reference", "mla_decode_reference"]
