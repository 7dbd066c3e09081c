"""Tracing is switched by the standard OTEL_* variables, and costs nothing when off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdfleet.engine.tracing import tracing_requested


@pytest.mark.parametrize(
    ("env", "endpoint", "on"),
    [
        ({}, None, False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, None, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, None, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, None, True),
        ({}, "http://c:4318/v1/traces", True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, None, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None, False),
    ],
)
def test_otel_variables_switch_tracing(env, endpoint, on):
    assert tracing_requested(env, endpoint) is on


def test_unknown_traces_exporter_is_a_clear_error():
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='jaeger'.*'otlp'"):
        tracing_requested({"OTEL_TRACES_EXPORTER": "jaeger"})


def test_tracing_off_imports_no_sdk_or_exporter():
    """A gateway app built without OTEL_* loads neither the SDK nor an exporter
    (FastAPI itself imports the OpenTelemetry API when it is installed)."""
    code = (
        "import os, sys\n"
        "for k in list(os.environ):\n"
        "    if k.startswith('OTEL_'): del os.environ[k]\n"
        "from pdfleet.engine.config.gateway import GatewayConfig\n"
        "from pdfleet.engine.gateway.app import build_app\n"
        "from pdfleet.engine.entrypoints.openai import api_server, serving_base\n"
        "from pdfleet.engine import tracing\n"
        "app = build_app(GatewayConfig(decode=['http://127.0.0.1:1']))\n"
        "assert not tracing.enabled()\n"
        "sdk = ('opentelemetry.sdk', 'opentelemetry.exporter')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(sdk))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)
