"""Shared test setup.

* Triton kernels run under the interpreter when no GPU is present; the
  variable must be set before any ``@triton.jit`` module is imported.
* Every process a test starts shares one fleet secret ($PDFLEET_FLEET_SECRET).
* The checkout's root is not on ``sys.path`` (engine/contracts/launch.py says why).
* ``tiny_model_factory`` builds (once per session and spec) small random-weight
  Hugging Face model directories for every supported family.
* Tests marked ``cuda`` only make sense on a GPU: they are skipped without one.
  On a GPU every in-process ``LLM`` gets its own KV-cache share, as every
  engine process does (tests/helpers/device.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

# `python -m pytest` puts the checkout's root first on sys.path, where its
# kernels/ folder hides the installed `kernels` package transformers imports
# (engine/contracts/launch.py). The suite needs nothing from there: tests/ is on the
# path through pyproject's `pythonpath`.
_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the operator-only install has no torch
    _HAS_CUDA = False

if not _HAS_CUDA or os.environ.get("PDFLEET_TEST_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One fleet secret for every process a test starts (engines, gateways, `pdfleet
# up`), as the operator mounts one per InferenceService. Tests of missing or
# wrong secrets override it per process. See engine/contracts/security.py.
os.environ.setdefault("PDFLEET_FLEET_SECRET", "pdfleet-tests-fleet-secret-0123456789abcdef")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch="llama", **spec) -> directory``; cached per distinct spec."""
    from pdfleet.engine.tiny.builder import TinyModelSpec, build_tiny_model

    cache: dict[str, str] = {}

    def make(arch: str = "llama", **spec) -> str:
        key = json.dumps({"arch": arch, **spec}, sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_tiny_model(str(directory), TinyModelSpec(arch=arch, **spec))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> str:
    """The default tiny Llama model directory."""
    return tiny_model_factory("llama")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    from helpers.device import on_cuda

    if on_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _llm_memory_share():
    """On a GPU, several ``LLM`` objects of one test process would each claim
    90% of it: size each one's KV cache instead (a no-op on CPU)."""
    from helpers.device import engine_memory_kwargs, on_cuda

    if not on_cuda():
        yield
        return
    from pdfleet.engine.llm import LLM

    original = LLM.__init__

    def sized_init(self, model, **engine_args):
        original(self, model, **engine_args, **engine_memory_kwargs(engine_args))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLM, "__init__", sized_init)
        yield
