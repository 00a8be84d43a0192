"""Token <-> expert permutation helpers (argsort based; decode sizes by counting over a [T*k, E+1] one-hot)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sort_by_expert(expert_ids: jax.Array, num_experts: int):
  """Sort the T*k (token, slot) assignments by expert.

  expert_ids [T, k] int. Ids outside [0, num_experts) (e.g. experts held by another
  device under expert parallelism) sort last and belong to no group, so a grouped
  matmul leaves their rows zero.
  Returns (sorted_token_index [T*k] int32: source token of each sorted row,
           group_sizes [num_experts] int32,
           inverse [T*k] int32: sorted position of flat assignment t*k + j).
  """
  t, k = expert_ids.shape
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)
  if t * k * (num_experts + 1) <= COUNTING_SORT_MAX_CELLS:
    order, inverse, counts = _counting_sort(key, num_experts + 1)
    group_sizes = counts[:num_experts]        # the sort's own counts: no scatter-add kernel of its own
  else:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((t * k,), jnp.int32).at[order].set(
        jnp.arange(t * k, dtype=jnp.int32), unique_indices=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[key].add(1, mode="drop")
  return order // k, group_sizes, inverse


# Decode-sized routing (T*k x (E+1) cells up to this) sorts by counting: a few fused passes over the
# [T*k, E+1] one-hot, where a radix sort launches several kernels per MoE layer (~1 ms of a
# Kimi-Linear c64 decode step on a GPU).
COUNTING_SORT_MAX_CELLS = 1 << 20


def _counting_sort(key, num_keys: int):
  """(order, inverse, counts) of a stable sort of int keys in [0, num_keys): order = argsort(key, stable),
  inverse[i] = sorted position of element i, counts [num_keys] the elements of each key."""
  n = key.shape[0]
  onehot = (key[:, None] == jnp.arange(num_keys, dtype=jnp.int32)[None, :]).astype(jnp.int32)
  counts = jnp.sum(onehot, axis=0)
  starts = jnp.cumsum(counts) - counts
  before = jnp.cumsum(onehot, axis=0) - onehot          # earlier elements with the same key
  inverse = starts[key] + jnp.take_along_axis(before, key[:, None], axis=1)[:, 0]
  order = jnp.zeros((n,), jnp.int32).at[inverse].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
  return order, inverse, counts


def combine(expert_out: jax.Array, weights: jax.Array, inverse: jax.Array,
            out_dtype=None, valid_rows=None) -> jax.Array:
  """Weighted sum back to token order: expert_out [T*k, D] (sorted rows), weights [T, k],
  inverse [T*k] from sort_by_expert -> [T, D] (fp32 accumulation, out_dtype default
  expert_out.dtype).

  valid_rows (traced int): rows of expert_out at or past it belong to no local expert (other
  devices' ids sort last) and may hold garbage: they contribute 0 and are never read (their
  gathers all point at row 0), so under expert parallelism the combine reads only local rows.
  """
  t, k = weights.shape
  if valid_rows is None:
    y = expert_out[inverse].reshape(t, k, -1).astype(jnp.float32)
    out = jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32))
    return out.astype(out_dtype or expert_out.dtype)
  local = (inverse < valid_rows).reshape(t, k, 1)
  y = expert_out[jnp.where(inverse < valid_rows, inverse, 0)].reshape(t, k, -1)
  y = jnp.where(local, y.astype(jnp.float32), 0.0)
  # multiply + reduce over k, so that XLA can fuse the gather into the reduction
  out = jnp.sum(y * weights.astype(jnp.float32)[:, :, None], axis=1)
  return out.astype(out_dtype or expert_out.dtype)
