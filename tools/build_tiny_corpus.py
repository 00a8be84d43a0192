#!/usr/bin/env python3
"""Build the trained tiny model's English corpus into data/tiny_corpus/ (ignored by git).

The text is the documentation that four PyPI source distributions ship (reStructuredText,
lightly cleaned to prose + code): pinned versions, fetched with `pip download`, so the corpus
is the same on every machine that reaches PyPI.

  Django 5.2.8      docs/**.txt        BSD-3-Clause   (Django Software Foundation)
  SQLAlchemy 2.0.44 doc/build/**.rst   MIT            (the SQLAlchemy authors)
  Sphinx 8.2.3      doc/**.rst         BSD-2-Clause   (the Sphinx team)
  SymPy 1.14.0      doc/src/**.{rst,md} BSD-3-Clause  (SymPy Development Team)

Every document goes to train/ or, for 1 in 50 by a stable hash of its path, to heldout/
(held-out perplexity). About 14 MiB in all.

    python -m tools.build_tiny_corpus [--out data/tiny_corpus] [--sdists DIR]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (pip requirement, sdist file name, member pattern, license)
SOURCES = [
    ("django==5.2.8", "django-5.2.8.tar.gz", r"^django-5\.2\.8/docs/.+\.txt$", "BSD-3-Clause"),
    ("sqlalchemy==2.0.44", "sqlalchemy-2.0.44.tar.gz", r"^sqlalchemy-2\.0\.44/doc/build/.+\.rst$", "MIT"),
    ("sphinx==8.2.3", "sphinx-8.2.3.tar.gz", r"^sphinx-8\.2\.3/doc/.+\.rst$", "BSD-2-Clause"),
    ("sympy==1.14.0", "sympy-1.14.0.tar.gz", r"^sympy-1\.14\.0/doc/src/.+\.(rst|md)$", "BSD-3-Clause"),
]
HELDOUT_ONE_IN = 50

_UNDERLINE = re.compile(r"^\s*([=\-~^*#+`'\".:_])\1{3,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\. ")
_OPTION = re.compile(r"^\s+:[\w-]+:( .*)?$")
_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_LITERAL = re.compile(r"``([^`]+)``")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")


def _role_text(m: re.Match) -> str:
    text = m.group(1)
    label = re.match(r"^(.*?)\s*<[^>]*>$", text)
    if label:
        return label.group(1)
    return text.lstrip("~!").rsplit(".", 1)[-1] if text.startswith("~") else text.lstrip("!")


def clean_rst(text: str) -> str:
    """reST markup out, prose and code blocks in: heading underlines, directive and option lines
    dropped; roles, links and ``literals`` reduced to their text; runs of blank lines collapsed."""
    lines = []
    for line in text.splitlines():
        if _UNDERLINE.match(line) or _DIRECTIVE.match(line) or _OPTION.match(line):
            continue
        line = _LINK.sub(r"\1", _ROLE.sub(_role_text, line))
        lines.append(_LITERAL.sub(r"\1", line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELDOUT_ONE_IN == 0


def fetch(requirement: str, dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-q", "-d", str(dest), requirement], check=True)


def build(out: Path, sdists: Path) -> dict:
    counts = {"train": [0, 0], "heldout": [0, 0]}
    for split in counts:
        (out / split).mkdir(parents=True, exist_ok=True)
    for requirement, fname, pattern, _ in SOURCES:
        if not (sdists / fname).exists():
            fetch(requirement, sdists)
        pat = re.compile(pattern)
        with tarfile.open(sdists / fname) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if not (member.isfile() and pat.match(member.name)):
                    continue
                text = clean_rst(tar.extractfile(member).read().decode("utf-8", errors="replace"))
                if len(text) < 200:
                    continue
                split = "heldout" if is_heldout(member.name) else "train"
                name = member.name.replace("/", "__")
                (out / split / name).with_suffix(".txt").write_text(text, encoding="utf-8")
                counts[split][0] += 1
                counts[split][1] += len(text.encode())
    lines = ["# tiny corpus sources", ""] + [f"- {r} ({lic}): {p}" for r, _, p, lic in SOURCES]
    (out / "SOURCES.md").write_text("\n".join(lines) + "\n")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "tiny_corpus")
    ap.add_argument("--sdists", type=Path, default=None, help="folder with the sdists (else a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counts = build(args.out, args.sdists or Path(tmp))
    for split, (n, size) in counts.items():
        print(f"{split}: {n} documents, {size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
