"""One `pdfleet up` fleet (gateway, one prefill and one decode engine, NIXL
between them) shared by this package's tests, with tracing on: every process
exports its spans over OTLP/HTTP to a receiver the tests run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import httpx
import pytest
from helpers.up import Up, fleet_spec

sys.path.insert(0, str(Path(__file__).parent))

from otlp_receiver import OTLPReceiver
from promql import exposed_names

from pdfleet.engine.contracts.security import fleet_secret_from_env, fleet_token


@pytest.fixture(scope="package")
def receiver():
    r = OTLPReceiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="package")
def fleet(tiny_model, tmp_path_factory, receiver):
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the receiver at once
    }
    with mock.patch.dict(os.environ, env):
        # The tests follow a client's traceparent through the fleet: trusted here
        # (tests/security/test_trace_sampling.py covers the default, untrusted).
        spec = fleet_spec(tiny_model, gateway={"trustClientTraceContext": True})
        up = Up(spec, tmp_path_factory.mktemp("obs-fleet"))
    try:
        yield up.wait_ready()
    finally:
        up.stop()


def scrape_text(url: str) -> str:
    """A real process's /metrics (engines want the fleet token)."""
    secret = fleet_secret_from_env()
    headers = {"authorization": f"Bearer {fleet_token(secret)}"} if secret else {}
    resp = httpx.get(url + "/metrics", headers=headers, timeout=10)
    resp.raise_for_status()
    return resp.text


def operator_names() -> set[str]:
    """The operator's and the autoscaler's metrics, from their definitions in code."""
    from prometheus_client import generate_latest

    from pdfleet.operator.autoscaling.decisions import AutoscalerMetrics
    from pdfleet.operator.handlers import OperatorState

    state = OperatorState()
    AutoscalerMetrics(state.metrics)
    return exposed_names(generate_latest(state.metrics).decode())


@pytest.fixture(scope="package")
def exported(fleet) -> dict[str, set[str]]:
    """Metric names of a real P/D engine pair and gateway, and of the operator."""
    return {
        "engine": exposed_names(scrape_text(fleet.engine_url("prefill")))
        | exposed_names(scrape_text(fleet.engine_url("decode"))),
        "gateway": exposed_names(scrape_text(fleet.url)),
        "operator": operator_names(),
    }
