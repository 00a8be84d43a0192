"""`python -m k3jax.generate`: complete a prompt with a model (the embedded tiny one by default).

Runs on the serving engine (k3jax.offline.LLM): chunked prefill, continuous batching, sampler.
"""
from __future__ import annotations

import argparse
import sys
import time

from k3jax.cli_help import DefaultsHelpFormatter, add_model_source_args
from serving.engine_args import add_advanced_args, advanced_kwargs, claim_device_memory


def generate_ids(model, prompt_ids, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                 stop_ids=(), mesh=None) -> list[int]:
    """Greedy (temperature 0) or sampled continuation of one prompt. Returns the new token ids."""
    from k3jax.offline import LLM, SamplingParams
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                            stop_token_ids=list(stop_ids))
    prompt = [int(t) for t in model.check_tokens(prompt_ids, ndim=1)]
    llm = LLM(model, max_num_seqs=1, max_num_batched_tokens=128,
              max_model_len=max(256, len(prompt) + max_tokens), warmup=False)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def _generate_with_progress(llm, ids, params):
    """One prompt on the engine, with what a first run spends its time on shown on stderr: compiling
    the model step (tens of seconds; later runs load it from the XLA cache), then the tokens."""
    from tqdm import tqdm
    eng = llm.engine
    eng.add_request(ids, params, request_id="generate")
    print("preparing the model step (compiled on a first run, loaded from the XLA cache after) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bar, last = None, None
    while eng.has_unfinished():
        for out in eng.step():
            if bar is None:
                print(f"first step done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
                bar = tqdm(total=params.max_tokens, desc="generating", unit="tok", file=sys.stderr, leave=False)
            bar.update(len(out.metrics.get("new_token_ids", ())))
            last = out
    if bar is not None:
        bar.close()
    return last.outputs[0]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m k3jax.generate", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset name (tiny, tiny-random, kimi-linear-48b-a3b, kimi-k3) checkpoint directory or Hugging Face model id (ORG/NAME)")
    add_model_source_args(ap)
    ap.add_argument("--prompt", default="Hello", help="prompt text")
    ap.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    ap.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bfloat16)")
    ap.add_argument("--mesh", default=None, help='device mesh, e.g. "data=2,expert=4" (default: one device)')
    add_advanced_args(ap)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    claim_device_memory()     # before multihost.start: JAX reads it when its backend starts
    from k3jax.api import load_model
    from k3jax.offline import LLM, SamplingParams
    from serving import multihost
    from serving.engine_args import EngineArgs
    # Multi-host (K3JAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID): process 0 generates, the others follow.
    args.mesh = multihost.start(mesh=args.mesh)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
        advanced = advanced_kwargs(args)
        model = load_model(args.model, dtype=args.dtype, mesh=args.mesh, revision=args.revision,
                           download_dir=args.download_dir, **EngineArgs(**advanced).load_options())
        if multihost.is_multiprocess() and not multihost.is_leader():
            from serving import follower
            return follower.exit_follower(follower.follow(model))
        tok = model.tokenizer
        if tok is None:
            raise ValueError(f"{args.model} has no tokenizer")
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
        else:
            ids = tok.encode(args.prompt)
        llm = LLM(model, max_num_seqs=1, max_num_batched_tokens=128, max_model_len=max(256, len(ids) + args.max_tokens),
                  warmup=False, kv_cache_dtype=args.kv_cache_dtype, dense_in_place=args.dense_in_place)
        t0 = time.perf_counter()
        out = _generate_with_progress(llm, ids, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        multihost.shutdown_followers()     # no-op unless this is process 0 of a multi-process run
    dt = time.perf_counter() - t0
    print(out.text)
    print(f"[{len(ids)} prompt tokens, {len(out.token_ids)} generated in {dt:.2f}s, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
