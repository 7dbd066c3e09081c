"""Load a script of the repository's ``benchmarks/`` as a module, for tests of
its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(script: str) -> Iterator[ModuleType]:
    """``benchmarks/<script>.py`` as a module while the generator is open (a
    fixture's body: ``yield from benchmark_module("name")``)."""
    name = f"{script}_bench"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
