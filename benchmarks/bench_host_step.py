"""Host time of a decode step: what the Python side spends before the device can run it.

  python -m benchmarks.bench_host_step [--model tiny-random] [--seqs 4] [--steps 40] [--cache-mib M]
                                       [--decode-steps S] [--verify K] [--json]

Builds a ModelRunner on the model, prefills `--seqs` sequences, then runs `--steps` decode steps
and reports, per step (median and min over the steps, milliseconds):
  dispatch  the jitted model step's call alone, on prepared arguments (flattening the parameter
            tree and launching: what a split or merge of an NNX model on the host would add to)
  dispatch host  the same call on the batch as the runner passes it (host numpy arrays): the difference
            to dispatch is the batch's host-to-device copies, one a leaf
  put       jax.device_put of that batch and its sampling arrays, waited for (their copies alone)
  launch    runner.launch: batch and sampling arrays built, step and sampler dispatched, no wait
  step      launch + fetch of the sampled tokens (includes the device's compute)
With --decode-steps S > 1 also (per token, i.e. per launch / S):
  multi launch  runner.launch_decode_steps of S decode steps in one program, no wait
  multi step    the same with the fetch of its S x seqs tokens
With --verify K > 0 also (per verification step of K drafts a sequence, speculative decoding):
  verify launch  runner.launch_verify: the step's inputs with a KDA slot per position, the step and the
                 verification program dispatched, no wait
  verify step    the same with the fetch of its tokens and accepted counts (a verification is synchronous:
                 the engine waits for it before it drafts again)
Pools: just enough for the sequences, or with --cache-mib as the engine sizes them for that cache budget
(EngineArgs.cache_memory_bytes; the CPU default is 256 MiB): on CPU the step's time grew with the pools.
Works on any backend; nothing here is specific to one version of the runner, so the same command
measures two branches side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.harness import header


def measure(model: str = "tiny-random", seqs: int = 4, steps: int = 40, dtype: str = "float32",
            cache_mib: int | None = None, decode_steps: int = 1, verify: int = 0) -> dict:
    import jax
    import numpy as np

    from k3jax.api import load_model
    from k3jax.cache import SeqChunk, make_step_batch
    from serving.runner import ModelRunner
    from serving.sampling_params import SamplingParams

    m = load_model(model, dtype=dtype)
    page_size, max_len, prompt = 16, 256, 8
    pages_per_seq = max_len // page_size
    if decode_steps > 1:                           # room for the multi-step launches after the single steps
        max_len += (steps + 3) * decode_steps
        pages_per_seq = -(-max_len // page_size)
    num_pages, num_slots = seqs * pages_per_seq + 1, seqs + 2 + seqs * verify   # verify: a slot per draft
    if cache_mib:
        from serving.engine_args import EngineArgs, size_pools
        num_pages, num_slots = size_pools(EngineArgs(cache_memory_bytes=cache_mib << 20, max_model_len=max_len),
                                          m.config, 0, m.dtype)
    runner = ModelRunner(m.config, m.params, num_pages=num_pages, num_slots=num_slots,
                         page_size=page_size, max_model_len=max_len, max_num_seqs=seqs,
                         max_num_batched_tokens=max(32, seqs * prompt), backend=m.backend,
                         decode_steps=decode_steps, decode_steps_max_seqs=seqs if decode_steps > 1 else 0,
                         spec_width=verify + 1 if verify else 0)
    pages = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(seqs)]
    sp = [SamplingParams(temperature=0.0)] * seqs
    toks, *_ = runner.execute([SeqChunk(list(range(1, prompt + 1)), 0, pages[i], -1, i + 1) for i in range(seqs)],
                              sp, [0] * seqs, [0] * seqs)
    done = prompt

    def chunks():
        return [SeqChunk([int(toks[i])], done, pages[i], i + 1, i + 1) for i in range(seqs)]

    launch, step, dispatch = [], [], []
    for k in range(steps + 3):                     # the first decode steps compile
        t0 = time.perf_counter()
        res = runner.launch(chunks(), sp, [0] * seqs, [k] * seqs)
        t1 = time.perf_counter()
        toks = runner.fetch(res)[0]
        t2 = time.perf_counter()
        done += 1
        if k >= 3:
            launch.append(t1 - t0)
            step.append(t2 - t0)
    batch = make_step_batch(chunks(), page_size, num_tokens=runner.token_buckets[0], num_seqs=runner.seq_buckets[-1],
                            max_pages=pages_per_seq)
    sarr = runner._step_inputs(chunks(), sp, [0] * seqs, [0] * seqs, None, None, None, False)[3]
    host_dispatch, put = [], []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        logits, runner.pools = runner._step(runner.params, runner.pools, batch, runner.last_tokens)
        t1 = time.perf_counter()
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        jax.block_until_ready(jax.device_put((batch, sarr)))
        t3 = time.perf_counter()
        if k >= 3:
            host_dispatch.append(t1 - t0)
            put.append(t3 - t2)
    host_leaves = len(jax.tree_util.tree_leaves((batch, sarr)))
    batch = jax.device_put(batch)
    for k in range(steps + 3):
        t0 = time.perf_counter()
        logits, runner.pools = runner._step(runner.params, runner.pools, batch, runner.last_tokens)
        t1 = time.perf_counter()
        jax.block_until_ready(logits)
        if k >= 3:
            dispatch.append(t1 - t0)
    def ms(xs):
        return {"median_ms": round(1e3 * statistics.median(xs), 3), "min_ms": round(1e3 * min(xs), 3)}
    extra = {}
    if decode_steps > 1:
        mlaunch, mstep = [], []
        for k in range(steps + 3):
            t0 = time.perf_counter()
            res = runner.launch_decode_steps(chunks(), sp, [0] * seqs, [k] * seqs)
            t1 = time.perf_counter()
            toks = runner.fetch(res)[0][:, -1]
            t2 = time.perf_counter()
            done += decode_steps
            if k >= 3:
                mlaunch.append((t1 - t0) / decode_steps)
                mstep.append((t2 - t0) / decode_steps)
        extra = {"decode_steps": decode_steps, "multi launch": ms(mlaunch), "multi step": ms(mstep)}
    if verify:
        # every verification feeds the same K drafts after the same token (its writes land on the same rows):
        # the host's work per step does not depend on what is accepted
        spare = [list(range(seqs + 2 + i * verify, seqs + 2 + (i + 1) * verify)) for i in range(seqs)]
        vchunks = [SeqChunk([int(toks[i])] + [1] * verify, done, pages[i], i + 1, i + 1,
                            spec_slots=spare[i] + [i + 1]) for i in range(seqs)]
        vlaunch, vstep = [], []
        for k in range(steps + 3):
            t0 = time.perf_counter()
            res = runner.launch_verify(vchunks, [[1] * verify] * seqs, sp, [0] * seqs, [k] * seqs)
            t1 = time.perf_counter()
            vtoks, accepted = (np.asarray(x) for x in jax.device_get(res[:2]))
            t2 = time.perf_counter()
            if k >= 3:
                vlaunch.append(t1 - t0)
                vstep.append(t2 - t0)
        extra.update({"verify": verify, "verify launch": ms(vlaunch), "verify step": ms(vstep),
                      "verify_ok": bool(np.all((vtoks >= 0) & (vtoks < m.config.vocab_size))
                                        and np.all((accepted >= 0) & (accepted <= verify)))})
    return {"model": model, "seqs": seqs, "steps": steps, "platform": jax.default_backend(), "dtype": dtype,
            "num_pages": num_pages, "num_slots": num_slots,
            "pool_dtypes": sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(runner.pools)}),
            "param_arrays": len(jax.tree_util.tree_leaves(runner.params)),
            "host_arrays": host_leaves, "dispatch": ms(dispatch), "dispatch host": ms(host_dispatch), "put": ms(put),
            "launch": ms(launch), "step": ms(step), **extra,
            "sampled_ok": bool(np.all((toks >= 0) & (toks < m.config.vocab_size)))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-mib", type=int, default=None, help="size the pools for this cache budget")
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="also measure launches of this many decode steps (EngineArgs.decode_steps_per_launch)")
    ap.add_argument("--verify", type=int, default=0,
                    help="also measure verification steps of this many drafts a sequence (speculative decoding)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.model, a.seqs, a.steps, a.dtype, a.cache_mib, a.decode_steps, a.verify)
    if a.json:
        print(json.dumps(r))
        return
    print(header("bench_host_step: host time of one engine decode step"))
    print(f"{r['model']} ({r['dtype']}) on {r['platform']}: {r['seqs']} sequences, {r['steps']} decode steps, "
          f"{r['param_arrays']} parameter arrays, {r['host_arrays']} host arrays a step; pools {r['num_pages']} pages, {r['num_slots']} slots "
          f"({', '.join(r['pool_dtypes'])})")
    print(f"{'':<14}{'median ms':>12}{'min ms':>10}")
    rows = ("dispatch", "dispatch host", "put", "launch", "step") + (("multi launch", "multi step") if "decode_steps" in r else ())
    for k in rows + (("verify launch", "verify step") if "verify" in r else ()):
        print(f"{k:<14}{r[k]['median_ms']:>12.3f}{r[k]['min_ms']:>10.3f}")


if __name__ == "__main__":
    main()
