"""Speculative decoding: drafters propose tokens, one target step verifies them (KDA position states,
k3jax/layers/kda_positions.py), rejection sampling keeps the output distribution (rejection.py), and
the Speculator adapts draft lengths per sequence (speculator.py)."""
from __future__ import annotations


def make_speculator(args, model, max_model_len: int, load_model=None):
    """The engine's Speculator for EngineArgs.speculative (None when "off"). Raises ValueError for a draft
    model the target cannot verify (another vocabulary)."""
    if args.speculative == "off":
        return None
    backend = getattr(model, "backend", None)
    if (backend is not None and backend.kernels and backend.platform == "gpu" and not backend.interpret
            and not args.speculative_on_gpu):
        raise ValueError(f"speculative={args.speculative!r} is refused on GPU kernels: on the H200 its greedy tokens "
                         f"differ from speculation off (docs/performance.md, \"Speculative decoding\"); run with "
                         f"speculative off, or set speculative_on_gpu (--speculative-on-gpu) to run it anyway")
    from serving.spec.speculator import Speculator, drafter_for
    draft = None
    if args.speculative == "draft":
        from serving.spec.draft import load_draft_model
        if load_model is None:
            raise ValueError("speculative='draft': the engine needs a model loader for the draft model "
                             "(LLM and serve pass k3jax.api.load_model)")
        draft = load_draft_model(args.draft_model, model, load_model)
    drafter = drafter_for(args.speculative, args.num_speculative_tokens, model=model, draft_model=draft, args=args)
    return Speculator(drafter, args.num_speculative_tokens, adaptive=args.speculative_adaptive,
                      max_batch=args.speculative_max_batch)
