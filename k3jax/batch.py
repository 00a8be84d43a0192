"""`python -m k3jax.batch`: run an OpenAI batch file (JSONL requests) through the engine, resumably.

    python -m k3jax.batch --model tiny -i requests.jsonl -o results.jsonl

Each line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body"}; each gets one result line, in input order (serving/openai/batch.py has the format).
Interrupted (crash, Ctrl-C), the same command resumes where the last finished window ended; the
finished output is the same bytes as an uninterrupted run's.
"""
from __future__ import annotations

import argparse
import sys

from k3jax.cli_help import DefaultsHelpFormatter, add_model_source_args, int_at_least
from serving.engine_args import add_advanced_args, advanced_kwargs, claim_device_memory


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m k3jax.batch", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset name checkpoint directory or Hugging Face model id (ORG/NAME)")
    add_model_source_args(ap)
    ap.add_argument("-i", "--input", required=True, help="requests, one JSON object a line")
    ap.add_argument("-o", "--output", required=True, help="results (resumed if OUTPUT.state.json is there)")
    ap.add_argument("--overwrite", action="store_true", help="start again even if the output exists")
    ap.add_argument("--window", type=int_at_least(1), default=64, help="lines run together between two checkpoints")
    ap.add_argument("--served-model-name", default=None, help="the `model` requests may name (default: --model)")
    ap.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bfloat16)")
    ap.add_argument("--max-num-seqs", type=int_at_least(1), default=None,
                    help="sequences per engine step (default: 16 on CPU, 64 on a GPU/TPU)")
    ap.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                    help="tokens per engine step (default: 512 on CPU, 4096 on a GPU/TPU)")
    ap.add_argument("--max-model-len", type=int_at_least(2), default=None, help="context length (default: model's, <= 8192)")
    ap.add_argument("--max-n", type=int_at_least(1), default=128, help="most choices one request may ask for")
    add_advanced_args(ap)
    return ap


def build_runner(args):
    import os
    from k3jax.api import load_model
    from serving.engine_args import EngineArgs, field_default
    from serving.openai.batch import runner_for
    eargs = EngineArgs(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, max_waiting=max(field_default("max_waiting"), args.window * args.max_n),
                       warmup=False, **advanced_kwargs(args))
    model = load_model(args.model, dtype=args.dtype, revision=args.revision, download_dir=args.download_dir,
                       **eargs.load_options())
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                      else args.model)
    return runner_for(model, name, eargs, args.max_n)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    claim_device_memory()
    from serving.openai.batch import BatchJob
    try:
        job = BatchJob(args.input, args.output, window=args.window, overwrite=args.overwrite)
        if job.complete:
            print(f"{args.output} is complete ({job.done} lines); --overwrite runs it again", file=sys.stderr)
            return 0
        runner = build_runner(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm
    total = len(job.lines)
    with tqdm(total=total, initial=job.done, desc="requests", unit="req", file=sys.stderr) as bar:
        try:
            job.run(runner, progress=bar.update)
        except KeyboardInterrupt:
            bar.close()
            print(f"\ninterrupted: {job.done} of {total} lines written to {args.output}; "
                  "the same command resumes", file=sys.stderr)
            return 130
    print(f"wrote {total} results to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
