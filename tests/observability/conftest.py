"""One `pdfleet up` fleet (gateway, one prefill and one decode engine, NIXL
between them) shared by this package's tests, with tracing on: every process
exports its spans over OTLP/HTTP to a receiver the tests run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import pytest
from helpers.up import Up, fleet_spec

sys.path.insert(0, str(Path(__file__).parent))

from otlp_receiver import OTLPReceiver


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
        up = Up(fleet_spec(tiny_model), tmp_path_factory.mktemp("obs-fleet"))
    try:
        yield up.wait_ready()
    finally:
        up.stop()
