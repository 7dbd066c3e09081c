"""Fault handling of a real gateway process over recording engines
(``fake_engine.py``): the hold while no decode engine is routable, the KV
circuit breaker of a (prefill, decode) pair, and stall ejection with the
stalled requests resent. Real engines stopped and killed under load are in
test_resilience.py."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest
from gateway.fake_engine import PARAMS, FakeEngine, kv_pull_fails
from helpers.fleet import engines_view, metric, start_gateway
from helpers.server import wait_until

from pdfleet.engine.contracts.errors import ErrorBody

LONG = "word " * 400


@pytest.fixture
def fakes():
    engines = [FakeEngine(), FakeEngine()]
    yield engines
    for e in engines:
        e.close()


def complete(url: str, prompt: str = "hi", timeout: float = 30) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=timeout,
    )


def test_requests_are_held_while_no_decode_engine_is_routable_then_served(fakes, tmp_path):
    decode = fakes[1]
    decode.health_status = 503  # loading: not routable
    gw = start_gateway(
        ["--decode", decode.url, "--scrape-interval", "0.2", "--hold-timeout", "20"],
        tmp_path,
        healthy=False,
    )
    try:
        assert wait_until(lambda: _serving(gw.url), 30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(complete, gw.url)
            assert wait_until(lambda: metric(gw.url, "pdfleet_gateway_held_requests") == 1, 10)
            # Held, not answered, while no decode engine is routable.
            assert not held.done()
            decode.health_status = 200  # the engine is ready: the held request goes
            resp = held.result(30)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"
        assert metric(gw.url, "pdfleet_gateway_held_requests") == 0
        # The held request is the activation signal for a decode pool at zero.
        assert metric(gw.url, "pdfleet_gateway_activation_requests_total", role="decode") == 1
        # Without --scale-to-zero, no routable decode engine means unhealthy.
        decode.health_status = 503
        assert wait_until(lambda: httpx.get(gw.url + "/health").status_code == 503, 10)
    finally:
        gw.stop()


def test_scale_to_zero_keeps_health_up_without_a_decode_engine(fakes, tmp_path):
    decode = fakes[1]
    decode.health_status = 503  # scaled to zero, or still starting
    gw = start_gateway(
        ["--decode", decode.url, "--scrape-interval", "0.2", "--scale-to-zero"],
        tmp_path,
        healthy=False,
    )
    try:
        assert wait_until(lambda: _serving(gw.url), 30)
        resp = httpx.get(gw.url + "/health", timeout=5)
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    finally:
        gw.stop()


def _serving(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_a_pair_whose_hand_offs_keep_failing_is_routed_decode_only_for_a_cooldown(fakes, tmp_path):
    prefill, decode = fakes

    decode.answer = kv_pull_fails
    gw = start_gateway(
        [
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--disaggregation-mode",
            "Always",
            "--scrape-interval",
            "0.2",
            "--kv-pair-failures",
            "2",
            "--kv-pair-cooldown",
            "120",
        ],
        tmp_path,
    )
    try:
        assert wait_until(lambda: engines_view(gw.url)["routable"]["prefill"] == 1, 10)
        for _ in range(2):
            assert complete(gw.url, LONG).status_code == 502
        labels = {"prefill": prefill.url, "decode": decode.url}
        assert metric(gw.url, "pdfleet_gateway_kv_pair_open", **labels) == 1
        assert engines_view(gw.url)["kv_pairs_open"] == [labels]
        # The pair is open: no prefill leg, the decode engine computes the prompt.
        legs = len(prefill.posts())
        resp = complete(gw.url, LONG)
        assert resp.status_code == 200
        assert len(prefill.posts()) == legs
        assert "kv_transfer_params" not in decode.posts()[-1].body
        assert metric(gw.url, "pdfleet_gateway_fallbacks_total", reason="kv_pair_open") == 1
        assert decode.posts()[0].body["kv_transfer_params"] == PARAMS
    finally:
        gw.stop()


def test_a_stalled_engine_is_ejected_and_its_waiting_requests_go_elsewhere(fakes, tmp_path):
    slow, fast = fakes
    release = threading.Event()

    def stalled(body):
        release.wait(60)  # a wedged engine: it takes requests and answers nothing
        return 500, b"{}"

    slow.answer = stalled
    fast.tokens_per_scrape = 1  # the other engine computes all along
    gw = start_gateway(
        [
            "--decode",
            slow.url,
            fast.url,
            "--disaggregation-mode",
            "Disabled",
            "--scrape-interval",
            "0.2",
            "--stall-timeout",
            "1",
        ],
        tmp_path,
    )
    try:
        assert wait_until(lambda: engines_view(gw.url)["routable"]["decode"] == 2, 10)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: complete(gw.url, f"{i} hi"), range(8)))
        took = time.monotonic() - started
        assert [a.status_code for a in answers] == [200] * 8
        assert slow.posts(), "some requests went to the stalled engine first"
        # Each waited about --stall-timeout there, not for the engine (60 s).
        assert took < 8, took
        assert metric(gw.url, "pdfleet_gateway_engine_stalls_total", engine=slow.url) >= 1
        # Sent again to the other engine: a migration (the stalled engine had
        # sent nothing of them, so each goes whole; docs/migration.md).
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="stalled") >= 1
    finally:
        release.set()
        gw.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_decode_engine_refusing_the_producers_params_gets_the_prompt_decode_only(
    fakes, tmp_path, stream
):
    """An expired lease (a decode leg delayed past it) or a restarted producer:
    the decode engine refuses the params with a 400 naming them, and the
    gateway sends the leg again without them instead of failing the client."""
    prefill, decode = fakes

    def decode_answer(body):
        if body.get("kv_transfer_params"):
            # As an engine refuses them: param names the field (the message is prose).
            return 400, ErrorBody("the params have expired", 400, "kv_transfer_params").encode()
        out = {"id": "c", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        if body.get("stream"):
            return 200, b"data: " + json.dumps(out).encode() + b"\n\ndata: [DONE]\n\n"
        return 200, json.dumps(out).encode()

    decode.answer = decode_answer
    gw = start_gateway(
        [
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--disaggregation-mode",
            "Always",
            "--scrape-interval",
            "0.2",
        ],
        tmp_path,
    )
    try:
        assert wait_until(lambda: engines_view(gw.url)["routable"]["prefill"] == 1, 10)
        resp = httpx.post(
            gw.url + "/v1/completions",
            json={"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": stream},
            timeout=30,
        )
        assert resp.status_code == 200 and '"ok"' in resp.text
        legs = decode.posts()
        assert [("kv_transfer_params" in s.body) for s in legs] == [True, False]
        assert metric(gw.url, "pdfleet_gateway_fallbacks_total", reason="kv_params_refused") == 1
    finally:
        gw.stop()


def test_a_stream_whose_engine_stalls_after_its_first_events_ends_with_an_error_event(
    fakes, tmp_path
):
    slow, fast = fakes
    release = threading.Event()

    def event(text: str) -> bytes:
        return b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n' % text.encode()

    def stalls_mid_answer(body):
        def events():
            yield event("x")
            yield event("x")
            release.wait(60)  # stopped mid-answer
            yield b"data: [DONE]\n\n"

        if body.get("stream"):
            return 200, events()
        release.wait(60)
        return 500, b"{}"

    def answers(body):
        if body.get("stream"):
            return 200, iter([event("f"), b"data: [DONE]\n\n"])
        return 200, b'{"choices": [{"index": 0, "text": "f", "finish_reason": "length"}]}'

    slow.answer, fast.answer = stalls_mid_answer, answers
    fast.tokens_per_scrape = 1  # the other engine computes all along
    gw = start_gateway(
        [
            "--decode",
            slow.url,
            fast.url,
            "--disaggregation-mode",
            "Disabled",
            "--scrape-interval",
            "0.2",
            "--stall-timeout",
            "1",
        ],
        tmp_path,
    )
    try:
        assert wait_until(lambda: engines_view(gw.url)["routable"]["decode"] == 2, 10)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 50, "stream": True}
        for _ in range(6):  # ties alternate: one of the first streams lands on slow
            started = time.monotonic()
            with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=30) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            took = time.monotonic() - started
            if '"x"' in events[0]:
                break
        assert '"x"' in events[0] and '"x"' in events[1], events
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 504 and "stopped making progress" in error["message"]
        assert took < 6, took  # about --stall-timeout, not the 60 s the engine would take
    finally:
        release.set()
        gw.stop()
