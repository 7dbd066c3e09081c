"""Only engine/contracts touches msgpack. import-linter sees module imports
only: ``from ..contracts.kv_side_channel import _msgpack`` is an import of a
contracts module, which every contract allows. This scan closes that gap: no
module outside the contracts names msgpack at all (code, not prose)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "operator")


def msgpack_names(source: str) -> list[str]:
    """Every identifier or imported module of ``source`` that mentions msgpack."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str | None] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module]
        found += [n for n in names if n and "msgpack" in n.lower()]
    return found


def test_the_scan_sees_a_msgpack_reached_through_a_contracts_module():
    assert msgpack_names("from ..contracts.kv_side_channel import _msgpack") == ["_msgpack"]
    assert msgpack_names("from .. import contracts\ncontracts.tp_wire._msgpack.packb(1)")
    assert not msgpack_names('"""msgpack, never pickle"""\n# msgpack\nx = "msgpack"')


def test_no_module_outside_the_contracts_names_msgpack():
    offenders = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("engine", "contracts"):
                continue
            names = msgpack_names(path.read_text())
            if names:
                offenders[str(rel)] = names
    assert offenders == {}
