"""One definition of the HTTP request limits for the engine server and the gateway
(engine/contracts/http_limits.py)."""

import argparse

import pytest

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.contracts.http_limits import DEFAULT_LIMITS, RequestLimits
from pdfleet.engine.entrypoints.serve import add_server_args


def test_engine_server_and_gateway_flags_default_to_the_one_definition():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    serve = parser.parse_args([])
    assert serve.max_request_body_bytes == DEFAULT_LIMITS.max_body_bytes
    assert serve.max_chunk_bytes == DEFAULT_LIMITS.max_chunk_bytes
    assert serve.header_timeout == DEFAULT_LIMITS.header_timeout
    assert serve.body_timeout == DEFAULT_LIMITS.body_timeout
    gateway = GatewayConfig(decode=["http://127.0.0.1:1"])
    assert gateway.max_body_bytes == DEFAULT_LIMITS.max_body_bytes
    assert gateway.header_timeout == DEFAULT_LIMITS.header_timeout
    assert gateway.body_timeout == DEFAULT_LIMITS.body_timeout


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_body_bytes", 0, "max_body_bytes must be >= 1"),
        ("max_chunk_bytes", -1, "max_chunk_bytes must be >= 1"),
        ("max_head_bytes", 0, "max_head_bytes must be >= 1"),
        ("header_timeout", 0.0, "header_timeout must be > 0 seconds"),
        ("body_timeout", -2.0, "body_timeout must be > 0 seconds"),
    ],
)
def test_request_limits_refuse_a_bound_that_admits_nothing(field, value, message):
    with pytest.raises(ValueError, match=message):
        RequestLimits(**{field: value})
