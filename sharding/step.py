"""A sharded model step and a small multi-sequence greedy driver (checks, demos, multi-host tests).

`sharded_step(c, mesh, pools)` jits the model's step (k3jax/nnx_model.py) with the pools donated and kept on their
rule shardings, logits replicated (every process can read them), and expert parallelism in its
backend. The engine's own step is built the same way (serving/runner.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.cache import SeqChunk, make_step_batch
from k3jax.nnx_model import make_step
from pallas_kernels.backend import resolve
from sharding import moe_ep
from sharding.rules import pool_shardings, replicated


def sharded_step(c, mesh, pools, *, expert_parallel: bool = True, backend=None) -> Callable:
    """jit(model step): (params, pools, batch) -> (logits [N, V] replicated, pools); pools donated.

    mesh None: the plain single-device step. expert_parallel: the routed experts run expert-parallel
    on the mesh (moe_ep.expert_parallel). backend: the kernels' backend (None: detected now).
    """
    b = moe_ep.expert_parallel(backend, mesh) if (mesh is not None and expert_parallel) else resolve(backend)

    fn = make_step(c, b)
    if mesh is None:
        return jax.jit(fn, donate_argnums=1)
    return jax.jit(fn, out_shardings=(replicated(mesh), pool_shardings(c, mesh, pools)), donate_argnums=1)


def greedy(step: Callable, params, pools, prompts: Sequence[Sequence[int]], max_new: int, *,
           page_size: int, bucket_tokens: int, pages_per_seq: int,
           put: Callable = lambda b: b, on_logits: Callable | None = None) -> list[list[int]]:
    """Greedy continuation of several prompts at once: one prefill step, then one decode step per token.

    Sequence i uses KDA slot i+1 and MLA pages 1 + i*pages_per_seq ... (id 0 stays the sink).
    Every step has bucket_tokens tokens and len(prompts) sequences, so `step` compiles once.
    put(batch) -> batch lets multi-host callers broadcast/replicate the host batch first;
    on_logits(np.ndarray [N, V]) sees each step's logits. Returns the new ids per prompt.
    """
    n = len(prompts)
    pages = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(n)]
    kw = dict(num_tokens=bucket_tokens, num_seqs=n, max_pages=pages_per_seq)
    chunks = [SeqChunk(list(p), 0, pages[i], -1, i + 1) for i, p in enumerate(prompts)]
    done = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    batch = make_step_batch(chunks, page_size, **kw)
    for _ in range(max_new):
        logits, pools = step(params, pools, put(batch))
        host = np.asarray(jax.device_get(logits), np.float32)
        if on_logits is not None:
            on_logits(host)
        nxt = host.argmax(-1)
        for i in range(n):
            out[i].append(int(nxt[i]))
        batch = make_step_batch([SeqChunk([out[i][-1]], done[i], pages[i], i + 1, i + 1) for i in range(n)],
                                page_size, **kw)
        done = [d + 1 for d in done]
    return out
