"""One prefill/decode pair per connector (NIXL and ZMQ), shared by every security
test of the session (tests/helpers/security_pair.py says what the engines get)."""

from __future__ import annotations

import pytest
from helpers.security_pair import start_pair


@pytest.fixture(scope="session", params=["NixlConnector", "ZmqConnector"])
def pair(request, tiny_model, tmp_path_factory):
    started = start_pair(
        request.param, tiny_model, tmp_path_factory.mktemp(f"security-{request.param}")
    )
    try:
        yield started
    finally:
        started.stop()
