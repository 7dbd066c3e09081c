"""``--workers N``: N gateway processes on one port, one view of their metrics.

A real gateway with two workers in front of a recording fake engine: requests
on fresh connections are spread over both workers by the kernel (SO_REUSEPORT),
``/metrics`` counts every worker's requests whichever worker answers, a killed
worker is replaced while the others keep serving, and SIGTERM stops them all.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import metric, start_gateway
from helpers.server import wait_until
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdfleet.engine.gateway.workers import merge_expositions

WORKERS = 2


def children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


@pytest.fixture(scope="module")
def engine():
    e = FakeEngine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    gw = start_gateway(
        ["--decode", engine.url, "--workers", str(WORKERS), "--scrape-interval", "0.2"],
        tmp_path_factory.mktemp("workers"),
    )
    yield gw
    gw.stop()


def post(url: str) -> httpx.Response:
    # A new connection each time: the kernel picks the worker per connection.
    return httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )


def test_every_worker_serves_and_metrics_count_all_of_them(gateway, engine):
    assert wait_until(lambda: len(children(gateway.proc.pid)) == WORKERS, timeout=30)
    before = metric(gateway.url, "pdfleet_gateway_requests_total", status="200")
    engine.seen.clear()
    for _ in range(40):
        assert post(gateway.url).status_code == 200
    assert len(engine.posts()) == 40
    # Whichever worker answers /metrics, it counts the other's requests too.
    for _ in range(5):
        after = metric(gateway.url, "pdfleet_gateway_requests_total", status="200")
        assert after - before == 40


def test_a_killed_worker_is_replaced_while_the_other_serves(gateway):
    old = children(gateway.proc.pid)
    assert len(old) == WORKERS
    victim = min(old)
    os.kill(victim, signal.SIGKILL)
    for _ in range(10):  # the survivor (and soon the replacement) answer meanwhile
        assert post(gateway.url).status_code == 200

    def replaced() -> bool:
        now = children(gateway.proc.pid)
        return len(now) == WORKERS and victim not in now

    assert wait_until(replaced, timeout=60)
    assert wait_until(lambda: post(gateway.url).status_code == 200, timeout=30)


def test_sigterm_stops_every_worker_and_exits_0(engine, tmp_path):
    gw = start_gateway(["--decode", engine.url, "--workers", str(WORKERS)], tmp_path)
    try:
        assert wait_until(lambda: len(children(gw.proc.pid)) == WORKERS, timeout=30)
        workers = children(gw.proc.pid)
    finally:
        code = gw.stop()
    assert code == 0, gw.log()
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_merged_exposition_sums_requests_and_keeps_the_largest_engine_state():
    texts = []
    for inflight, healthy in ((2, 1), (3, 0)):
        r = CollectorRegistry()
        Counter("pdfleet_gateway_requests", "r", ["status"], registry=r).labels("200").inc(5)
        g = Gauge("pdfleet_gateway_engine_inflight_requests", "i", ["engine"], registry=r)
        g.labels("http://e").set(inflight)
        h = Gauge("pdfleet_gateway_engine_healthy", "h", ["engine"], registry=r)
        h.labels("http://e").set(healthy)
        Histogram("pdfleet_gateway_ttft_seconds", "t", registry=r, buckets=(0.1, 1)).observe(0.5)
        ejected = Counter("pdfleet_gateway_engine_ejections", "e", ["engine"], registry=r)
        ejected.labels("http://e").inc()  # both workers saw the engine's one ejection
        texts.append(generate_latest(r))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(merge_expositions(texts).decode())
        for s in fam.samples
    }
    assert samples[("pdfleet_gateway_requests_total", (("status", "200"),))] == 10
    assert samples[("pdfleet_gateway_engine_inflight_requests", (("engine", "http://e"),))] == 5
    assert samples[("pdfleet_gateway_engine_healthy", (("engine", "http://e"),))] == 1
    assert samples[("pdfleet_gateway_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("pdfleet_gateway_ttft_seconds_bucket", (("le", "0.1"),))] == 0
    assert samples[("pdfleet_gateway_ttft_seconds_count", ())] == 2
    assert samples[("pdfleet_gateway_engine_ejections_total", (("engine", "http://e"),))] == 1
    assert not [k for k in samples if k[0].endswith("_created")]
