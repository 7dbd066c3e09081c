"""A client cannot force spans to be exported: its ``traceparent`` (sampled flag
and trace id) continues a trace only when the operator trusts clients' trace
context; by default each request starts a new trace, which the configured
sampler decides on, linked to the client's span. The gateway's own legs (the
fleet token) are always continued, so a P/D request stays one trace."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import httpx
import pytest
from helpers.fleet import ENGINE_ARGS, start_gateway
from helpers.server import ServerProcess, fleet_headers, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "observability"))

from otlp_receiver import OTLPReceiver

# Sample nothing that starts here, follow a parent's decision (OpenTelemetry's names).
RATIO_ZERO = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
CLIENT_KEY = "trace-client-key"
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id  # 01: sampled


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    try:
        yield r
    finally:
        r.close()


def otel_env(receiver: OTLPReceiver, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the receiver at once
        **more,
    }


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory, receiver):
    proc = ServerProcess(
        ["serve", tiny_model, *ENGINE_ARGS, "--api-key", CLIENT_KEY],
        tmp_path_factory.mktemp("trace-engine"),
        "engine",
        env=otel_env(receiver, **RATIO_ZERO),
    )
    try:
        yield proc.wait_healthy(180)
    finally:
        proc.stop()


def gateway(engine: ServerProcess, receiver: OTLPReceiver, log_dir, *flags, **env):
    return start_gateway(
        ["--decode", engine.url, "--disaggregation-mode", "Disabled", *flags],
        log_dir,
        env={**os.environ, **otel_env(receiver, **env)},
    )


def post(url: str, header: str, auth: dict[str, str] | None = None) -> None:
    resp = httpx.post(
        url + "/v1/completions",
        json=BODY,
        headers={"traceparent": header, **(auth or {})},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def test_a_clients_sampled_flag_does_not_override_the_sampler(engine, receiver, tmp_path):
    front = gateway(engine, receiver, tmp_path, **RATIO_ZERO)
    try:
        via_gateway, forced_a, _ = traceparent()
        post(front.url, via_gateway)
        direct, forced_b, _ = traceparent()
        post(engine.url, direct, {"authorization": f"Bearer {CLIENT_KEY}"})
        # The fleet token is the gateway's: its sampled decision is followed (the
        # control that this engine exports at all, after the two above).
        internal, control, _ = traceparent()
        post(engine.url, internal, fleet_headers())
        receiver.wait_for(control, lambda spans: any(s.name == "end" for s in spans))
    finally:
        front.stop()  # a clean exit flushes whatever the gateway had queued
    traces = {s.trace_id for s in receiver.spans}
    assert forced_a not in traces and forced_b not in traces
    # Nor a new trace of theirs: the ratio-0 sampler decided on it.
    assert traces == {control}, sorted(f"{s.service}:{s.name}" for s in receiver.spans)


def test_the_operator_may_trust_clients_trace_context(engine, receiver, tmp_path):
    front = gateway(engine, receiver, tmp_path, "--trust-client-trace-context", **RATIO_ZERO)
    try:
        header, trace_id, client_span = traceparent()
        post(front.url, header)
        spans = receiver.wait_for(
            trace_id,
            lambda s: {"gateway POST /v1/completions", "decode request"} <= {x.name for x in s},
        )
    finally:
        front.stop()
    root = next(s for s in spans if s.name == "gateway POST /v1/completions")
    assert root.parent_id == client_span


def test_an_untrusted_traceparent_is_linked_not_continued(engine, receiver, tmp_path):
    # Sampling everything that starts at the gateway: the new trace is exported.
    front = gateway(engine, receiver, tmp_path, OTEL_TRACES_SAMPLER="parentbased_always_on")
    try:
        header, trace_id, client_span = traceparent()
        post(front.url, header)

        def linked() -> list:
            return [
                s
                for s in receiver.spans
                if s.name == "gateway POST /v1/completions" and (trace_id, client_span) in s.links
            ]

        assert wait_until(lambda: bool(linked()), 30)
    finally:
        front.stop()
    (root,) = linked()
    assert root.trace_id != trace_id and root.parent_id == ""
    # The engine continues the gateway's new trace (its legs carry the fleet token).
    engine_spans = receiver.wait_for(
        root.trace_id, lambda s: any(x.name == "decode request" for x in s)
    )
    assert not any(s.trace_id == trace_id for s in receiver.spans)
    assert any(s.service == "pdfleet-engine" for s in engine_spans)
