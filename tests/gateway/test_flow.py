"""Flow control through a real gateway process: tenants, priority bands,
fair share by tokens, limits answered with 429 and Retry-After, a bounded
queue, per-tenant caps, and what the engines receive (a trusted priority, a
tenant's cache salt, a client's priority refused).

The engine is a recording fake (``fake_engine.py``) that reports one waiting
request at every scrape, so the gateway learns a capacity of one slot: while
one request holds it, every other request waits in the gateway's queue, and
the order in which the engine then receives them is the queue's order.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import threading

import httpx
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import auth_headers, engines_view, metric, start_gateway
from helpers.server import wait_until

from pdfleet.engine.contracts.security import caller_id

GOLD = "gold-key"  # a tenant of band 0 (the default band is 1)
KEY_A, KEY_B = "key-a", "key-b"  # no tenant entry: each its own tenant
CAPPED = "capped-key"  # one request in flight, a slow rate, small caps
QUEUE1 = "queue1-key"  # one queued request at most
PRIVATE = "private-key"  # shares no prefix cache; may set its own priority

TENANTS = {
    "default": {"priority": 1},
    "tenants": [
        {"name": "gold", "keys": [GOLD], "priority": 0, "weight": 2},
        {
            "name": "capped",
            "keys": [CAPPED],
            "max_inflight_requests": 1,
            "requests_per_second": 0.01,
            "max_n": 2,
            "max_request_output_tokens": 100,
        },
        {"name": "queue1", "keys": [QUEUE1], "max_queued": 1},
        {"name": "private", "keys": [PRIVATE], "share_cache": False, "client_priority": "allow"},
    ],
}


class HeldEngine(FakeEngine):
    """Answers every request at once, except while ``hold`` is cleared: then the
    next request waits for it (so it keeps the gateway's one slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 1  # the gateway learns a capacity of 1
        self.hold = threading.Event()
        self.hold.set()
        self.arrived: list[str] = []

        def answer(body):
            self.arrived.append(body["prompt"])
            self.hold.wait(30)
            out = {"id": "c", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
            return 200, json.dumps(out).encode()

        self.answer = answer


@pytest.fixture(scope="module")
def engine():
    e = HeldEngine()
    yield e
    e.hold.set()
    e.close()


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("flow")
    (d / "tenants.json").write_text(json.dumps(TENANTS))
    args = [
        "--decode", engine.url,
        "--disaggregation-mode", "Disabled",
        "--api-key", f"{KEY_A},{KEY_B}",
        "--tenants-file", str(d / "tenants.json"),
        "--engine-priority",
        "--scrape-interval", "0.1",
        "--queue-timeout", "3",
    ]  # fmt: skip
    gw = start_gateway(args, d)
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def _fresh(engine, gateway):
    engine.hold.set()
    engine.seen.clear()
    engine.arrived.clear()
    # The capacity of one slot is learned from the first scrapes.
    assert wait_until(lambda: engines_view(gateway.url)["engines"][0]["capacity"] == 1, 15)


def post(gw, key: str, prompt: str = "hi", **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 16, **fields}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=auth_headers(key), timeout=30)


def queued(gw) -> int:
    return engines_view(gw.url)["queued"]


def blocked(gw, engine, pool):
    """A request holding the one slot; returns its future."""
    engine.hold.clear()
    held = pool.submit(post, gw, KEY_A, "blocker")
    assert wait_until(lambda: "blocker" in engine.arrived, 10)
    return held


def test_bands_first_then_fair_share_by_tokens_between_keys(gateway, engine):
    """The gold tenant's band goes first; within the default band key A's n=4
    requests cost four times key B's n=1, so B gets four requests to A's one."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        held = blocked(gateway, engine, pool)
        futures = [
            pool.submit(post, gateway, KEY_A, f"a{i}", n=4, max_tokens=1000) for i in range(3)
        ]
        futures += [pool.submit(post, gateway, KEY_B, f"b{i}", max_tokens=1000) for i in range(6)]
        assert wait_until(lambda: queued(gateway) == 9, 10)
        # The best band may overflow the engine's capacity (the engine preempts a
        # worse band for it): it goes straight to the engine, past the queue.
        futures.append(pool.submit(post, gateway, GOLD, "gold", max_tokens=1000))
        assert wait_until(lambda: "gold" in engine.arrived, 10)
        assert queued(gateway) == 9
        view = {t["tenant"]: t for t in engines_view(gateway.url)["tenants"]}
        assert view["gold"]["priority"] == 0 and view["gold"]["weight"] == 2
        engine.hold.set()
        assert held.result().status_code == 200
        assert all(f.result().status_code == 200 for f in futures)
    order = [p[0] for p in engine.arrived[1:]]
    assert order[0] == "g", order
    assert order[1:6].count("b") == 4, order  # A pays 4× per request
    assert sorted(order) == sorted("gaaabbbbbb")
    # The engines get a trusted priority: the band in the high bits, the
    # fair-share tag (tokens over weight) in the low ones.
    sent = {s.body["prompt"]: s.body["priority"] for s in engine.posts()}
    assert sent["gold"] >> 40 == 0 and sent["a0"] >> 40 == 1 and sent["b0"] >> 40 == 1
    tags = sorted(sent[f"a{i}"] for i in range(3))
    assert all(b - a >= 4000 for a, b in itertools.pairwise(tags))  # n=4 × 1000 tokens
    waited = metric(
        gateway.url, "pdfleet_gateway_tenant_queue_seconds_count", tenant=caller_id(KEY_B)
    )
    assert waited >= 1


def test_tenant_limits_are_429s_with_retry_after(gateway, engine):
    first = post(gateway, CAPPED)
    assert first.status_code == 200
    # requests_per_second 0.01: the next one is over the rate.
    second = post(gateway, CAPPED)
    assert second.status_code == 429
    assert "requests_per_second" in second.json()["error"]["message"]
    assert 1 <= int(second.headers["retry-after"]) <= 60
    assert (
        metric(
            gateway.url,
            "pdfleet_gateway_tenant_requests_total",
            tenant="capped",
            outcome="rate_limited",
        )
        >= 1
    )


def test_a_tenants_full_queue_is_refused_at_once(gateway, engine):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = blocked(gateway, engine, pool)
        waiting = pool.submit(post, gateway, QUEUE1, "q0")
        assert wait_until(lambda: queued(gateway) == 1, 10)
        refused = post(gateway, QUEUE1, "q1")
        assert refused.status_code == 429
        assert "max_queued" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        engine.hold.set()
        assert held.result().status_code == 200 and waiting.result().status_code == 200


def test_queue_time_is_bounded_and_counted(gateway, engine):
    """A request that cannot get a slot within --queue-timeout is a 503 with
    Retry-After, counted as its tenant's queue_timeout."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = blocked(gateway, engine, pool)
        late = post(gateway, KEY_B, "late")
        assert late.status_code == 503 and "retry-after" in late.headers
        engine.hold.set()
        assert held.result().status_code == 200
    key_b = engines_view(gateway.url)["tenants"]
    assert any(t["tenant"].startswith("key:") and t["inflight"] == 0 for t in key_b)
    assert (
        metric(gateway.url, "pdfleet_gateway_tenant_requests_total", outcome="queue_timeout") >= 1
    )


def test_a_clients_own_priority_is_refused_unless_its_tenant_allows_it(gateway, engine):
    refused = post(gateway, KEY_A, priority=-5)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority"
    assert not engine.posts()
    allowed = post(gateway, PRIVATE, "mine", priority=-5, cache_salt="s")
    assert allowed.status_code == 200
    body = engine.posts()[-1].body
    assert body["priority"] >> 40 == -5  # its own band, then its tag
    # share_cache: false — the tenant's own salt, the client's appended.
    assert body["cache_salt"].startswith("tenant-") and body["cache_salt"].endswith(":s")


def test_per_tenant_request_caps_are_400s_naming_the_field(gateway, engine):
    for fields, param in (
        ({"n": 3}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "max_tokens": 60}, "max_tokens"),
    ):
        resp = post(gateway, CAPPED, **fields)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    assert not engine.posts()


def test_a_tenants_file_that_does_not_parse_stops_the_gateway(tmp_path):
    (tmp_path / "t.yaml").write_text("tenants:\n  - name: x\n    keys: [k]\n    wieght: 2\n")
    gw = start_gateway(
        ["--decode", "http://127.0.0.1:9", "--tenants-file", str(tmp_path / "t.yaml")],
        tmp_path,
        healthy=False,
    )
    try:
        assert gw.proc.wait(30) != 0
    finally:
        gw.stop()
    assert "wieght" in gw.log_path.read_text()
