"""The gateway's retry and fallback path in one trace: every prefill attempt is
its own failed leg span, the decode leg follows, and each engine receives the
traceparent of its own leg. The engines are small fakes that speak the
protocol (a refusing prefill engine is hard to get deterministically from real
ones); a real gateway process exports to the test's OTLP receiver."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from helpers.server import fleet_headers, free_port, wait_until

from pdfleet.engine.contracts.launch import python_module

METRICS = (
    "# TYPE pdfleet_engine_num_requests_running gauge\n"
    'pdfleet_engine_num_requests_running{model_name="tiny"} 0.0\n'
    "# TYPE pdfleet_engine_num_requests_waiting gauge\n"
    'pdfleet_engine_num_requests_waiting{model_name="tiny"} 0.0\n'
    "# TYPE pdfleet_engine_kv_cache_usage_ratio gauge\n"
    'pdfleet_engine_kv_cache_usage_ratio{model_name="tiny"} 0.0\n'
    "# TYPE pdfleet_engine_cache_config_info gauge\n"
    'pdfleet_engine_cache_config_info{block_size="16",compat_hash="c0ffee"} 1.0\n'
)
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


class FakeEngine:
    """/health, /metrics and /v1/completions: 503 (a failing prefill engine) or a completion."""

    def __init__(self, status: int) -> None:
        self.traceparents: list[str] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, METRICS.encode(), "text/plain")
                else:
                    self._send(200, b'{"status": "ok"}', "application/json")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                engine.traceparents.append(self.headers.get("traceparent", ""))
                if status == 200:
                    self._send(200, json.dumps(COMPLETION).encode(), "application/json")
                else:
                    error = {"error": {"message": "busy", "type": "Error", "code": status}}
                    self._send(status, json.dumps(error).encode(), "application/json")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway(receiver, tmp_path):
    prefills = [FakeEngine(503), FakeEngine(503)]
    decode = FakeEngine(200)
    port = free_port()
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 (closed below)
    argv = [*python_module("pdfleet.engine.cli"), "gateway", "--port", str(port)]
    argv += ["--prefill", prefills[0].url, prefills[1].url, "--decode", decode.url]
    argv += ["--disaggregation-mode", "Always", "--retries", "1", "--trust-client-trace-context"]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def routable() -> bool:
        try:
            # The engine view is keyed (the fleet token opens it, as for an operator).
            view = httpx.get(url + "/engines", headers=fleet_headers(), timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return False
        return view.get("routable") == {"prefill": 2, "decode": 1}

    try:
        assert wait_until(routable, 60, 0.2), (tmp_path / "gateway.log").read_text()
        yield url, prefills, decode
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        for e in (*prefills, decode):
            e.close()


def test_retried_prefill_legs_and_the_fallback_are_one_trace(gateway, receiver):
    url, prefills, decode = gateway
    trace_id, client_span = "ab" * 16, "cd" * 8
    resp = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": 1},
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    # The root ends last in the gateway's process: its legs were exported with or before it.
    spans = receiver.wait_for(trace_id, lambda s: any(x.name.startswith("gateway POST") for x in s))
    (root,) = [s for s in spans if s.name == "gateway POST /v1/completions"]
    assert root.parent_id == client_span
    assert root.attributes["pdfleet.route_decision"] == "prefill_decode"
    assert root.attributes["pdfleet.fallback"] == "prefill_failed"
    legs = sorted((s for s in spans if s.name == "prefill leg"), key=lambda s: s.start_ns)
    assert len(legs) == 2, "the first attempt and its retry on the other engine"
    assert {leg.attributes["pdfleet.engine"] for leg in legs} == {p.url for p in prefills}
    for leg in legs:
        assert leg.parent_id == root.span_id and leg.error
        assert leg.attributes["http.response.status_code"] == 503
    assert legs[0].end_ns <= legs[1].start_ns
    (decode_leg,) = [s for s in spans if s.name == "decode leg"]
    assert decode_leg.parent_id == root.span_id and not decode_leg.error
    assert decode_leg.start_ns >= legs[1].end_ns
    # Each engine was called with its own leg's context.
    sent = {leg.attributes["pdfleet.engine"]: leg.span_id for leg in legs}
    for p in prefills:
        assert p.traceparents == [f"00-{trace_id}-{sent[p.url]}-01"]
    assert decode.traceparents == [f"00-{trace_id}-{decode_leg.span_id}-01"]
