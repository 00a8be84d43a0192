"""Write docs/configuration.md from the code: every command-line flag of the entry points (read off their
argparse parsers) and every `EngineArgs` field (its default as written in the source and its comment),
which `LLM(...)` takes as keyword arguments.

    python -m tools.gen_config_doc            # (re)write docs/configuration.md
    python -m tools.gen_config_doc --check    # exit 1 if it is stale (tests/tools/test_config_doc.py)
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
COMMANDS = ("serve", "generate", "batch", "eval", "convert", "info", "plan")


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(command: str) -> argparse.ArgumentParser:
    """The entry point's parser: its build_parser() when it has one, else the parser its main() builds
    (caught at parse_args, before the command does anything)."""
    mod = importlib.import_module(f"k3jax.{command}")
    if hasattr(mod, "build_parser"):
        return mod.build_parser()

    def capture(self, *a, **k):
        raise _Captured(self)
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        mod.main([])
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise RuntimeError(f"k3jax.{command}.main() built no parser")


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS:
        return ""
    home = os.path.expanduser("~")
    if isinstance(d, str) and home not in ("", "/") and d.startswith(home):   # the same doc on every machine
        d = "~" + d[len(home):]
    return f"`{d!r}`"


def _help(action, prog) -> str:
    h = action.help or ""
    if h is argparse.SUPPRESS:
        return ""
    try:
        h = h % {"default": action.default, "prog": prog, "choices": action.choices}
    except (KeyError, TypeError, ValueError):
        pass
    if action.choices is not None:
        h = f"{h} (one of: {', '.join(map(str, action.choices))})".strip()
    return h


def command_section(command: str) -> str:
    p = parser_of(command)
    out = [f"## `python -m k3jax.{command}`", "", _cell(p.description or ""), ""]
    for group in p._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)
                   and a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            out += [f"### {group.title}", ""] + ([_cell(group.description), ""] if group.description else [])
        out += ["| flag | default | meaning |", "|---|---|---|"]
        for a in actions:
            flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
            if a.metavar and a.nargs != 0:
                flags += f" `{a.metavar}`" if isinstance(a.metavar, str) else ""
            out.append(f"| {flags} | {_default(a)} | {_cell(_help(a, p.prog))} |")
        out.append("")
    return "\n".join(out)


def engine_fields() -> list[tuple[str, str, str]]:
    """(name, default as written, comment) of each EngineArgs field, in order."""
    from serving import engine_args
    src = Path(engine_args.__file__).read_text()
    lines = src.splitlines()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    body = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    rows = []
    for i, node in enumerate(body):
        end = body[i + 1].lineno - 1 if i + 1 < len(body) else node.end_lineno
        comment = []
        for j in range(node.lineno - 1, end):
            line = lines[j]
            if j >= node.end_lineno and not line.strip().startswith("#"):
                break
            if "#" in line:
                comment.append(line.split("#", 1)[1].strip())
        default = ast.get_source_segment(src, node.value) if node.value is not None else "(required)"
        rows.append((node.target.id, default, " ".join(comment)))
    return rows


# Meanings of the EngineArgs fields whose source line carries no comment (a comment there wins).
FIELD_MEANINGS = {
    "page_size": "tokens per MLA cache page",
    "prefix_match_unit": "prefix-cache granularity in tokens (divides page_size)",
    "enable_prefix_caching": "reuse cached KDA checkpoints and MLA pages of shared prompt prefixes",
    "num_slots": "KDA state slots (with num_pages: explicit pool sizes instead of the memory budget)",
    "max_waiting": "queue bound; beyond it requests are refused (the server's 429)",
    "max_logprobs": "most log-probabilities a request may ask for per token",
    "seed": "the engine's sampling seed (requests without their own seed)",
    "warmup": "compile every step shape before serving (False: first requests compile)",
    "forbid_compile_after_warmup": "fail a step that would compile after warm-up",
    "compilation_cache_dir": "persistent XLA compilation cache (None: off)",
    "token_buckets": "step token counts compiled (default: from max_num_batched_tokens)",
    "seq_buckets": "step sequence counts compiled (default: from max_num_seqs)",
}


def engine_section() -> str:
    from k3jax.offline import LLM
    sig = inspect.signature(LLM.__init__)
    own = [(n, p.default) for n, p in sig.parameters.items() if n != "self" and p.kind != p.VAR_KEYWORD]
    out = ["## `EngineArgs` and `LLM`", "",
           "`LLM(" + ", ".join(f"{n}={d!r}" for n, d in own) + ", **engine_args)`: the model (a preset, a checkpoint "
           "directory or a loaded `Model`), its dtype and mesh, and every `EngineArgs` field below as a keyword "
           "argument. The server builds the same `EngineArgs` from its flags.", "",
           "| field | default | meaning |", "|---|---|---|"]
    for name, default, comment in engine_fields():
        out.append(f"| `{name}` | `{_cell(default)}` | {_cell(comment or FIELD_MEANINGS.get(name, ''))} |")
    return "\n".join(out) + "\n"


def render() -> str:
    parts = ["# Configuration", "",
             "Every command-line flag of the entry points and every engine field, with its default and meaning. "
             "Generated from the code by `python -m tools.gen_config_doc` (do not edit by hand; "
             "`tests/tools/test_config_doc.py` fails when it is stale).", ""]
    parts += [command_section(c) for c in COMMANDS]
    parts.append(engine_section())
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m tools.gen_config_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
