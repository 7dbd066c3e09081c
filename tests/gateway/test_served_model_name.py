"""`pdfleet gateway --served-model-name`: the names it answers to, as vLLM's
flag: `/v1/models` lists them (with the engine's details, and without an
engine at all), and a request for another model is a 404 that reaches no
engine."""

from __future__ import annotations

import httpx
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import start_gateway
from helpers.server import wait_until


@pytest.fixture
def decode():
    engine = FakeEngine()
    yield engine
    engine.close()


def test_the_gateway_answers_to_its_names_and_refuses_others_before_any_engine(decode, tmp_path):
    gw = start_gateway(
        [
            "--decode",
            decode.url,
            "--served-model-name",
            "fleet",
            "alias",
            "--scrape-interval",
            "0.2",
            "--scale-to-zero",
        ],
        tmp_path,
    )
    try:
        models = httpx.get(gw.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["fleet", "alias"]
        assert all(m["object"] == "model" for m in models["data"])

        posts = lambda: [s for s in decode.seen if s.method == "POST"]  # noqa: E731
        for name in ("fleet", "alias"):
            body = {"model": name, "prompt": "hi", "max_tokens": 2}
            resp = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
        assert len(posts()) == 2
        body = {"model": "other", "prompt": "hi", "max_tokens": 2}
        resp = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 404
        error = resp.json()["error"]
        assert error["param"] == "model" and "`other` does not exist" in error["message"]
        assert len(posts()) == 2  # refused by the gateway: no engine saw it

        # No routable decode engine (scaled to zero): the names are still listed.
        decode.health_status = 503
        assert wait_until(lambda: _routable(gw.url) == 0, 20)
        resp = httpx.get(gw.url + "/v1/models", timeout=10)
        assert resp.status_code == 200
        assert [m["id"] for m in resp.json()["data"]] == ["fleet", "alias"]
    finally:
        gw.stop()


def _routable(url: str) -> int:
    return httpx.get(url + "/engines", timeout=5).json()["routable"]["decode"]
