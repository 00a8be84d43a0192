"""Where an engine step's wall time goes: the host's parts (drafting, scheduling, dispatch, waiting for the device,
bookkeeping) timed around the engine's own calls, and the device's programs from a profiler trace.

Used by `bench_spec --timeline` on its c1 rows: a speculative step is synchronous (the engine waits for the accepted
counts before it drafts again), so its wall time is the host's work plus the device's, not the larger of them.
"""
from __future__ import annotations

import collections
import contextlib
import time

# (object attribute path on the engine, part name): the calls timed, outermost first. A part's time excludes the
# parts timed inside it (launch: the dispatch of the step's programs, without building their host inputs, which
# is "inputs"; fetch is the wait for the device + transfer).
PARTS = (("spec.propose", "draft"), ("scheduler.schedule", "schedule"), ("runner.launch", "launch"),
         ("runner.launch_verify", "launch"), ("runner.launch_decode_steps", "launch"),
         ("runner._step_inputs", "inputs"), ("runner.fetch", "fetch"))


class HostTimer:
    """Wraps the engine's calls named in PARTS with timers; `parts()` gives seconds per part (exclusive)."""

    def __init__(self, engine):
        self.engine, self.saved, self.total = engine, [], collections.Counter()
        self.stack = []

    def _wrap(self, name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*a, **kw)
            finally:
                inner = self.stack.pop()
                dt = time.perf_counter() - t0
                self.total[name] += dt - inner
                if self.stack:
                    self.stack[-1] += dt
        return call

    def __enter__(self):
        for path, name in PARTS:
            owner_path, attr = path.rsplit(".", 1)
            owner = getattr(self.engine, owner_path, None)
            if owner is None or not hasattr(owner, attr):
                continue
            self.saved.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, self._wrap(name, getattr(owner, attr)))
        return self

    def __exit__(self, *exc):
        for owner, attr, old in reversed(self.saved):
            if old is None:
                delattr(owner, attr)       # the class's method again
            else:
                setattr(owner, attr, old)
        self.saved = []
        return False


def run_timed(engine, prompts, max_tokens, trace_dir=None, traced_steps=6):
    """Run `prompts` greedily to `max_tokens`; time each engine.step and the host parts. With trace_dir, the
    profiler traces `traced_steps` engine steps once the requests decode (those steps are not in the times).
    Returns (decode steps' wall seconds, {part: seconds} over them, steps traced, output tokens of the timed steps)."""
    import jax
    from serving.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"t{i}")
    walls, parts, traced, tokens = [], collections.Counter(), 0, 0
    while engine.has_unfinished():
        decoding = bool(engine.requests) and all(r.output_ids for r in engine.requests.values())
        tracing = bool(trace_dir) and decoding and len(walls) >= 4 and traced < traced_steps
        if tracing and traced == 0:
            jax.profiler.start_trace(trace_dir)
        with HostTimer(engine) as timer:
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
        if tracing:
            traced += 1
            if traced == traced_steps or not engine.has_unfinished():
                jax.profiler.stop_trace()
        elif decoding:
            walls.append(dt)
            parts.update(timer.total)
            tokens += sum(len(o.metrics.get("new_token_ids", [None])) for o in outs)
    return walls, dict(parts), traced, tokens


def device_programs(trace_dir: str, steps: int, top_kernels: int = 10):
    """Per traced step: {program: kernel ms}, (busy ms, span ms) of the GPU (union of kernel intervals) and
    {kernel name: (ms, launches)} of the most expensive kernels."""
    from benchmarks.profile_step import busy_time, device_events
    events = list(device_events(trace_dir))
    if not events:
        return {}, (0.0, 0.0), {}
    by, kernels, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for name, dur, stats, _ in events:
        by[str(stats.get("hlo_module", stats.get("program_id", "?")))] += dur
        kernels[name[:60]] += dur
        launches[name[:60]] += 1
    busy, span, _ = busy_time(events)
    per = lambda ns: ns / max(steps, 1) / 1e6      # noqa: E731
    top = {k: (per(v), launches[k] / max(steps, 1)) for k, v in kernels.most_common(top_kernels)}
    return {k: per(v) for k, v in by.most_common()}, (per(busy), per(span)), top


def report(name: str, walls, parts: dict, tokens: int, programs=None, gpu=None, top=None) -> str:
    """One markdown line group: the step's wall time and its host parts, per step and per output token."""
    n = len(walls)
    if not n:
        return f"{name}: no decode steps timed"
    wall = sum(walls)
    known = sum(parts.values())
    lines = [f"{name}: {n} steps, {wall / n * 1e3:.2f} ms a step, {wall / max(tokens, 1) * 1e3:.2f} ms an output token",
             "  host parts per step (ms): " + ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in sorted(parts.items()))
             + f", rest of engine.step {max(wall - known, 0.0) / n * 1e3:.2f}"]
    if programs:
        busy, span = gpu
        lines.append(f"  GPU per traced step: busy {busy:.2f} ms of a {span:.2f} ms span; kernels by program: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in list(programs.items())[:6]))
    if top:
        lines.append("  top kernels per traced step: " + "; ".join(f"{k} {ms:.3f} ms x{n:.0f}" for k, (ms, n) in top.items()))
    return "\n".join(lines)
