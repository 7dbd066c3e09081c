"""``pdfleet up``'s autoscaler scrapes real /metrics endpoints and acts on the fleet."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.local.process import Child
from pdfleet.operator.local.process_autoscaler import LocalAutoscaler
from pdfleet.operator.local.state import STATE_FILE, FleetStateWriter

TOKEN_HEADERS = {"Authorization": "Bearer fleet-token"}


class MetricsServer:
    """An engine's /metrics in Prometheus text, on a real port; like a real engine,
    it answers 401 without the fleet token."""

    def __init__(self, text: str) -> None:
        self.text = text
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                authorized = self.headers.get("Authorization") == TOKEN_HEADERS["Authorization"]
                body = outer.text.encode() if authorized else b"unauthorized"
                self.send_response((200 if authorized else 401) if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def metrics(kv: float, running: float, waiting: float, held: float = 0.0) -> str:
    return (
        f"pdfleet_engine_kv_cache_usage_ratio {kv}\n"
        f"pdfleet_engine_num_requests_running {running}\n"
        f"pdfleet_engine_num_requests_waiting {waiting}\n"
        f"pdfleet_engine_kv_transfer_held_requests {held}\n"
        "pdfleet_engine_waiting_prompt_tokens 0\n"
        "pdfleet_engine_prompt_tokens_total 1000\n"
        "pdfleet_engine_prefill_busy_seconds_total 1\n"
    )


class FakeFleet:
    """The ScalableFleet protocol over never-started children whose URLs are the servers."""

    roles = ("prefill", "decode")

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.added: list[str] = []
        self.drained: list[str] = []

    def engines_of(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def add_engine(self, role: str) -> Child:
        self.added.append(role)
        child = Child(f"{role}-new", role, [], 1, Path("/dev/null"))
        self.children.append(child)
        return child

    def drain(self, child: Child) -> None:
        child.draining = True
        self.drained.append(child.name)

    def gateway_metrics_text(self) -> str | None:
        return None  # no gateway: no activation signal

    # What fleet.json's writer reads of a LocalFleet besides the protocol.
    service = SimpleNamespace(name="demo")
    gateway = None
    gateway_url = "http://127.0.0.1:1"
    run_dir = Path("/nonexistent")

    def all_children(self) -> list[Child]:
        return list(self.children)


@pytest.fixture
def servers():
    made: list[MetricsServer] = []
    yield lambda text: made.append(MetricsServer(text)) or made[-1]
    for s in made:
        s.close()


def child(name: str, role: str, server: MetricsServer) -> Child:
    c = Child(name, role, [], server.port, Path("/dev/null"), headers=dict(TOKEN_HEADERS))
    c.mark_ready()
    return c


def test_a_full_decode_cache_starts_a_decode_engine(servers):
    prefill = servers(metrics(0.0, 0, 0))
    decode = servers(metrics(0.95, 30, 6))
    fleet = FakeFleet([child("prefill-0", "prefill", prefill), child("decode-0", "decode", decode)])
    scaler = LocalAutoscaler(fleet, AutoscalingSpec())
    for i in range(3):
        records = scaler.step(now=1000.0 + 15 * i)
        if fleet.added:
            break
    assert fleet.added and set(fleet.added) == {"decode"}
    assert any(r.role == "decode" and r.to_replicas > r.from_replicas for r in records)


def test_a_fleet_without_prefill_gets_and_logs_decisions_for_decode_only(servers, caplog):
    # Without disaggregation the fleet runs decode only: the loop's "prefill
    # 0 -> 1" (at min replicas, with no prefill engine) is neither carried out
    # nor logged or recorded, every period.
    decode = servers(metrics(0.95, 30, 6))
    fleet = FakeFleet([child("decode-0", "decode", decode)])
    fleet.roles = ("decode",)
    scaler = LocalAutoscaler(fleet, AutoscalingSpec())
    records = []
    with caplog.at_level(logging.INFO, logger="pdfleet.operator.autoscaling.decisions"):
        for i in range(3):
            records += scaler.step(now=1000.0 + 15 * i)
    assert fleet.added and set(fleet.added) == {"decode"}
    assert records and {r.role for r in records} == {"decode"}
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("autoscaler: decode 1 -> ") for line in lines)
    assert not [line for line in lines if "prefill" in line]


def test_scale_down_drains_the_replica_without_kv_leases(servers):
    spec = AutoscalingSpec.from_spec({"prefill": {"scaleDownStabilizationSeconds": 30}})
    busy = servers(metrics(0.0, 0, 0, held=3))  # idle but for KV leases held for decode
    idle = servers(metrics(0.0, 0, 0))
    decode = servers(metrics(0.0, 0, 0))
    fleet = FakeFleet(
        [
            child("prefill-0", "prefill", busy),
            child("prefill-1", "prefill", idle),
            child("decode-0", "decode", decode),
        ]
    )
    scaler = LocalAutoscaler(fleet, spec)
    for i in range(40):
        scaler.step(now=1000.0 + 15 * i)
        if fleet.drained:
            break
    assert fleet.drained == ["prefill-1"]


def test_the_engines_startup_reaches_the_policy(servers):
    # An engine of the fleet, started before the autoscaler's first step,
    # took 150 s to answer /health: the policy's projection horizon starts
    # from that, not from its default.
    prefill = servers(metrics(0.0, 0, 0))
    decode = servers(metrics(0.1, 2, 0))
    engines = [child("prefill-0", "prefill", prefill), child("decode-0", "decode", decode)]
    for c in engines:
        c.started_at, c.ready_at = 500.0, 650.0
    scaler = LocalAutoscaler(FakeFleet(engines), AutoscalingSpec())
    scaler.step(now=1000.0)
    assert scaler.loop.state.startup_seconds == 150.0 - AutoscalingSpec().period_seconds
    # Until an engine is ready, it has no startup to report.
    assert Child("x", "decode", [], 1, Path("/dev/null")).startup_seconds is None


def test_advisory_mode_records_every_decision_and_starts_nothing(servers, tmp_path, caplog):
    prefill = servers(metrics(0.0, 0, 0))
    decode = servers(metrics(0.95, 30, 6))
    fleet = FakeFleet([child("prefill-0", "prefill", prefill), child("decode-0", "decode", decode)])
    scaler = LocalAutoscaler(fleet, AutoscalingSpec.from_spec({"mode": "Advisory"}))
    advised = []
    with caplog.at_level(logging.INFO, logger="pdfleet.operator.autoscaling.decisions"):
        for i in range(3):
            advised += scaler.step(now=1000.0 + 15 * i)
    # The same load that starts a decode engine in mode Active (above): the
    # decision is made, recorded as not applied, and the fleet is untouched.
    assert fleet.added == [] and fleet.drained == []
    assert [c.draining for c in fleet.children] == [False, False]
    assert advised and all(not r.applied for r in advised)
    assert any(r.role == "decode" and r.to_replicas > r.from_replicas for r in advised)
    assert scaler.log.history.latest()[-1].to_dict()["applied"] is False
    # pdfleet up's log and fleet.json (what `pdfleet status` reads) say so.
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("autoscaler (advisory, not applied): ") for line in lines)
    assert not [line for line in lines if line.startswith("autoscaler: ")]
    fleet.run_dir = tmp_path
    FleetStateWriter(cast(Any, fleet)).write(scaler)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    decisions = state["lastDecisions"]
    assert decisions and all(d["applied"] is False for d in decisions)
    assert decisions[-1]["role"] == "decode" and decisions[-1]["to"] > decisions[-1]["from"]
    assert [e["name"] for e in state["engines"]] == ["prefill-0", "decode-0"]
