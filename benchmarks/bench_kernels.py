"""The kernel table: KDA decode, paged MLA decode (Triton and the Mosaic GPU kernel; FP8 pages), KDA chunked prefill
and the MoE's routed experts, each timed isolated AND as the model
calls it (the ops entry point with the dtypes, padding and engine layout of a real step of
Kimi-Linear-48B and of K3), with the kernel variants side by side and the anchors measured in the same
run: copy bandwidth, bf16 matmul peak, FLA (chunk_kda / fused_recurrent_kda) when it imports.

  python -m benchmarks.bench_kernels [--budget 120] [--json PATH] [--csv PATH] [--no-fla] [--tiny]
                                     [--only SECTION,...]

Rows run in priority order and no case starts after --budget seconds (a skipped row says so), so the
whole run stays under ~150 s on one H200. `--tiny` runs every row at toy sizes on CPU with the Pallas
kernels in interpret mode (checks the script, not the speed).

This file is the command line and the run (sizes, anchors, budget, the table, the sections' order); the
sections' rows are benchmarks/kernels_kda.py (kda_decode, kda_decode_model, kda_decode_variants, kda_prefill,
kda_prefill_model), kernels_mla.py (mla_decode, mla_model, mla_variants, mla_fp8), kernels_mla_mosaic.py
(mla_mosaic) and kernels_moe.py (moe); `checks` gathers the KDA and MLA check rows.
"""
from __future__ import annotations

import argparse
import time

from benchmarks import kernels_kda, kernels_mla
from benchmarks.harness import (Table, add_csv_argument, copy_bandwidth, header, matmul_peak, torch_and_fla,
                                write_json)
from benchmarks.kernels_mla import K3_128K_PAGE16, K3_8K_PAGE16, MLA_H96_VARIANTS

COLUMNS = (("kernel", "kernel"), ("case", "case"), ("call", "called as"), ("variant", "variant"),
           ("us", "us", ".0f"), ("tb_s", "TB/s", ".2f"), ("tflop_s", "TFLOP/s", ".0f"),
           ("mtok_s", "M tok/s", ".2f"), ("roof", "of roof", ".0%"), ("anchor", "anchor"),
           ("vs_anchor", "vs anchor", ".2f"), ("target", "target"))


class Run:
    """Shared state of one run: sizes (full or tiny), anchors, the budget."""

    def __init__(self, tiny, budget, fla):
        self.tiny, self.budget = tiny, budget
        self.interpret = True if tiny else None
        self.kv = 32 if tiny else 128                      # KDA K = V
        self.lat, self.rope = (64, 16) if tiny else (512, 64)
        self.reps = 1 if tiny else 10
        self.torch, self.fla, why = torch_and_fla() if fla and not tiny else (None, None, "off")
        self.fla_note = why
        self.copy_bw = self.peak = None
        self.t0 = time.time()
        self.table = Table(*COLUMNS)

    def over(self):
        return time.time() - self.t0 > self.budget

    def add(self, **row):
        line = self.table.add(**row)
        print(f"[{time.time() - self.t0:6.1f}s] {line}", flush=True)

    def skip(self, kernel, case, call, variant, why):
        self.add(kernel=kernel, case=case, call=call, variant=variant, target=f"not run ({why})")

    def timed(self, kernel, case, call, variant, fn):
        """fn() -> seconds, or None (a skipped row) past the budget or when it fails: a variant
        that does not compile is a row of the table, not the end of the run."""
        if self.over():
            self.skip(kernel, case, call, variant, "budget")
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self.skip(kernel, case, call, variant, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return None

    def check(self, kernel, variant, fn):
        """A check row: fn() -> the rel err of a kernel variant against its reference on small shapes."""
        e = self.timed(kernel, "small shapes vs reference", "check", variant, fn)
        if e is not None:
            self.add(kernel=kernel, case="small shapes vs reference", call="check", variant=variant,
                     target=f"rel err {e:.1e}")


def anchors(run):
    """Copy bandwidth (read + write) and the bf16 matmul peak, measured here."""
    bw_jax, bw_torch = copy_bandwidth(gib=1 / 64 if run.tiny else 4.0, torch=run.torch)
    run.copy_bw = bw_torch or bw_jax
    n = 256 if run.tiny else 8192
    run.peak = matmul_peak(n, reps=run.reps)
    print(f"# copy bandwidth: jax x+1 {bw_jax / 1e12:.2f} TB/s, torch copy_ "
          f"{'n/a' if bw_torch is None else f'{bw_torch / 1e12:.2f}'} TB/s (roof uses "
          f"{run.copy_bw / 1e12:.2f}); bf16 matmul {n}^3: {run.peak / 1e12:.0f} TFLOP/s; "
          f"FLA: {'imported' if run.fla else f'n/a ({run.fla_note})'}", flush=True)


# ---- the sections ---------------------------------------------------------------------------------
def moe_section(run):
    from benchmarks import kernels_moe   # imports the model (k3jax): only when the section runs
    kernels_moe.moe_section(run)


def mla_mosaic_section(run, shapes, model_cases):
    from benchmarks import kernels_mla_mosaic
    kernels_mla_mosaic.mla_mosaic_section(run, shapes, model_cases)


def checks(run):
    """The variants that could become defaults vs their references (small shapes): MLA, then KDA decode."""
    kernels_mla.check_rows(run)
    kernels_kda.check_rows(run)


# ---- the run ------------------------------------------------------------------------------------
def plan(tiny):
    """(kind, shapes) in priority order: defaults first, then the variants."""
    if tiny:
        return dict(
            kda_decode=[(4, 2)], kda_decode_variants=[(4, 2)],
            kda_decode_model=[("Kimi-Linear-48B", 3, 4, 2, 6)],
            mla=[(2, 64, 4)], mla_variants={4: [("head groups 2+2", ((2, None), (2, None))),
                                                ("R-w8-bk16", "R-w8-bk16")]},
            mla_model=[("K3", 2, 3, 48, 4, 16, (True, False, ("one group", "R-w8-r64")))],
            prefill=[(1, 64, 2)], prefill_model=[("K3", [30, 20], 64, 3, 2, True)],
            mla_mosaic=[(2, 64, 96, 64), (2, 64, 32, 64)], mla_mosaic_model=[("K3", 2, 3, 48, 96, 16)],
            mla_fp8=[(2, 64, 4)])
    return dict(
        kda_decode=[(256, 32), (256, 96)], kda_decode_variants=[(256, 32), (256, 96)],
        kda_decode_model=[("Kimi-Linear-48B", 250, 256, 32, 312), ("K3 (DP attention)", 250, 256, 96, 312)],
        mla=[(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)],
        mla_variants={96: MLA_H96_VARIANTS},
        mla_model=[("Kimi-Linear-48B", 60, 64, 8192, 32, 16, (True, False)),
                   ("Kimi-Linear-48B", 60, 64, 8192, 32, 64, (True,)),
                   ("K3 (DP attention)", 60, 64, 8192, 96, 16, (True, False, *K3_8K_PAGE16)),
                   ("K3 (DP attention)", 16, 16, 131072, 96, 16, (True, *K3_128K_PAGE16)),
                   ("K3 (tensor=8: 12 heads)", 60, 64, 8192, 12, 16, (True,)),
                   # one user at 128k in the engine's smallest (4-sequence) bucket: the key splits its live
                   # sequence gets, against the bucket's fixed plan (33 splits a tile, all live)
                   ("Kimi-Linear-48B, one user", 1, 4, 131072, 32, 16, (True, ("33 splits, all live", "T-w4-s33"))),
                   ("K3 (DP attention), one user", 1, 4, 131072, 96, 16, (True,))],
        prefill=[(16, 4096, 32), (2, 32768, 32), (16, 4096, 96), (2, 32768, 96)],
        prefill_model=[("Kimi-Linear-48B", [2000, 2000], 4096, 4, 32, False),
                       ("K3 (DP attention)", [2000, 2000], 4096, 4, 96, True)],
        mla_mosaic=[(64, 8192, 96, 64), (16, 131072, 96, 64), (64, 8192, 32, 64)],
        mla_mosaic_model=[("K3 (DP attention)", 60, 64, 8192, 96, 16), ("K3 (DP attention)", 60, 64, 8192, 96, 64),
                          ("K3 (DP attention)", 16, 16, 131072, 96, 16)],
        mla_fp8=[(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)])


# run order: defaults first, the checks of every timed config, then the variants
SECTIONS = ("kda_decode", "kda_decode_model", "mla_decode", "mla_model", "kda_prefill", "kda_prefill_model",
            "moe", "checks", "kda_decode_variants", "mla_variants", "mla_mosaic", "mla_fp8")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", "--deadline", type=float, default=120.0, help="start no case after (s)")
    ap.add_argument("--tiny", "--smoke", action="store_true", help="toy shapes, CPU interpret mode")
    ap.add_argument("--no-fla", action="store_true", help="skip the FLA anchor even if it imports")
    ap.add_argument("--only", default=None, metavar="SECTION,...",
                    help=f"run only these sections (anchors always run): {','.join(SECTIONS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows and anchors as JSON")
    add_csv_argument(ap)
    args = ap.parse_args(argv)
    only = SECTIONS if args.only is None else tuple(x.strip().replace("-", "_") for x in args.only.split(",") if x.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    run = Run(args.tiny, args.budget, fla=not args.no_fla)
    from pallas_kernels.backend import detect
    run.backend = detect("pallas")     # the model-path rows run the kernels (interpreted on CPU) as the step does
    from pallas_kernels.kda import chunk_pallas, recurrent_pallas
    from pallas_kernels.mla import paged
    print(header("kernel table (anchors and tuning below)"))
    print(f"# KDA chunk CONFIG {chunk_pallas.CONFIG}\n# KDA decode CONFIG {recurrent_pallas.CONFIG}\n# MLA decode tuning H=32 {paged.default_tuning(32, True)}, H=96 "
          + ", ".join(f"page {ps} {'<' if k < 65536 else '>='} 64k keys {paged.default_tuning(96, True, k, ps)}"
                      for ps in (64, 16) for k in (8192, 131072)), flush=True)
    anchors(run)
    p = plan(args.tiny)
    steps = dict(
        kda_decode=lambda: kernels_kda.kda_decode_rows(run, p["kda_decode"], None),
        kda_decode_model=lambda: kernels_kda.kda_decode_model_rows(run, p["kda_decode_model"]),
        mla_decode=lambda: kernels_mla.mla_decode_rows(run, p["mla"], {}),
        mla_model=lambda: kernels_mla.mla_decode_model_rows(run, p["mla_model"]),
        kda_prefill=lambda: kernels_kda.kda_prefill_rows(run, p["prefill"]),
        kda_prefill_model=lambda: kernels_kda.kda_prefill_model_rows(run, p["prefill_model"]),
        kda_decode_variants=lambda: kernels_kda.kda_decode_rows(run, p["kda_decode_variants"],
                                                                kernels_kda.KDA_DECODE_VARIANTS),
        moe=lambda: moe_section(run),
        checks=lambda: checks(run),
        mla_variants=lambda: kernels_mla.mla_decode_rows(run, [s for s in p["mla"] if s[2] in p["mla_variants"]],
                                                         p["mla_variants"], with_default=False),
        mla_mosaic=lambda: mla_mosaic_section(run, p["mla_mosaic"], p["mla_mosaic_model"]),
        mla_fp8=lambda: kernels_mla.mla_fp8_rows(run, p["mla_fp8"]))
    for name in SECTIONS:
        if name in only:
            steps[name]()
    print("\n" + header("kernel table", anchors=f"copy {run.copy_bw / 1e12:.2f} TB/s, bf16 matmul {run.peak / 1e12:.0f} TFLOP/s",
                        roof="copy BW (TB/s rows) or the larger of copy BW and matmul peak (MLA); MoE: matmul peak "
                             "(prefill) or copy BW of the weights touched (decode)"))
    print(run.table.markdown())
    print(f"# total {time.time() - run.t0:.0f} s")
    if args.csv:
        run.table.write_csv(args.csv)
    if args.json:
        write_json(args.json, dict(copy_bw=run.copy_bw, bf16_peak=run.peak, fla=run.fla is not None, rows=run.table.rows))
    return run.table.rows


if __name__ == "__main__":
    main()
