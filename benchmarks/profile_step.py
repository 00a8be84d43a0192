"""Where an engine step's device time goes, op by op, as the product runs it (prints tables).

  python -m benchmarks.profile_step --model kimi-linear-48b-a3b --layers 4 --budget 4096 --max-num-seqs 64 \
      --scenario prefill:2x2048 --scenario prefill:64x64 --scenario decode:16x1024

Each scenario drives `k3jax.LLM`'s engine with random prompts (prefix caching off): `prefill:KxL` runs K
prompts of L tokens with max_tokens=1 (three rounds: the first compiles, the last is traced);
`decode:NxL` runs N prompts of L tokens and times the decode steps. The traced step's GPU kernels are
grouped by the named scope of the op that launched them (the `jax.named_scope`s in k3jax/layers and
serving/runner.py, read from XLA's optimized-HLO dump), next to the step's wall time on the host.
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import statistics
import sys
import tempfile
import time

from benchmarks.bench_e2e import PARTS, floor_parts, part_of, truncated_preset
from benchmarks.harness import copy_bandwidth, header

STEP_MODULES = ("jit_step", "jit_run")      # the runner's step (plain / the async wrapper's name)
_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = ')
_META = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
_COMP = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')


def hlo_op_names(dump_dir: str, program_id) -> dict:
    """{instruction name: JAX op_name} from the optimized HLO of the step module `program_id` (the
    dump's module number). A fusion without metadata of its own takes the first op_name inside the
    computation it calls."""
    names, first_in_comp, calls = {}, {}, {}
    paths = [p for name in STEP_MODULES
             for p in glob.glob(os.path.join(dump_dir, f"module_{int(program_id):04d}.{name}*after_optimizations.txt"))]
    for path in paths:
        comp = None
        with open(path) as f:
            for line in f:
                m = _COMP.match(line)
                if m and " = " not in line:
                    comp = m.group(1)
                    continue
                m = _INSTR.match(line)
                if not m:
                    continue
                meta, call = _META.search(line), _CALLS.search(line)
                if meta:
                    names[m.group(1)] = meta.group(1)
                    first_in_comp.setdefault(comp, meta.group(1))
                elif call:
                    calls[m.group(1)] = call.group(1)
                    operands = re.search(r"\(([^)]*)\)", line[m.end():])
                    if operands:     # the label for an op XLA made up (e.g. a dtype conversion)
                        names.setdefault("?" + m.group(1), operands.group(1)[:40])
    for instr, comp in calls.items():
        if instr not in names and comp in first_in_comp:
            names[instr] = first_in_comp[comp]
    return names


def scope_of(op_name: str, depth: int) -> str:
    """'jit(step)/model/kda_chunk/pjit(...)/...' -> 'model/kda_chunk' (named scopes only)."""
    parts = [p for p in op_name.split("/") if p and "(" not in p and not p.startswith("jvp")]
    return "/".join(parts[:depth]) or "(other)"


def device_events(trace_dir: str):
    """(name, duration_ns, stats, start_ns) of every event on the GPU planes of the newest trace."""
    from jax.profiler import ProfileData
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    data = ProfileData.from_file(files[-1])
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    for plane in gpu or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if gpu and "stream" not in line.name.lower():      # kernels live on the "Stream #.." lines
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                if gpu or str(stats.get("hlo_module", "")).startswith(STEP_MODULES):   # CPU: the step's thunks
                    yield ev.name, ev.duration_ns, stats, ev.start_ns


def summarize(trace_dir: str, dump_dir: str, steps: int, depth: int = 3, top: int = 12,
              events_csv: str | None = None):
    """Print the traced steps' kernels by scope, kernel and part; events_csv: also every kernel event of the traced
    steps, one CSV row each (program, start, duration, kernel, HLO op, JAX op name, scope, part), for reading
    offline."""
    events = list(device_events(trace_dir))
    programs = collections.Counter(st.get("program_id") for _, _, st, _ in events if st.get("program_id") is not None)
    names = hlo_op_names(dump_dir, programs.most_common(1)[0][0]) if programs else {}
    by_scope, by_kernel, by_part, other, part_kernel = (collections.defaultdict(float) for _ in range(5))
    count, part_count = collections.Counter(), collections.Counter()
    total = 0.0
    scopes = []
    rows = [("program", "start_ns", "dur_ns", "kernel", "hlo_op", "op_name", "scope", "part")]
    for name, dur, stats, start in events:
        tf_op = str(stats.get("tf_op", ""))
        op = (tf_op if "/" in tf_op else "") or names.get(str(stats.get("hlo_op", "")), "")
        hlo = str(stats.get("hlo_op", name))
        scope = scope_of(op, depth) if op else f"(no scope) {hlo[:30]}({names.get('?' + hlo, '')})"
        scopes.append(scope)
        by_scope[scope] += dur
        part = part_of(op) if op else "other"
        rows.append((stats.get("program_id", ""), start, dur, name, hlo, op, scope, part))
        by_part[part] += dur
        if part == "other":
            other[f"{name[:40]} ({scope_of(op, 6) if op else hlo[:30]})"] += dur
        by_kernel[name[:70]] += dur
        part_kernel[part, name[:50]] += dur
        part_count[part, name[:50]] += 1
        count[scope] += 1
        total += dur
    if events_csv:
        with open(events_csv, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    if events and not names:
        print("  (no op names: stats of one event:", {k: str(v)[:60] for k, v in events[0][2].items()}, ")")
    if not total:
        print("  (no device events of the step in the trace)")
        return 0.0, {}
    ms = lambda ns: ns / steps / 1e6          # noqa: E731 - per traced step
    print(f"  device time per step: {ms(total):.2f} ms (sum of kernel durations)")
    print("  | scope | ms/step | share | kernels/step |")
    print("  |---|---|---|---|")
    for s, d in sorted(by_scope.items(), key=lambda kv: -kv[1]):
        if d / total < 0.002:
            continue
        print(f"  | {s} | {ms(d):.3f} | {100 * d / total:.1f}% | {count[s] / steps:.0f} |")
    print("  top kernels: " + "; ".join(f"{k} {ms(d):.2f} ms" for k, d in
                                          sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]))
    print("  top kernels of part 'other' (outside the layers' named scopes): " + "; ".join(
        f"{k} {ms(d):.3f} ms" for k, d in sorted(other.items(), key=lambda kv: -kv[1])[:top]))
    for part in sorted({p for p, _ in part_kernel}, key=lambda p: -by_part[p]):
        kernels = sorted(((n, d) for (p, n), d in part_kernel.items() if p == part), key=lambda kv: -kv[1])
        launched = sum(part_count[part, n] for n, _ in kernels) / steps
        print(f"  part {part}: {ms(by_part[part]):.3f} ms in {launched:.0f} kernels/step; " + "; ".join(
            f"{n} x{part_count[part, n] / steps:.0f} {ms(d):.3f} ms" for n, d in kernels[:top]))
    busy = idle_gaps(events, scopes, steps)
    return ms(total), {p: ms(d) for p, d in by_part.items()}, busy


def busy_time(events):
    """(busy ns: the union of the events' intervals over all streams, span ns: first start to last end, gaps:
    [(gap ns, index of the event before it, index of the event after it)]) of (name, duration_ns, stats,
    start_ns) events."""
    order = sorted(range(len(events)), key=lambda i: events[i][3])
    busy, gaps, end, last = 0, [], None, None
    for i in order:
        start, stop = events[i][3], events[i][3] + events[i][1]
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, last, i))
            busy, end, last = busy + stop - start, stop, i
        elif stop > end:
            busy, end, last = busy + stop - end, stop, i
    return busy, end - events[order[0]][3], gaps


def idle_gaps(events, scopes, steps: int, top: int = 10, min_us: float = 20.0):
    """Where the GPU waits: the traced span less the union of kernel intervals (all streams), and the
    longest gaps with the kernels around them. A gap inside a step is a launch, a host sync (a
    conditional's predicate read back, a transfer) or a kernel waiting on the host."""
    busy, span, gaps = busy_time(events)
    per = lambda ns: ns / steps / 1e6          # noqa: E731
    small = sum(g for g, _, _ in gaps if g < min_us * 1e3)
    print(f"  GPU timeline per step: span {per(span):.2f} ms, busy {per(busy):.2f} ms, idle {per(span - busy):.2f} ms "
          f"({len(gaps) / steps:.0f} gaps; {per(small):.2f} ms in gaps < {min_us:.0f} us); span covers {steps} steps "
          "and the host time between them")
    busy_ms = per(busy)
    print("  | gap us | after kernel (scope) | before kernel (scope) |")
    print("  |---|---|---|")
    for g, a, b in sorted(gaps, key=lambda x: -x[0])[:top]:
        print(f"  | {g / 1e3:,.0f} | {events[a][0][:40]} ({scopes[a]}) | {events[b][0][:40]} ({scopes[b]}) |")
    return busy_ms


def run_prefill(eng, k: int, length: int, vocab: int, rng, trace_dir, dump_dir, events_csv=None):
    from serving.sampling_params import SamplingParams
    import jax
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rounds = []
    for r in range(3):
        for i in range(k):
            eng.add_request(rng.randint(0, vocab, length).tolist(), sp, request_id=f"p{r}-{i}")
        steps = []
        ctx = jax.profiler.trace(trace_dir) if r == 2 else _null()
        with ctx:
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
        rounds.append(steps)
    last = rounds[-1]
    print(f"  steps per round {len(last)}; wall per step (round 2, 3): "
          f"{[round(x * 1e3, 1) for x in rounds[1]]} / {[round(x * 1e3, 1) for x in last]} ms; "
          f"prefill {k * length / sum(last):.0f} tok/s")
    summarize(trace_dir, dump_dir, steps=len(last), events_csv=events_csv)


def print_decode_parts(parts_ms: dict, busy_ms: float, wall_ms: float, floors: dict, bw: float):
    """Each part's kernel time next to its floor (its bytes at the copy bandwidth), and the host's share."""
    floor_total = sum(floors.values()) / bw * 1e3
    print(f"  decode step by part vs its floor (copy {bw / 1e12:.2f} TB/s; floor {floor_total:.2f} ms, "
          f"wall {wall_ms:.2f} ms = {wall_ms / floor_total:.2f}x):")
    print("  | part | kernel ms | share of kernels | floor ms | share of floor | kernel/floor |")
    print("  |---|---|---|---|---|---|")
    kernels = sum(parts_ms.values())
    for part in PARTS:
        k, f = parts_ms.get(part, 0.0), floors[part] / bw * 1e3
        ratio = f"{k / f:.2f}" if f > 0.005 else "-"
        print(f"  | {part} | {k:.3f} | {100 * k / kernels:.1f}% | {f:.3f} | {100 * f / floor_total:.1f}% | {ratio} |")
    print(f"  | GPU idle in the traced steps (host, launches, syncs) | {wall_ms - busy_ms:.3f} (wall - busy) | | 0 | | |")


def run_decode(eng, n: int, length: int, vocab: int, rng, trace_dir, dump_dir, out_tokens=24, traced=4,
               model=None, bw=None, events_csv=None):
    from serving.sampling_params import SamplingParams
    import jax
    sp = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    for i in range(n):
        eng.add_request(rng.randint(0, vocab, length).tolist(), sp, request_id=f"d-{i}")
    times, seen = [], 0
    while eng.has_unfinished():
        decoding = all(r.output_ids for r in eng.requests.values()) if eng.requests else False
        if decoding and seen == 8:
            with jax.profiler.trace(trace_dir):
                for _ in range(traced):
                    eng.step()
            seen += traced
            continue
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if decoding and len(outs) == n:
            times.append(dt)
            seen += 1
    wall = statistics.median(times) * 1e3
    print(f"  decode steps {len(times)}, median wall {wall:.2f} ms")
    _, parts_ms, busy = summarize(trace_dir, dump_dir, steps=traced, events_csv=events_csv)
    if parts_ms and model is not None and bw:
        print_decode_parts(parts_ms, busy, wall, floor_parts(model, n, length + out_tokens // 2), bw)


def kda_variants(model, T=4096, seqs=2, bucket=64):
    """ops.kda_chunk as the isolated benchmark calls it vs as the model's step calls it: synthetic
    vs the model's own q/k/v/g/beta (layer 0's KDA weights, random bf16 activations), no cu_seqlens
    vs `seqs` sequences in a cu_seqlens padded to `bucket` entries with gathered initial states."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from k3jax.layers import kda as kda_layer
    from benchmarks.harness import time_jax as time_call
    from pallas_kernels import ops
    c = model.config
    li = c.kda_layers[0]
    attn = kda_layer.KDA.of(c, model.layer_params(li)["attn"])
    x = (jax.random.normal(jax.random.PRNGKey(0), (1, T, c.hidden_size)) * 0.5).astype(jnp.bfloat16)

    def model_inputs(x):
        x_in, f, beta, _ = attn.projections(x, c)
        return (*attn.core(x, kda_layer.causal_conv(x_in, attn.conv_weights()), f, c), beta)

    real = jax.jit(model_inputs)(x)
    H, K = c.kda_num_heads, c.kda_head_dim
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    nrm = lambda a: a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)   # noqa: E731
    synth = (nrm(jax.random.normal(ks[0], (1, T, H, K))).astype(jnp.bfloat16),
             nrm(jax.random.normal(ks[1], (1, T, H, K))).astype(jnp.bfloat16),
             jax.random.normal(ks[2], (1, T, H, K)).astype(jnp.bfloat16),
             -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (1, T, H, K)) * 2),
             jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H))).astype(jnp.bfloat16))
    g = np.asarray(real[3], np.float32)
    print(f"  model gate g: min {g.min():.3g} median {np.median(g):.3g} max {g.max():.3g}; "
          f"beta mean {float(jnp.mean(real[4].astype(jnp.float32))):.3f}; dtypes "
          f"{[str(a.dtype) for a in real]}")
    cu = np.full(bucket + 1, T, np.int32)
    cu[:seqs + 1] = np.linspace(0, T, seqs + 1).astype(np.int32)
    cu = jnp.asarray(cu)
    s0 = jnp.zeros((bucket, H, K, K), jnp.float32)
    scale = K ** -0.5
    plain = jax.jit(lambda q, k, v, g, b: ops.kda_chunk(q, k, v, g, b, scale=scale))
    varlen = jax.jit(lambda q, k, v, g, b, cu, s0: ops.kda_chunk(q, k, v, g, b, scale=scale, initial_state=s0,
                                                                 cu_seqlens=cu))
    exact = jax.jit(lambda q, k, v, g, b, cu, s0: ops.kda_chunk(q, k, v, g, b, scale=scale, initial_state=s0,
                                                                cu_seqlens=cu))
    cu_exact = cu[:seqs + 1]
    print("  | inputs | call | ms |")
    print("  |---|---|---|")
    fp32_qk = (real[0].astype(jnp.float32), real[1].astype(jnp.float32)) + tuple(real[2:])
    for name, (q, k, v, g, b) in (("synthetic", synth), ("model's", real), ("model's, q/k fp32", fp32_qk)):
        q, k, v = (a.reshape(1, T, H, K) for a in (q, k, v))
        print(f"  | {name} | B=1, no cu_seqlens | {time_call(plain, q, k, v, g, b) * 1e3:.3f} |", flush=True)
        print(f"  | {name} | {seqs} seqs, cu_seqlens of {bucket} | "
              f"{time_call(varlen, q, k, v, g, b, cu, s0) * 1e3:.3f} |", flush=True)
        print(f"  | {name} | {seqs} seqs, cu_seqlens of {seqs} | "
              f"{time_call(exact, q, k, v, g, b, cu_exact, s0[:seqs]) * 1e3:.3f} |", flush=True)


def probe_ops(model, chunks, T, N, page_size):
    """Run the step's KDA and MLA ops alone at a failed step's exact layout, to name the failing one."""
    import jax
    import jax.numpy as jnp
    from k3jax.cache import make_step_batch
    from pallas_kernels import ops
    c = model.config
    b = make_step_batch(chunks, page_size, num_tokens=T, num_seqs=N)
    H, K = c.kda_num_heads, c.kda_head_dim
    q = jnp.full((1, T, H, K), 0.05, jnp.bfloat16)
    g = jnp.full((1, T, H, K), -0.1, jnp.float32)
    beta = jnp.full((1, T, H), 0.5, jnp.float32)
    s0 = jnp.zeros((N, H, K, K), jnp.float32)
    L, R, Hm = c.kv_lora_rank, c.mla_cache_dim - c.kv_lora_rank, c.mla_num_heads
    pages = jnp.zeros((int(b.block_tables.max()) + 1, page_size, c.mla_cache_dim), jnp.bfloat16)
    for name, fn in (
            ("kda_chunk", lambda: ops.kda_chunk(q, q, q, g, beta, scale=K ** -0.5, initial_state=s0,
                                                cu_seqlens=jnp.asarray(b.cu_seqlens))),
            ("mla_ragged_paged", lambda: ops.mla_ragged_paged(
                jnp.zeros((T, Hm, L), jnp.bfloat16), jnp.zeros((T, Hm, R), jnp.bfloat16), pages,
                jnp.asarray(b.block_tables), jnp.asarray(b.cu_seqlens), jnp.asarray(b.kv_lens), scale=0.1))):
        try:
            jax.block_until_ready(jax.jit(fn)())
            print(f"  probe {name}: ok")
        except Exception as e:  # noqa: BLE001 - the point is to name the failure
            print(f"  probe {name}: FAILS: {str(e).splitlines()[0][:160]}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (same pattern)")
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: longest scenario prompt + 64")
    ap.add_argument("--scenario", action="append", default=None, help="prefill:KxL or decode:NxL")
    ap.add_argument("--kernels", default="auto", choices=("auto", "reference", "pallas"),
                    help="the model's kernels choice (EngineArgs.kernels)")
    ap.add_argument("--memory-fraction", type=float, default=None)
    ap.add_argument("--kda-variants", action="store_true", help="ops.kda_chunk isolated vs as the step calls it")
    ap.add_argument("--decode-steps-per-launch", type=int, default=1,
                    help="EngineArgs.decode_steps_per_launch (1: each traced engine step is one step program, "
                         "so kernel time divides by the traced steps; the engine's default scans 8 a launch)")
    ap.add_argument("--out", default=None, help="directory for the trace and the HLO dump")
    ap.add_argument("--events", default=None,
                    help="directory: each scenario's traced kernels as CSV (<scenario>.csv, one row a kernel)")
    ap.add_argument("--command-buffers", default="off",
                    help="off (kernels attributed to their ops), default (XLA's own), or XLA's "
                         "--xla_gpu_enable_command_buffer list, e.g. FUSION,CUBLAS,CUSTOM_CALL,WHILE")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="k3jax-profile-")
    dump_dir, trace_dir = os.path.join(out, "hlo"), os.path.join(out, "trace")
    if args.events:
        os.makedirs(args.events, exist_ok=True)
    # command buffers (CUDA graphs) hide which HLO op launched each kernel: off unless asked
    buffers = {"off": " --xla_gpu_enable_command_buffer=", "default": ""}.get(
        args.command_buffers, f" --xla_gpu_enable_command_buffer={args.command_buffers}")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} "
                               "--xla_dump_hlo_module_re=" + "|".join(STEP_MODULES) + buffers).strip()
    import jax
    import numpy as np
    from k3jax.api import load_model
    from k3jax.offline import LLM
    name = truncated_preset(args.model, args.layers) if args.layers else args.model
    t0 = time.perf_counter()
    model = load_model(name, dtype="bfloat16", seed=0, kernels=args.kernels)
    jax.block_until_ready(model.params)
    print(header(f"profile_step {name}"), flush=True)
    print(f"# load {time.perf_counter() - t0:.1f}s; "
          f"kernels {args.kernels}; "
          f"command buffers {args.command_buffers}; decode steps a launch {args.decode_steps_per_launch}", flush=True)
    if args.kda_variants:
        print("\n## ops.kda_chunk, T=4096", flush=True)
        kda_variants(model)
    scenarios = args.scenario or ["prefill:2x2048", "prefill:64x64", "decode:16x1024"]
    longest = max(int(sc.split(":")[1].split("x")[1]) for sc in scenarios)
    args.max_model_len = args.max_model_len or longest + 64
    kw = {} if args.memory_fraction is None else {"memory_fraction": args.memory_fraction}
    bw = copy_bandwidth(1.0 if jax.default_backend() == "cpu" else 4.0)[0] if any(
        sc.startswith("decode") for sc in scenarios) else None
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
              max_model_len=args.max_model_len, enable_prefix_caching=False, warmup=False,
              compilation_cache_dir=None, decode_steps_per_launch=args.decode_steps_per_launch, **kw)
    eng = llm.engine
    print(f"buckets: tokens {eng.runner.token_buckets}, seqs {eng.runner.seq_buckets}; "
          f"pools {eng.runner.pools.num_pages} pages, {eng.runner.pools.num_slots} slots", flush=True)
    rng = np.random.RandomState(0)
    last = {}
    execute = eng.runner.execute

    def remember(chunks, *a, **kw):
        last["chunks"] = list(chunks)
        return execute(chunks, *a, **kw)
    eng.runner.execute = remember
    for sc in scenarios:
        kind, shape = sc.split(":")
        n, length = (int(x) for x in shape.split("x"))
        print(f"\n## {sc}", flush=True)
        tdir = os.path.join(trace_dir, sc.replace(":", "_"))
        events = os.path.join(args.events, sc.replace(":", "_") + ".csv") if args.events else None
        try:
            if kind == "prefill":
                run_prefill(eng, n, length, model.config.vocab_size, rng, tdir, dump_dir, events)
            else:
                run_decode(eng, n, length, model.config.vocab_size, rng, tdir, dump_dir, model=model, bw=bw,
                           events_csv=events)
        except Exception as e:  # noqa: BLE001 - report, name the op, go on with the next scenario
            from serving.step_shapes import step_shape
            chunks, r = last.get("chunks", []), eng.runner
            T, N = step_shape(sum(len(ch.tokens) for ch in chunks), len(chunks), r.token_buckets, r.seq_buckets,
                              r.long_token_buckets)
            print(f"  FAILED: {str(e).splitlines()[0][:200]}\n  at a step of {len(chunks)} chunks "
                  f"(lengths {sorted(len(ch.tokens) for ch in chunks)[-6:]}...), bucket T={T} N={N}")
            probe_ops(model, chunks, T, N, eng.args.page_size)
            break
        sys.stdout.flush()


if __name__ == "__main__":
    main()
