"""`pdfleet status` against a live local fleet, and its cluster mode against
API-server answers whose proxied /metrics come from a real engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest
from helpers.server import free_port, wait_until

from conftest import scrape_text
from pdfleet.engine.contracts.launch import python_module
from pdfleet.operator.status_cmd import (
    HEADER,
    TENANT_HEADER,
    EngineRow,
    FleetView,
    Sample,
    cluster_views,
    parse_metrics,
    render,
)


def ctrl_c_stops() -> None:
    """In the child before its exec: SIGINT at its default, as a terminal gives
    its foreground job. A test run started in the background without job control
    ignores SIGINT, and an ignored signal stays ignored across exec: Python
    would then install no handler, and Ctrl-C would not reach ``--watch``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


LONG = "[status] The harbor was quiet before dawn. Boats rocked against the pier. " * 6


def status(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_module("pdfleet.engine.cli"), "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def without_fleet_secret() -> dict[str, str]:
    """This environment less the fleet secret the test session shares."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("PDFLEET_FLEET_SECRET", "PDFLEET_FLEET_SECRET_FILE")
    }


def complete(fleet, prompt: str, max_tokens: int = 4) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(fleet.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text


def rows_by_name(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = lines.index(HEADER) + 1
    rows = {}
    for line in lines[start:]:
        if line.startswith(("autoscaler:", "TENANT ")):
            break
        rows[line.split()[0]] = line.split()
    return rows


def test_status_shows_one_line_per_engine_of_the_local_fleet(fleet):
    complete(fleet, LONG)  # one P/D request: a KV pull, prefix-cache lookups
    complete(fleet, LONG)  # the same prompt again: prefix hits on the decode engine
    out = status("--run-dir", str(fleet.run_dir))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("tiny  ") and "gateway http://127.0.0.1:" in lines[0]
    assert lines[0].endswith(" ready")
    rows = rows_by_name(out.stdout)
    assert set(rows) == {"prefill-0", "decode-0"}
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        _, r, state, run_wait, kv, prefix, xfer = rows[name]
        assert (r, state, run_wait) == (role, "ready", "0/0")
        assert kv.endswith("%") and prefix.endswith("%") and float(xfer) >= 0
    # The second request found the first one's blocks in the decode engine's cache.
    assert int(rows["decode-0"][5].rstrip("%")) > 0
    # The gateway's tenants: requests without a key are one anonymous tenant.
    tenants = lines[lines.index(TENANT_HEADER) + 1 :]
    assert tenants[0].split()[:6] == ["anonymous", "0", "1", "0", "0", "0"], tenants
    assert lines[-1] == "autoscaler: none yet"  # the fleet has no spec.autoscaling


def test_status_counts_transfers_per_second_between_two_scrapes(fleet):
    url = fleet.engine_url("decode")
    before = Sample(time.time(), parse_metrics(scrape_text(url)))
    complete(fleet, LONG.replace("[status]", "[xfer-1]"))
    complete(fleet, LONG.replace("[status]", "[xfer-2]"))
    after = Sample(before.at + 2.0, parse_metrics(scrape_text(url)))  # as if 2 s apart
    row = EngineRow("decode-0", "decode", "ready", after, before)
    assert row.transfers_per_second() == pytest.approx(1.0)  # two pulls in two seconds
    assert 0.0 <= row.prefix_hit_rate() <= 1.0


def test_status_watch_refreshes_in_place_until_interrupted(fleet):
    proc = subprocess.Popen(
        [
            *python_module("pdfleet.engine.cli"),
            "status",
            "--run-dir",
            str(fleet.run_dir.parent / fleet.run_dir.name),
            "--watch",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=ctrl_c_stops,
    )
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b""))
    )
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while b"".join(chunks).count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
        reader.join(5)
    frames = b"".join(chunks).decode().split("\x1b[H\x1b[2J")[1:]
    assert len(frames) >= 3
    for frame in frames[:-1]:  # the last may be cut by the interrupt
        assert "decode-0" in frame and "prefill-0" in frame
        # From the second refresh on, XFER/S is a number.
    assert rows_by_name(frames[1])["decode-0"][6] != "-"


def test_status_needs_no_setup_it_reads_the_runs_owner_only_secret(fleet):
    (run,) = fleet.run_dir.glob("*/fleet.json")
    secret_file = run.parent / "fleet-secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert (run.stat().st_mode & 0o777) == 0o600
    out = status("--run-dir", str(fleet.run_dir), env=without_fleet_secret())
    assert out.returncode == 0, out.stderr
    rows = rows_by_name(out.stdout)
    assert rows["prefill-0"][2] == rows["decode-0"][2] == "ready", out.stdout
    assert "denied" not in out.stdout
    assert "HTTP Request" not in out.stderr  # no httpx line per scrape


def _run_dir(tmp_path, supervisor_pid: int, gateway_url: str):
    run = tmp_path / "tiny-20260101-000000"
    run.mkdir()
    start = Path(f"/proc/{supervisor_pid}/stat")
    ticks = int(start.read_text().rsplit(")", 1)[1].split()[19]) if start.exists() else 1
    state = {
        "service": "tiny",
        "supervisor": {"pid": supervisor_pid, "startTicks": ticks},
        "gateway": {"url": gateway_url, "state": "ready"},
        "engines": [
            {"name": "decode-0", "role": "decode", "url": gateway_url, "state": "ready"},
        ],
        "lastDecisions": [],
    }
    (run / "fleet.json").write_text(json.dumps(state))
    return run


def test_a_run_whose_pdfleet_up_is_gone_is_stopped_whatever_its_file_says(tmp_path):
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait(10)
    run = _run_dir(tmp_path, dead.pid, f"http://127.0.0.1:{free_port()}")
    out = status("--run-dir", str(run))
    assert out.returncode == 3, out.stderr  # a stopped run: scripts can tell
    lines = out.stdout.splitlines()
    assert lines[0].endswith(" stopped"), lines
    assert rows_by_name(out.stdout)["decode-0"][2] == "stopped"


def test_a_bare_watch_refreshes_every_interval(tmp_path):
    """`--watch` with no SECONDS (as documented) refreshes every --interval."""
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    run = _run_dir(tmp_path, dead.pid, f"http://127.0.0.1:{free_port()}")
    argv = [*python_module("pdfleet.engine.cli"), "status", "--run-dir", str(run)]
    proc = subprocess.Popen(
        [*argv, "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=ctrl_c_stops,
    )
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b""))
    )
    reader.start()
    try:
        assert wait_until(
            lambda: b"".join(chunks).count(b"(every 0.2s") >= 2 or proc.poll() is not None, 30
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
        reader.join(5)
    assert b"".join(chunks).count(b"(every 0.2s") >= 2


def test_a_live_run_whose_gateway_refuses_connections_shows_it_down(tmp_path):
    run = _run_dir(tmp_path, os.getpid(), f"http://127.0.0.1:{free_port()}")
    out = status("--run-dir", str(run))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].endswith(" down"), out.stdout


def test_status_of_a_missing_run_is_a_clear_error(tmp_path):
    out = status("--run-dir", str(tmp_path))
    assert out.returncode == 2
    assert "no pdfleet up run in" in out.stderr and "--namespace" in out.stderr


def _pod(name: str, role: str, ready: bool = True, **extra) -> dict:
    pod = {
        "metadata": {
            "name": name,
            "labels": {"pdfleet.dev/service": "llama", "pdfleet.dev/role": role},
        },
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }
    for key, value in extra.items():
        pod[key].update(value)
    return pod


def test_cluster_mode_reads_status_and_metrics_through_the_api_server_proxy(fleet):
    text = scrape_text(fleet.engine_url("decode"))
    service = {
        "metadata": {"name": "llama"},
        "status": {
            "phase": "Ready",
            "roles": {"prefill": {"summary": "1/1"}, "decode": {"summary": "2/2"}},
            "autoscaling": {
                "lastDecisions": [
                    {
                        "role": "decode",
                        "from": 1,
                        "to": 2,
                        "reason": "kv usage 0.83 > 0.70",
                        "time": "2026-01-01T12:00:00Z",
                    },
                ]
            },
        },
    }
    long_name = "llama-decode-5f7c9d8b6d-zq2xw-with-a-very-long-suffix"
    pods = [
        _pod("llama-prefill-7d9f8c6b5-x2abc", "prefill"),
        _pod(long_name, "decode"),
        _pod("llama-decode-5f7c9d8b6d-old", "decode", metadata={"deletionTimestamp": "now"}),
        _pod(
            "llama-decode-5f7c9d8b6d-new",
            "decode",
            ready=False,
            status={"containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]},
        ),
    ]
    asked: list[str] = []

    def get(path: str) -> str:
        asked.append(path)
        if path.endswith("/inferenceservices/llama"):
            return json.dumps(service)
        if "/pods?labelSelector=" in path:
            return json.dumps({"items": pods})
        if path.endswith(":8000/proxy/metrics"):
            return text  # a real engine's exposition
        raise AssertionError(path)

    views = cluster_views(get, "ml", "llama", {})
    assert asked[0] == "/apis/pdfleet.dev/v1alpha1/namespaces/ml/inferenceservices/llama"
    path, _, query = asked[1].partition("?")
    assert path == "/api/v1/namespaces/ml/pods"
    assert parse_qs(query) == {
        # Engines only: not the workers of multi-node groups (no API server there).
        "labelSelector": [
            "pdfleet.dev/service=llama,pdfleet.dev/role in (prefill,decode),"
            "pdfleet.dev/group-role!=worker"
        ]
    }
    assert f"/api/v1/namespaces/ml/pods/{long_name}:8000/proxy/metrics" in asked
    (view,) = views
    states = {r.name: r.state for r in view.rows}
    assert states[long_name] == "ready"
    assert states["llama-decode-5f7c9d8b6d-old"] == "draining"
    assert states["llama-decode-5f7c9d8b6d-new"] == "crashing"
    out = render(views)
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0] == "llama  ns/ml Ready  prefill 1/1 decode 2/2"
    assert any(line.startswith("…w-with-a-very-long-suffix decode  ready") for line in lines)
    assert lines[-1] == "autoscaler: decode 1 -> 2 at 2026-01-01T12:00:00Z: kv usage 0.83 > 0.70"


def test_rows_of_an_unreachable_engine_show_down_not_stale_numbers():
    row = EngineRow("decode-1", "decode", "ready", Sample(1.0, error="ConnectError: refused"))
    view = FleetView("tiny", "runs/x", "gateway - ready", [row])
    line = render([view]).splitlines()[2]
    assert line.split() == ["decode-1", "decode", "down", "-/-", "-", "-", "-"]


def test_engines_that_refuse_the_token_say_so_with_what_to_set():
    class Refused(Exception):
        status = 401

    def get() -> str:
        raise Refused("401 Unauthorized")

    from pdfleet.operator.status_cmd import scrape

    row = EngineRow("decode-0", "decode", "ready", scrape(get))
    lines = render([FleetView("tiny", "run", "gateway - ready", [row])]).splitlines()
    assert lines[2].split()[2] == "denied"
    assert lines[-2].startswith("denied: run as the user who ran `pdfleet up`")
    assert "set PDFLEET_FLEET_SECRET" in lines[-1]


def test_another_users_run_says_whose_it_is(tmp_path, monkeypatch):
    from pdfleet.operator.status_cmd import LocalSource

    run = _run_dir(tmp_path, os.getpid(), f"http://127.0.0.1:{free_port()}")
    source = LocalSource(run)
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "fleet.json":
            raise PermissionError(13, "Permission denied")  # as for a user without root
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    try:
        with pytest.raises(ValueError, match="as the user who ran `pdfleet up`"):
            source.views({})
    finally:
        source.close()


def test_the_gateways_peer_pull_crossover_and_decisions_are_one_line():
    from pdfleet.operator.status_cmd import peer_pull_line

    text = (
        "pdfleet_gateway_peer_pull_fleet_crossover_tokens 812.4\n"
        'pdfleet_gateway_peer_pull_decisions_total{decision="pull",reason="cost"} 3\n'
        'pdfleet_gateway_peer_pull_decisions_total{decision="pull",reason="explore"} 1\n'
        'pdfleet_gateway_peer_pull_decisions_total{decision="recompute",reason="cost"} 2\n'
    )
    assert peer_pull_line(text) == "peer pulls: crossover 812 tokens; pull 4, holder 0, recompute 2"
    unmeasured = "pdfleet_gateway_peer_pull_fleet_crossover_tokens -1\n"
    assert peer_pull_line(unmeasured) == (
        "peer pulls: crossover not measured yet; pull 0, holder 0, recompute 0"
    )
    assert peer_pull_line("pdfleet_gateway_queued_requests 0\n") is None
    assert peer_pull_line("pdfleet_gateway_peer_pull_fleet_crossover_tokens 0\n") is None
    view = FleetView("svc", "run", "gateway http://g ready", [], peer_pull=peer_pull_line(text))
    assert render([view]).splitlines()[-1].startswith("peer pulls: crossover 812 tokens")
