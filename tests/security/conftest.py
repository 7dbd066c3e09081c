"""One prefill/decode pair per connector (NIXL and ZMQ), shared by every security
test of the session (tests/helpers/security_pair.py says what the engines get)."""

from __future__ import annotations

import signal

import pytest
from helpers.security_pair import Pair, launch_pair

CONNECTORS = ["NixlConnector", "ZmqConnector"]


@pytest.fixture(scope="session")
def _pairs(tiny_model, tmp_path_factory):
    """Both connectors' pairs, started together on first use: the second
    connector's engines start while the first's do (and then wait idle)."""
    pairs: dict[str, Pair] = {}
    try:
        for connector in CONNECTORS:
            tmp = tmp_path_factory.mktemp(f"security-{connector}")
            pairs[connector] = launch_pair(connector, tiny_model, tmp)
        yield pairs
    finally:
        # A prefill engine stops once its leases are claimed or expired: signal
        # all four, so that those waits overlap, then wait for each.
        engines = [e for started in pairs.values() for e in (started.prefill, started.decode)]
        for engine in engines:
            engine.signal(signal.SIGTERM)
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="session", params=CONNECTORS)
def pair(request, _pairs):
    """One connector's pair, healthy; stopped with the other at the session's end."""
    return _pairs[request.param].wait_healthy()
