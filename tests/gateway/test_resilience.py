"""Engines that stall, die mid-stream or die under load, behind a real gateway.

The module owns two prefill and two decode engines, joined by the real ZMQ
connector, and breaks them in file order: stall (SIGSTOP) a decode engine
under load and revive it, stall one past the gateway's timeouts, kill one
decode engine mid-stream (its stream resumes on the other), kill both
prefill engines under load, and finally kill the last decode engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time

import httpx
import openai
import pytest
from helpers.fleet import engines_view, kv_transfer_args, metric, start_engines, start_gateway
from helpers.server import stop_all, wait_until

from pdfleet.engine.testing_hooks import FAULT_STEP_DELAY_ENV

PROMPT = "Ships left the harbor one by one as the fog lifted over the grey water. " * 12


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("resilience")
    kv = [
        kv_transfer_args("ZmqConnector", "kv_producer"),
        kv_transfer_args("ZmqConnector", "kv_producer"),
        kv_transfer_args("ZmqConnector", "kv_consumer"),
        kv_transfer_args("ZmqConnector", "kv_consumer"),
    ]
    # Engines sleep the seconds this file holds before each step (empty: none).
    delay = log_dir / "step-delay"
    delay.write_text("")
    procs = start_engines(
        tiny_model,
        log_dir,
        ["p1", "p2", "d1", "d2"],
        per_engine=kv,
        env={FAULT_STEP_DELAY_ENV: str(delay)},
    )
    p1, p2, d1, d2 = procs
    gateway = None
    try:
        gateway = start_gateway(gateway_args(procs, stall_timeout=1), log_dir)
        # Every engine routable before the tests break them.
        assert wait_until(
            lambda: health(gateway.url)["routable"] == {"prefill": 2, "decode": 2}, 20
        )
        yield {
            "gateway": gateway,
            **{"p1": p1, "p2": p2, "d1": d1, "d2": d2, "all": procs},
            "step_delay": delay,
        }
    finally:
        if gateway is not None:
            gateway.stop()
        for p in procs:
            p.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_all(procs)


def gateway_args(engines: list, stall_timeout: float) -> list[str]:
    """The P/D gateway in front of (p1, p2, d1, d2), its watchdog at ``stall_timeout``."""
    p1, p2, d1, d2 = engines
    return [
        *("--prefill", p1.url, p2.url, "--decode", d1.url, d2.url),
        *("--disaggregation-mode", "Always", "--scrape-interval", "0.2"),
        *("--eject-after", "2", "--readmit-after", "2"),
        *("--first-token-timeout", "60", "--idle-timeout", "20"),
        *("--stall-timeout", str(stall_timeout)),
    ]


def health(url: str) -> dict:
    return engines_view(url)


INFLIGHT = "pdfleet_gateway_engine_inflight_requests"


def state(url: str, engine_url: str) -> dict:
    return next(e for e in engines_view(url)["engines"] if e["url"] == engine_url)


def test_a_stopped_decode_engine_under_load_is_ejected_and_costs_no_request_its_stall(fleet):
    gw, d1, d2 = fleet["gateway"], fleet["d1"], fleet["d2"]
    assert metric(gw.url, "pdfleet_gateway_engine_healthy", engine=d2.url) == 1
    pulled0 = sum(metric(d.url, "pdfleet_engine_kv_transfer_blocks_pulled_total") for d in (d1, d2))
    d2.signal(signal.SIGSTOP)
    try:
        # Load at once, before any health check can notice: the requests that
        # land on the stopped engine are resent when the watchdog ejects it.
        latencies = asyncio.run(_timed_load(gw.url, 12))
        # Every request completed while the engine is still stopped, each well
        # within the 10 s stop of the fault benchmark.
        assert max(latencies) < 8, latencies
        assert state(gw.url, d2.url)["state"] == "ejected"
        assert metric(gw.url, "pdfleet_gateway_engine_healthy", engine=d2.url) == 0
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total", engine=d2.url) == 1
    finally:
        d2.signal(signal.SIGCONT)
    assert wait_until(lambda: state(gw.url, d2.url)["state"] == "healthy", 15)
    assert metric(gw.url, "pdfleet_gateway_engine_healthy", engine=d2.url) == 1
    # The hand-offs were real: the serving decode engine pulled the prompts' KV.
    pulled = sum(metric(d.url, "pdfleet_engine_kv_transfer_blocks_pulled_total") for d in (d1, d2))
    assert pulled > pulled0


async def _timed_load(url: str, n: int) -> list[float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def one(i: int) -> float:
        started = time.monotonic()
        kw = dict(model="tiny", prompt=f"{i} stopped. {PROMPT}", max_tokens=4, temperature=0)
        if i % 2:
            await client.completions.create(**kw)
        else:
            async for _ in await client.completions.create(**kw, stream=True):
                pass
        return time.monotonic() - started

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)
    finally:
        await client.close()


def test_stalled_decode_engine_hits_the_idle_first_token_and_request_timeouts(fleet, tmp_path):
    d1 = fleet["d1"]
    gw = start_gateway(
        [
            "--decode",
            d1.url,
            "--disaggregation-mode",
            "Disabled",
            "--first-token-timeout",
            "1.5",
            "--idle-timeout",
            "1",
            "--request-timeout",
            "2.5",
            "--scrape-interval",
            "30",  # keep the stalled engine routable: the timeouts are under test
        ],
        tmp_path,
    )
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 480, "ignore_eos": True}
    try:
        events: list[str] = []
        stalled_at = None
        with httpx.stream(
            "POST", gw.url + "/v1/completions", json={**body, "stream": True}, timeout=30
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                if stalled_at is None and len(events) == 2:
                    d1.signal(signal.SIGSTOP)
                    stalled_at = time.monotonic()
        waited = time.monotonic() - stalled_at
        d1.signal(signal.SIGCONT)
        assert 0.9 < waited < 4, waited
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 504 and "sent nothing for 1s" in error["message"]

        # An engine that does not even accept the request: a stream's first-token
        # timeout, and a JSON answer's request timeout, are plain 504s.
        for stream, limit in ((True, 1.5), (False, 2.5)):
            d1.signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                late = httpx.post(
                    gw.url + "/v1/completions", json={**body, "stream": stream}, timeout=30
                )
            finally:
                d1.signal(signal.SIGCONT)
            assert limit - 0.1 < time.monotonic() - started < limit + 4
            assert late.status_code == 504
            assert late.json()["error"]["type"] == "GatewayTimeoutError"
        assert metric(gw.url, "pdfleet_gateway_upstream_errors_total", kind="timeout") == 3
    finally:
        d1.signal(signal.SIGCONT)
        gw.stop()


def test_decode_engine_killed_mid_stream_the_stream_resumes_on_the_other_one(fleet):
    gw = fleet["gateway"]
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }

    def stream(kill_after: int | None) -> list[str]:
        events: list[str] = []
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == kill_after:
                    # The merged metric: every worker's in-flight requests (/engines
                    # is one worker's view with --workers N).
                    serving = [
                        fleet[n]
                        for n in ("d1", "d2")
                        if metric(gw.url, INFLIGHT, engine=fleet[n].url, role="decode")
                    ]
                    assert len(serving) == 1
                    serving[0].signal(signal.SIGKILL)
                    fleet["step_delay"].write_text("")  # the other engine ends it at speed
        return events

    def text(events: list[str]) -> str:
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    reference = stream(None)
    # Engines slowed to 20 ms a step until the kill: the stream (480 tokens) is
    # surely still on its engine when the client has looked it up.
    fleet["step_delay"].write_text("0.02")
    try:
        events = stream(1)  # at the first event: the engine is still generating
    finally:
        fleet["step_delay"].write_text("")
    # One answer: the other engine went on from the tokens the client had
    # (docs/migration.md), no error event, the unfaulted text.
    assert events[-1] == "[DONE]"
    assert not any('"error"' in e for e in events)
    assert text(events) == text(reference)
    # A SIGKILL shows as a reset or an early end (died), or, when the next read
    # finds the port closed first, as a refused connection.
    moved = sum(
        metric(gw.url, "pdfleet_gateway_migrations_total", reason=r) for r in ("died", "refused")
    )
    assert moved >= 1


async def _load(url: str, n: int, offset: int = 0, done: list[int] | None = None) -> list[int]:
    """``n`` concurrent requests; the completion tokens of each. ``done``: gets the
    index of each request as it completes."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def request(i: int) -> int:
        kw = dict(model="tiny", prompt=f"{offset + i}. {PROMPT}", max_tokens=8, temperature=0)
        kw["extra_body"] = {"ignore_eos": True}
        if i % 2:
            return (await client.completions.create(**kw)).usage.completion_tokens
        usage = None
        stream = await client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def one(i: int) -> int:
        tokens = await request(i)
        if done is not None:
            done.append(i)
        return tokens

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 180)
    finally:
        await client.close()


def _kill_under_load(gw_url: str, victim, n: int) -> list[int]:
    """``n`` concurrent requests; SIGKILL ``victim`` while it holds prefill legs,
    then at once ``n`` more, which the gateway routes before its health checks
    can notice the death: legs in flight break, new ones find the port closed.
    The victim is stopped first so that legs pile up on it however fast it is
    (the gateway's stall watchdog must be slower than the pile-up: on one
    loaded core, sending the load can take longer than a 1 s stall timeout).
    Should the victim still be ejected before two legs reach it, or the gateway
    send it no more (at the capacity it learned for it while loaded, or the rest
    of the load answered elsewhere), it is let go, served back to health, and
    stopped again (that round's requests complete too)."""

    def inflight() -> float:  # every worker's (merged /metrics), not one worker's view
        return metric(gw_url, INFLIGHT, engine=victim.url)

    def piled_up_ejected_or_missed(completed: list[int]) -> bool:
        # No second leg can reach the stopped victim once it holds as many as the
        # capacity the gateway learned for it (which grows only with its answers),
        # nor once all but one request of the load are answered: the window is
        # missed, as when it is ejected.
        held = inflight()
        capacity = metric(gw_url, "pdfleet_gateway_engine_capacity", engine=victim.url)
        return (
            held >= 2
            or state(gw_url, victim.url)["state"] == "ejected"
            or 1 <= capacity <= held
            or len(completed) >= n - 1
        )

    async def main() -> list[int]:
        done: list[int] = []
        for attempt in range(3):
            completed: list[int] = []
            victim.signal(signal.SIGSTOP)
            first = asyncio.create_task(_load(gw_url, n, 2 * n * attempt, completed))
            waited = functools.partial(piled_up_ejected_or_missed, completed)
            try:
                await asyncio.to_thread(wait_until, waited, 30, 0.02)
                held = inflight() >= 2
            except BaseException:
                victim.signal(signal.SIGKILL)
                first.cancel()
                raise
            if held:
                victim.signal(signal.SIGKILL)
                second = asyncio.create_task(_load(gw_url, n, offset=2 * n * attempt + n))
                return [*done, *(await first), *(await second)]
            victim.signal(signal.SIGCONT)  # missed the window: serve, recover, retry
            done += await first
            healthy = await asyncio.to_thread(
                wait_until, lambda: state(gw_url, victim.url)["state"] == "healthy", 30
            )
            assert healthy, f"{victim.url} did not come back after its stall"
        victim.signal(signal.SIGKILL)
        raise AssertionError(f"{victim.url} never held prefill legs")

    return asyncio.run(main())


def test_prefill_engines_killed_under_load_every_request_completes(fleet, tmp_path):
    # A gateway whose stall watchdog does not eject the stopped victims before
    # their legs pile up (the watchdog itself is tested above).
    gateway = start_gateway(gateway_args(fleet["all"], stall_timeout=60), tmp_path)
    try:
        _kill_both_prefill_engines(gateway.url, fleet["p1"], fleet["p2"])
    finally:
        gateway.stop()


def _kill_both_prefill_engines(gw: str, p1, p2) -> None:
    # (One decode engine was killed above; the other serves.)
    assert wait_until(lambda: health(gw)["routable"]["prefill"] == 2, 20)
    retries0 = metric(gw, "pdfleet_gateway_retries_total", role="prefill")

    # One prefill engine dies: its legs are retried on the other.
    counts = _kill_under_load(gw, p1, 16)
    assert counts == [8] * len(counts) and len(counts) >= 32
    assert metric(gw, "pdfleet_gateway_retries_total", role="prefill") > retries0
    assert wait_until(lambda: state(gw, p1.url)["state"] == "ejected", 5)

    # The last one dies too: requests are served decode-only and counted.
    fallbacks0 = metric(gw, "pdfleet_gateway_fallbacks_total")
    counts = _kill_under_load(gw, p2, 16)
    assert counts == [8] * len(counts) and len(counts) >= 32
    assert metric(gw, "pdfleet_gateway_fallbacks_total", reason="prefill_failed") >= 1
    assert metric(gw, "pdfleet_gateway_fallbacks_total") >= fallbacks0 + 1
    assert wait_until(lambda: health(gw)["routable"]["prefill"] == 0, 5)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=60)
    before = metric(gw, "pdfleet_gateway_fallbacks_total", reason="no_prefill_engine")
    wanted = metric(gw, "pdfleet_gateway_activation_requests_total", role="prefill")
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert metric(gw, "pdfleet_gateway_fallbacks_total", reason="no_prefill_engine") == before + 1
    # ... and each such request is the activation signal for a prefill pool at zero.
    assert metric(gw, "pdfleet_gateway_activation_requests_total", role="prefill") == wanted + 1


def test_a_decode_engine_that_died_between_checks_gets_a_502_then_a_held_503(fleet, tmp_path):
    alive = next(fleet[n] for n in ("d1", "d2") if fleet[n].proc.poll() is None)
    gw = start_gateway(
        ["--decode", alive.url, "--scrape-interval", "30", "--hold-timeout", "1"], tmp_path
    )
    try:
        alive.signal(signal.SIGKILL)
        alive.proc.wait(10)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert refused.value.status_code == 502
        assert refused.value.message.endswith("the decode engine could not be reached")
        # The refusal ejected it at once, without waiting for the next check; the
        # next request is held for --hold-timeout, then told when to come back.
        started = time.monotonic()
        none_left = httpx.post(
            gw.url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True},
            timeout=30,
        )
        assert 0.9 < time.monotonic() - started < 5
        assert none_left.status_code == 503 and none_left.headers["retry-after"] == "5"
        assert none_left.json()["error"]["code"] == 503
    finally:
        gw.stop()
