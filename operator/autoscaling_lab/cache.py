"""A disk cache of the matrix's policy-independent figures (JSON files).

B* (a search of about fifteen simulations per cell) and the HPA runs do not
depend on the policy, so the matrix computes them once: each entry is keyed
by what it was computed from (the trace, the fleet model, the spec, the
strategy's parameters) and by a fingerprint of the source files that compute
it, so that a change to the simulator or to the search recomputes it and a
change to the policy does not. Entries are plain JSON, written atomically;
an unreadable one is computed again.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ...engine.contracts.model_source import cache_dir

_LAB = Path(__file__).resolve().parent
_RUNTIME = _LAB.parent / "autoscaling"
# What each kind of entry is computed by: the fleet simulator, the victims it
# drains, and the strategies' code. The spec's values enter the key; the
# samples' fields HPA reads (busy fraction, KV usage) are taken as stable.
_SIMULATOR = (
    _LAB / "traces.py",
    _LAB / "sim_fleet.py",
    _LAB / "strategies.py",
    _RUNTIME / "victims.py",
)
SOURCES = {
    "hpa": _SIMULATOR,
    "bstar": (*_SIMULATOR, _LAB / "bstar.py"),
    "ceiling": (*_SIMULATOR, _LAB / "bstar.py", _LAB / "ceiling.py"),
}


def code_of(source: str) -> str:
    """What a source file computes: its syntax tree without the import
    statements (``from ..x import y`` and ``from pdfleet.x import y`` bind
    the same names) and without docstrings, so without comments, prose or
    formatting either: a change to those recomputes nothing."""
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom)]
    bodied = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, bodied):
            kept = [
                n
                for n in node.body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            ]
            node.body = kept or [ast.Pass()]
    return ast.dump(tree)


@cache
def fingerprint(kind: str) -> str:
    digest = hashlib.sha256(kind.encode())
    for path in SOURCES[kind]:
        digest.update(path.name.encode())
        digest.update(code_of(path.read_text()).encode())
    return digest.hexdigest()[:16]


def default_directory() -> Path:
    """``sim/`` in pdfleet's one cache directory (``$PDFLEET_CACHE_DIR``, else the
    XDG cache's ``pdfleet/``)."""
    return cache_dir() / "sim"


class Cache:
    """``directory`` None: nothing is kept (every call computes)."""

    def __init__(self, directory: Path | str | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.hits = self.misses = 0

    def path(self, kind: str, key: Any) -> Path | None:
        if self.directory is None:
            return None
        text = json.dumps(key, sort_keys=True, default=str)
        digest = hashlib.sha256(f"{fingerprint(kind)}:{text}".encode()).hexdigest()[:32]
        return self.directory / kind / f"{digest}.json"

    def get_or_compute(self, kind: str, key: Any, compute: Callable[[], Any]) -> Any:
        path = self.path(kind, key)
        if path is not None and path.exists():
            with contextlib.suppress(OSError, ValueError):
                value = json.loads(path.read_text())
                self.hits += 1
                return value
        self.misses += 1
        value = compute()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        return value
