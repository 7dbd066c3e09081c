"""One prefill/decode pair per connector (NIXL and ZMQ), shared by every security
test of the session (tests/helpers/security_pair.py says what the engines get)."""

from __future__ import annotations

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
        for started in pairs.values():
            started.stop()


@pytest.fixture(scope="session", params=CONNECTORS)
def pair(request, _pairs):
    started = _pairs[request.param].wait_healthy()
    try:
        yield started
    finally:
        started.stop()
