"""Real engines for the gateway tests.

One "prefill" and one "decode" ``pdfleet serve`` process, shared by every
module of this package, joined by the real NIXL connector (host memory):
a P/D request through the gateway moves KV blocks, which the tests read in
the engines' transfer metrics.
"""

from __future__ import annotations

import pytest
from helpers.fleet import kv_transfer_args, start_engines


@pytest.fixture(scope="package")
def engines(tiny_model, tmp_path_factory):
    """(prefill, decode) engine processes."""
    log_dir = tmp_path_factory.mktemp("engines")
    prefill, decode = start_engines(
        tiny_model,
        log_dir,
        ["prefill", "decode"],
        per_engine=[
            kv_transfer_args("NixlConnector", "kv_producer"),
            kv_transfer_args("NixlConnector", "kv_consumer"),
        ],
    )
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()
