"""The picture of pdfleet's layers in docs/architecture.md, drawn from the
import-linter contracts in pyproject.toml (the contracts ``make lint`` checks).

    .venv/bin/python -P tools/layers_picture.py           # print it
    .venv/bin/python -P tools/layers_picture.py --write   # redraw it in the doc
    .venv/bin/python -P tools/layers_picture.py --check   # exit 1 if the doc's is stale

The doc holds it between ``<!-- layers:begin -->`` and ``<!-- layers:end -->``;
tests/layout/test_layout.py fails while it is stale, and while an absolute
pdfleet import is left inside the packages (tools/relative_imports.py).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"


def _short(name: str) -> str:
    return name.removeprefix("pdfleet.")


def picture(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """Every layers contract, top layer first: ``│`` then ``▼`` down to the
    bottom; in a layer ``|`` separates siblings that must not import each
    other, ``:`` siblings that may."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    out = ["```text"]
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        containers = contract.get("containers") or []
        where = f"  (in {', '.join(_short(c) for c in containers)})" if containers else ""
        out.append(f"{contract['name']}{where}")
        layers = contract["layers"]
        for index, layer in enumerate(layers):
            mark = "▼" if index == len(layers) - 1 else "│"
            parts = [_short(p.strip()) for p in layer.replace(":", " : ").split()]
            out.append(f"  {mark} {' '.join(parts)}")
        out.append("")
    out[-1] = "```"
    return "\n".join(out) + "\n"


def embedded(doc: str) -> str:
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[start:end].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    drawn = picture()
    if not (args.write or args.check):
        print(drawn, end="")
        return 0
    doc = DOC.read_text()
    if args.check:
        if embedded(doc) != drawn:
            print(f"{DOC.relative_to(ROOT)}: the layers picture is stale; run {__file__} --write")
            return 1
        return 0
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + drawn + doc[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
