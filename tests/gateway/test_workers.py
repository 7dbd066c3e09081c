"""``--workers N``: N gateway processes on one port, one view of their metrics.

A real gateway with two workers in front of a recording fake engine: requests
on fresh connections are spread over both workers by the kernel (SO_REUSEPORT),
``/metrics`` counts every worker's requests whichever worker answers, a killed
worker is replaced while the others keep serving, and SIGTERM stops them all.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
from gateway.fake_engine import FakeEngine, kv_pull_fails
from helpers.fleet import engines_view, metric, start_gateway
from helpers.server import wait_until
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdfleet.engine.contracts.gateway_events import EngineStalled
from pdfleet.engine.gateway.siblings import Siblings, merge_expositions

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
    # Until the victim has exited, the kernel may still queue new connections on
    # its listening socket, and they die with it: wait for its death (its
    # sockets are closed before it turns zombie), then the survivor must serve.
    assert wait_until(lambda: victim not in children(gateway.proc.pid), timeout=10)
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


def test_sibling_events_reach_every_other_worker_over_their_sockets(tmp_path):
    async def main() -> list[list[EngineStalled]]:
        got: list[list[EngineStalled]] = [[], [], []]
        workers = [Siblings(str(tmp_path), i, 3) for i in range(3)]
        # They start together, as the supervisor's workers do; each serves
        # once it has a link to every other.
        async with asyncio.timeout(10):
            await asyncio.gather(
                *(w.serve(lambda: b"", got[i].append) for i, w in enumerate(workers))
            )
        try:
            async with asyncio.timeout(10):
                assert all(len(w._peers) == 2 for w in workers)
                # A hostile line first: refused and logged, the stream reads on.
                workers[0]._peers[1].write(b'{"kind": "stall", "url": 7}\n')
                workers[0].publish(EngineStalled("http://e", 1.0))
                while not (got[1] and got[2]):
                    await asyncio.sleep(0.02)
        finally:
            for w in workers:
                await w.close()
        return got

    got = asyncio.run(main())
    event = EngineStalled("http://e", 1.0)
    assert got == [[], [event], [event]]


def test_a_kv_pair_opened_by_one_worker_is_open_in_every_worker(tmp_path):
    prefill, decode = FakeEngine(), FakeEngine()

    decode.answer = kv_pull_fails
    args = ["--prefill", prefill.url, "--decode", decode.url, "--disaggregation-mode", "Always"]
    args += ["--scrape-interval", "0.2", "--kv-pair-failures", "2", "--kv-pair-cooldown", "120"]
    gw = start_gateway([*args, "--workers", str(WORKERS)], tmp_path)
    body = {"model": "tiny", "prompt": "word " * 400, "max_tokens": 2}
    try:
        assert wait_until(lambda: len(children(gw.proc.pid)) == WORKERS, timeout=30)
        assert wait_until(lambda: all_views(gw.url, lambda v: v["routable"]["prefill"] == 1), 30)
        # Both failures on one kept-alive connection: one worker sees them all.
        with httpx.Client(timeout=30) as client:
            for _ in range(2):
                assert client.post(gw.url + "/v1/completions", json=body).status_code == 502
        labels = {"prefill": prefill.url, "decode": decode.url}
        # The other worker has it from the first's event stream (within milliseconds).
        assert wait_until(lambda: all_views(gw.url, lambda v: v["kv_pairs_open"] == [labels]), 5)
        assert metric(gw.url, "pdfleet_gateway_kv_pair_open", **labels) == 1
        # Every worker now routes the pair's requests decode-only.
        legs = len(prefill.posts())
        for _ in range(6):
            assert post(gw.url).status_code == 200
        assert len(prefill.posts()) == legs
    finally:
        gw.stop()
        prefill.close()
        decode.close()


def all_views(url: str, ok) -> dict[str, dict] | None:
    """/engines of every worker (fresh connections until each has answered),
    or None when one of them fails ``ok``."""
    views: dict[str, dict] = {}
    for _ in range(60):
        view = engines_view(url)
        if not ok(view):
            return None
        views[view["worker"]] = view
        if len(views) == WORKERS:
            return views
    raise AssertionError(f"60 connections reached only workers {sorted(views)}")
