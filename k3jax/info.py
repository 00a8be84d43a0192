"""`python -m k3jax.info --model NAME [--json]`: parameter counts and memory figures of a model.

Everything is computed from shapes (`jax.eval_shape`); nothing is allocated.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cli_help import add_model_source_args

from k3jax.cache import pool_bytes_per_page, pool_bytes_per_slot
from k3jax.params import param_shapes, parameter_count


def model_info(config, dtype=jnp.bfloat16) -> dict:
    shapes = param_shapes(config, dtype)
    total = routed = weight_bytes = 0
    for path, s in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        names = [str(getattr(p, "key", "")) for p in path]
        weight_bytes += int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
        n = parameter_count(names[-1], s.shape)
        total += n
        routed += n if "experts" in names else 0
    active = total - routed + routed * config.num_experts_per_token // config.num_experts
    return {
        "total_params": total,
        "active_params": active,
        "routed_expert_params": routed,
        "weight_bytes": weight_bytes,
        "layers": config.num_layers,
        "kda_layers": len(config.kda_layers),
        "mla_layers": len(config.mla_layers),
        "mla_cache_bytes_per_token": pool_bytes_per_page(config, 1, dtype),
        "kda_state_bytes_per_sequence": pool_bytes_per_slot(config, dtype),
        "expert_format": config.expert_format,
        "vocab_size": config.vocab_size,
        "max_context": config.max_position_embeddings,
    }


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}P"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


# How each field reads in the text listing (--json keeps plain numbers; its units are in the names:
# *_params counts parameters, *_bytes bytes, max_context tokens).
_UNITS = {"total_params": "params", "active_params": "params", "routed_expert_params": "params",
          "vocab_size": "tokens", "max_context": "tokens"}


def format_value(key: str, v) -> str:
    if key.endswith("bytes") or "_bytes_" in key:
        return _bytes(v)
    if key in _UNITS:
        return f"{_human(v) if v > 10000 else v} {_UNITS[key]}"
    return str(v)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m k3jax.info", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset name checkpoint directory or Hugging Face model id (ORG/NAME) (default: tiny)")
    add_model_source_args(ap)
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    from k3jax.presets import resolve_config
    try:
        cfg = resolve_config(args.model, revision=args.revision, download_dir=args.download_dir)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = model_info(cfg)
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:32s} {format_value(k, v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
