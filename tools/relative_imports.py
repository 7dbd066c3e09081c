"""Rewrite absolute ``pdfleet`` imports inside pdfleet's packages as relative ones.

pdfleet's one import style: inside ``engine/``, ``kernels/`` and ``operator/`` (the
packages installed as ``pdfleet.engine``, ``pdfleet.kernels``, ``pdfleet.operator``)
every import of pdfleet is relative (``from ..config import EngineArgs``); ruff's
TID251 rejects an absolute one there but cannot fix it. This script does, so a
merge that brings absolute imports back (or a module move done with absolute
names) is settled by re-running it:

    .venv/bin/python -P tools/relative_imports.py      # rewrite in place
    .venv/bin/ruff check --fix . && .venv/bin/ruff format .   # re-sort the imports

``--check`` lists what it would rewrite and exits 1 if anything. Only
``from pdfleet.X import Y`` statements are rewritten (at any depth of the file:
function-level and ``TYPE_CHECKING`` imports too); a bare ``import pdfleet.X``
has no relative form and is reported for a hand edit.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "operator")
_FROM = re.compile(r"from\s+(pdfleet(?:\.\w+)*)")


def package_of(path: Path) -> list[str]:
    """The dotted package a module at ``path`` (relative to the root) belongs to."""
    parts = ["pdfleet", *path.parts[:-1]]
    return parts


def relative_name(current: list[str], target: str) -> str:
    """``target`` (a dotted absolute name) as seen from package ``current``."""
    wanted = target.split(".")
    common = 0
    while common < min(len(current), len(wanted)) and current[common] == wanted[common]:
        common += 1
    if common == 0:
        raise ValueError(f"{target} is not under pdfleet")
    dots = "." * (len(current) - common + 1)
    return dots + ".".join(wanted[common:])


def rewrite(path: Path, source: str) -> tuple[str, list[str]]:
    """The rewritten source and the bare ``import pdfleet...`` lines left for a hand edit."""
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines(keepends=True)
    current = package_of(path.relative_to(ROOT))
    edits: list[tuple[int, int, str, str]] = []
    bare: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "pdfleet" and not node.module.startswith("pdfleet."):
                continue
            line = lines[node.lineno - 1]
            match = _FROM.match(line, node.col_offset)
            if match is None:
                raise ValueError(f"{path}:{node.lineno}: cannot find the module name")
            edits.append(
                (
                    node.lineno - 1,
                    match.start(1),
                    match.group(1),
                    relative_name(current, node.module),
                )
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pdfleet" or alias.name.startswith("pdfleet."):
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
    # Right to left within a line, bottom to top, so offsets stay valid.
    for index, start, old, new in sorted(edits, reverse=True):
        line = lines[index]
        lines[index] = line[:start] + new + line[start + len(old) :]
    return "".join(lines), bare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list, do not rewrite")
    args = parser.parse_args(argv)
    changed: list[Path] = []
    bare_all: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            new, bare = rewrite(path, source)
            bare_all.extend(bare)
            if new != source:
                changed.append(path)
                if not args.check:
                    path.write_text(new)
    verb = "would rewrite" if args.check else "rewrote"
    for path in changed:
        print(f"{verb} {path.relative_to(ROOT)}")
    for line in bare_all:
        print(f"hand edit (no relative form): {line}", file=sys.stderr)
    return 1 if (args.check and changed) or bare_all else 0


if __name__ == "__main__":
    sys.exit(main())
