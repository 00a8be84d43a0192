"""Convert a Hugging Face Kimi K3 / Kimi Linear checkpoint into a k3jax (orbax) checkpoint.

    python -m k3jax.convert --src HF_DIR --dst OUT_DIR [--dtype bfloat16] [--dequantize] [--overwrite]

OUT_DIR gets config.json, the tokenizer files and k3jax_params/ (see checkpoint/orbax_io.py);
`k3jax.load_model(OUT_DIR)` loads it. Every name, shape and dtype is checked from the
safetensors headers before anything is written; then tensors stream one parameter at a time.
Output goes to a temporary directory next to OUT_DIR, renamed only on success. Any input
problem exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time

from k3jax.checkpoint import hub
from k3jax.cli_help import add_model_source_args

log = logging.getLogger("k3jax.convert")

DTYPES = ("bfloat16", "float16", "float32")
# Tokenizer and generation files copied verbatim when present (plus any *.jinja template).
AUX_FILES = ("tiktoken.model", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
             "chat_template.json", "chat_template.jinja", "generation_config.json", "preprocessor_config.json")


def _load_raw_config(src: str) -> dict:
    from k3jax.checkpoint.convert_stream import ConversionError
    f = os.path.join(src, "config.json")
    if not os.path.exists(f):
        raise ConversionError(f"{src}: no config.json")
    try:
        with open(f) as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConversionError(f"{f}: expected a JSON object")
    return raw


def output_config(raw: dict, dequantize: bool) -> dict:
    """The config.json written: K3's top-level quantization_config is moved into text_config
    (where the parser reads it); with `dequantize` it is dropped so the param spec has bf16 experts."""
    raw = json.loads(json.dumps(raw))
    text = raw.get("text_config")
    if isinstance(text, dict) and "quantization_config" in raw and "quantization_config" not in text:
        text["quantization_config"] = raw.pop("quantization_config")
    if dequantize:
        raw.pop("quantization_config", None)
        if isinstance(text, dict):
            text.pop("quantization_config", None)
    return raw


def _check_paths(src: str, dst: str, overwrite: bool):
    from k3jax.checkpoint.convert_stream import ConversionError
    if not os.path.isdir(src):
        raise ConversionError(f"--src {src}: not a directory")
    if os.path.exists(dst) and not overwrite:
        raise ConversionError(f"--dst {dst} already exists (pass --overwrite to replace it)")
    s, d = os.path.realpath(src), os.path.realpath(dst)
    if s == d or s.startswith(d + os.sep) or d.startswith(s + os.sep):
        raise ConversionError(f"--dst {dst} must be outside --src {src} (and not contain it)")


def _copy_aux(src: str, dst: str) -> list[str]:
    names = [n for n in AUX_FILES if os.path.isfile(os.path.join(src, n))]
    names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(src, "*.jinja")) if os.path.basename(p) not in names)
    for n in names:
        shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
    return names


def _replace_dir(tmp: str, dst: str):
    """Move the finished tmp dir to dst; an existing dst is replaced only after tmp is complete."""
    if not os.path.exists(dst):
        os.rename(tmp, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
    os.rmdir(old)
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def convert(src: str, dst: str, *, dtype: str = "bfloat16", dequantize: bool = False, overwrite: bool = False,
            allow_unexpected: bool = False, progress: bool = True, group_bytes: int | None = None) -> dict:
    """Convert HF checkpoint dir `src` into k3jax checkpoint dir `dst`. Returns a summary dict.

    Raises ConversionError (a ValueError) for input problems; `dst` is then left untouched.
    """
    from k3jax.checkpoint import orbax_io
    from k3jax.checkpoint.convert_stream import ConversionError, iter_leaves, plan_conversion
    from k3jax.checkpoint.safetensors_stream import StreamingSafetensorsDir
    from k3jax.config import ModelConfig

    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    _check_paths(src, dst, overwrite)
    raw = output_config(_load_raw_config(src), dequantize=False)
    cfg = ModelConfig.from_dict(raw)            # ValueError: unsupported quantization, bad fields
    if dequantize and cfg.expert_format != "mxfp4":
        log.warning("--dequantize: the experts are not quantized; nothing to dequantize")
    ckpt = StreamingSafetensorsDir(src)         # ValueError: bad index JSON, no shards
    import ml_dtypes  # noqa: F401 - registers "bfloat16" with numpy
    import numpy as np
    out_cfg, plans = plan_conversion(ckpt, cfg, np.dtype(dtype), dequantize=dequantize,
                                     allow_unexpected=allow_unexpected)
    total = sum(p.nbytes for p in plans)
    largest = max(plans, key=lambda p: p.nbytes)
    log.info("%s: %d parameters, %.2f GiB to write (largest %s %.2f GiB)", src, len(plans), total / 2**30,
             largest.key, largest.nbytes / 2**30)

    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=os.path.dirname(dst))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(output_config(raw, dequantize and cfg.expert_format == "mxfp4"), f, indent=2)
        aux = _copy_aux(src, tmp)
        meta = {"source": src, "dtype": dtype, "expert_format": out_cfg.expert_format,
                "dequantized": out_cfg.expert_format != cfg.expert_format}
        if group_bytes is None:   # groups no bigger than the largest leaf: memory stays ~ that leaf
            group_bytes = min(orbax_io.GROUP_BYTES, max(largest.nbytes, 16 << 20))
        index = orbax_io.save_params_streaming(os.path.join(tmp, orbax_io.PARAMS_DIR), iter_leaves(ckpt, plans),
                                               total_bytes=total, progress=progress, meta=meta,
                                               group_bytes=group_bytes, sizes=[p.nbytes for p in plans])
        from k3jax.checkpoint.vision_ckpt import convert_vision
        vision_bytes = convert_vision(ckpt, cfg, raw, tmp, np.dtype(dtype))
        if vision_bytes:
            log.info("vision tower: %.1f MiB", vision_bytes / 2**20)
        _replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"dst": dst, "params": len(plans), "bytes": total, "items": len(index["items"]),
               "largest_param": largest.key, "largest_bytes": largest.nbytes, "aux_files": aux,
               "vision_bytes": vision_bytes,
               "seconds": time.time() - t0,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    log.info("wrote %s: %.2f GiB in %d orbax items, %.1f s, peak RSS %.2f GiB", dst, total / 2**30,
             summary["items"], summary["seconds"], summary["peak_rss_bytes"] / 2**30)
    return summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3jax.convert", description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True, help="Hugging Face checkpoint directory (config.json + safetensors) "
                                                "or model id (ORG/NAME)")
    add_model_source_args(p)
    p.add_argument("--dst", required=True, help="output directory (written via a temporary sibling)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of float weights (default bfloat16)")
    p.add_argument("--dequantize", action="store_true", help="write MXFP4 experts as --dtype floats")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --dst")
    p.add_argument("--allow-unexpected", action="store_true", help="ignore tensors the model does not use")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--summary-json", help="also write the summary (sizes, seconds, peak RSS) to this file")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:   # our INFO lines; orbax/absl stay at WARNING
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
        logging.getLogger("k3jax").setLevel(logging.INFO)
    import jax
    try:   # conversion is host-only: never grab accelerator memory
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - backends already initialised (in-process callers)
        pass
    try:
        if hub.looks_like_repo_id(args.src):
            args.src = hub.resolve(args.src, revision=args.revision, download_dir=args.download_dir)
        summary = convert(args.src, args.dst, dtype=args.dtype, dequantize=args.dequantize, overwrite=args.overwrite,
                          allow_unexpected=args.allow_unexpected, progress=not args.no_progress)
    except (ValueError, OSError) as e:
        msg = " ".join(str(e).split("\n"))
        print(f"k3jax.convert: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3jax.convert: interrupted; nothing written", file=sys.stderr)
        return 130
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
