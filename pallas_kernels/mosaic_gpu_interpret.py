"""Faster Mosaic GPU interpret mode for tests and CPU smoke runs.

jax's interpreter (jax._src.pallas.mosaic.interpret.thread_map, jax 0.10-0.11) traces, lowers and
compiles each simulated warpgroup's program afresh for every thread of every grid point (~0.8 s a
thread on a 2-core CPU). `reuse_compiled_threads()` memoises the compiled program per (jaxpr text,
argument shapes), so retraces of the same kernel share it too: the same executable, called the same
way, so what runs is unchanged; a CTA then costs milliseconds after the first. Each thread's inputs
are made host arrays first: with device-array inputs XLA:CPU may queue the execution on its thread
pool (as many threads as cores), where the interpreter's outer program and a warpgroup blocked on a
barrier can hold every thread while the warpgroup that would release them waits: a deadlock seen
about once in five bench runs on 2 cores before. It is rarer, not gone: one more in the bench's
ops-path row on jax 0.11.2, none in ~15 runs of tests/kernels/test_mla_mosaic_gpu.py (which carries a 120 s
timeout). Private API: where it is missing this does nothing.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np


def _cached_runner(compiled):
    texts = {}  # id(jaxpr) -> (jaxpr, its text): a retrace of the same kernel prints the same jaxpr

    def run(jaxpr, consts, *args):
        if id(jaxpr) not in texts:
            texts[id(jaxpr)] = (jaxpr, str(jaxpr))
        key = (texts[id(jaxpr)][1], tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves((consts, args))))
        exe = compiled.get(key)
        if exe is None:  # two threads may both compile the first time: harmless
            def body(jaxpr, consts, *args):
                jax.core.eval_jaxpr(jaxpr, consts, *args)
            exe = compiled[key] = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        # host (numpy) inputs: the execution can run at once on this thread instead of waiting for
        # device arrays on XLA's CPU pool, whose few threads the other blocked warpgroups may hold
        consts, args = jax.tree.map(np.asarray, (consts, args))
        jax.block_until_ready(exe(consts, *args))
    return run


@contextlib.contextmanager
def reuse_compiled_threads():
    """Within the context, the Mosaic GPU interpreter compiles each thread program once."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - another jax layout: run as is
        yield
        return
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None:  # pragma: no cover
        yield
        return
    thread_map._run_jaxpr = _cached_runner({})
    try:
        yield
    finally:
        thread_map._run_jaxpr = original
