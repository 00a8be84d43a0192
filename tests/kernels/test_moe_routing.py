"""Routing permutation (pallas_kernels/moe/routing.py): the counting sort used at decode sizes is the
stable argsort, and sort_by_expert gives the same permutation on both of its paths."""
import numpy as np

import jax.numpy as jnp

from pallas_kernels.moe import routing


def test_counting_sort_is_the_stable_argsort():
    key = np.random.RandomState(0).randint(0, 9, 300).astype(np.int32)       # many ties
    order, inverse, counts = routing._counting_sort(jnp.asarray(key), 9)
    want = np.argsort(key, kind="stable")
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(key, minlength=9))
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(inverse)[want], np.arange(300))


def test_sort_by_expert_on_both_paths():
    ids = np.random.RandomState(1).randint(-2, 20, (64, 8)).astype(np.int32)  # ids outside [0, 16) too
    small = routing.sort_by_expert(jnp.asarray(ids), 16)                     # counting (64 * 8 * 17 cells)
    big_t = np.concatenate([ids] * 200)                                      # 12800 x 8 x 17 cells: argsort
    assert big_t.size * 17 > routing.COUNTING_SORT_MAX_CELLS >= ids.size * 17
    big = routing.sort_by_expert(jnp.asarray(big_t), 16)
    flat = np.where((ids >= 0) & (ids < 16), ids, 16).reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(np.asarray(small[0]), order // 8)
    np.testing.assert_array_equal(np.asarray(small[1]), np.bincount(flat, minlength=17)[:16])
    np.testing.assert_array_equal(np.asarray(small[2])[order], np.arange(flat.size))
    flat_big = np.where((big_t >= 0) & (big_t < 16), big_t, 16).reshape(-1)
    order_big = np.argsort(flat_big, kind="stable")
    np.testing.assert_array_equal(np.asarray(big[0]), order_big // 8)
    np.testing.assert_array_equal(np.asarray(big[1]), 200 * np.asarray(small[1]))
    np.testing.assert_array_equal(np.asarray(big[2])[order_big], np.arange(flat_big.size))
