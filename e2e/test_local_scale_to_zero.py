"""`pdfleet up` with decode at minReplicas 0: an idle pool goes to zero, the
gateway holds the next requests and its activation signal brings an engine
back; every request succeeds (or gets a clean 503 after the activation
timeout), and nothing hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from helpers.server import wait_until
from helpers.up import Up, fleet_spec

from pdfleet.engine.contracts import metrics as m

ACTIVATION_TIMEOUT = 90.0


def decode_count(up: Up) -> int:
    return sum(1 for e in up.engines() if e["role"] == "decode")


@pytest.fixture(scope="module")
def zero_fleet(tiny_model, tmp_path_factory):
    spec = fleet_spec(
        tiny_model,
        decode={"replicas": 1, "engine": {"maxNumSeqs": 16}},
        disaggregation={"mode": "Disabled"},
        kvTransfer={},
        autoscaling={
            "periodSeconds": 2,
            "metricsStaleSeconds": 10,
            "activationTimeoutSeconds": ACTIVATION_TIMEOUT,
            "decode": {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 4},
            "prefill": {"minReplicas": 1, "maxReplicas": 1},
        },
    )
    up = Up(spec, tmp_path_factory.mktemp("zero"), "zero")
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()[-3000:]


def client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", timeout=150, max_retries=0)


def gateway_routes_decode(up: Up) -> bool:
    """Whether the gateway still lists a healthy decode engine (a draining one
    stays routable until the gateway rereads the engines file)."""
    name = m.GATEWAY_ENGINE_HEALTHY.name
    scrape = m.parse_metrics(httpx.get(up.url + "/metrics", timeout=10).text, only=(name,))
    return any(
        labels.get("role") == "decode" and value == 1
        for labels, value in scrape.samples.get(name, ())
    )


def wait_zero(up: Up) -> None:
    """Until the pool is really at zero: no decode engine in the fleet and none
    left in the gateway's routing."""
    assert wait_until(lambda: decode_count(up) == 0 and not gateway_routes_decode(up), 90, 0.25), (
        up.output()[-3000:]
    )


def test_first_request_after_scale_to_zero_succeeds_after_about_one_cold_start(zero_fleet):
    up = zero_fleet
    wait_zero(up)
    assert "idle for" in up.output()
    # The time an engine takes to come back, watched from outside, next to
    # the request's own latency: the request waits about one cold start.
    ready_after: list[float] = []
    started = time.monotonic()

    async def watch() -> None:
        while decode_count(up) == 0 and time.monotonic() - started < ACTIVATION_TIMEOUT:
            await asyncio.sleep(0.1)
        ready_after.append(time.monotonic() - started)

    async def request() -> float:
        out = await asyncio.to_thread(
            client(up).completions.create, model="tiny", prompt="hello there", max_tokens=4
        )
        assert out.choices[0].text is not None
        return time.monotonic() - started

    async def both() -> float:
        latency, _ = await asyncio.gather(request(), watch())
        return latency

    latency = asyncio.run(both())
    (cold_start,) = ready_after
    # The decision line may be written a moment after the engine is routable.
    assert wait_until(lambda: "activation" in up.output(), 30), up.output()[-3000:]
    assert cold_start < ACTIVATION_TIMEOUT
    # Served right after the engine is routable: not a period or a retry later.
    assert cold_start - 1.0 <= latency <= cold_start + 5.0, (latency, cold_start)


def test_a_hundred_requests_during_activation_all_succeed_or_get_a_clean_503(zero_fleet):
    up = zero_fleet
    wait_zero(up)
    activations_before = up.output().count("activation")
    statuses: list[int] = []
    retry_after: list[str | None] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        resp = await http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 2},
        )
        statuses.append(resp.status_code)
        if resp.status_code == 503:
            retry_after.append(resp.headers.get("retry-after"))
            assert resp.json()["error"]["code"]

    async def burst() -> float:
        started = time.monotonic()
        async with httpx.AsyncClient(
            base_url=up.url,
            timeout=ACTIVATION_TIMEOUT + 30,
            limits=httpx.Limits(max_connections=200),
        ) as http:
            await asyncio.wait_for(
                asyncio.gather(*(one(http, i) for i in range(100))), ACTIVATION_TIMEOUT + 60
            )
        return time.monotonic() - started

    took = asyncio.run(burst())
    assert len(statuses) == 100
    assert set(statuses) <= {200, 503}, statuses
    assert all(r is not None and int(r) > 0 for r in retry_after)
    # 503s only once the activation timeout has passed, never sooner.
    if retry_after:
        assert took >= ACTIVATION_TIMEOUT
    assert statuses.count(200) >= 1
    # An activation brought an engine back (it may already be idle again: the
    # pool scales to zero 4 s after the burst).
    assert wait_until(lambda: up.output().count("activation") > activations_before, 30), (
        up.output()[-3000:]
    )
