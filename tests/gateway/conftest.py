"""Real engines for the gateway tests.

One "prefill" and one "decode" ``pdfleet serve`` process, shared by every
module of this package. There is no KV connector yet: the prefill engine
answers its leg but returns no kv_transfer_params, so the decode engine
recomputes the prompt (and the gateway counts the fallback).
"""

from __future__ import annotations

import pytest
from helpers.fleet import start_engines


@pytest.fixture(scope="package")
def engines(tiny_model, tmp_path_factory):
    """(prefill, decode) engine processes."""
    procs = start_engines(tiny_model, tmp_path_factory.mktemp("engines"), ["prefill", "decode"])
    try:
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()
