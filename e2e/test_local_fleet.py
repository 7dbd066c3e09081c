"""`pdfleet up` end to end: a real gateway, prefill and decode engines, NIXL between them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from helpers.server import scrape, wait_until
from helpers.up import Up, fleet_spec

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.contracts.metrics import parse_metrics

SHORT = "Hello there"
LONG = "The harbor was quiet before dawn. Boats rocked against the pier. " * 6


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    up = Up(fleet_spec(tiny_model), tmp_path_factory.mktemp("fleet"))
    try:
        yield up.wait_ready()
    finally:
        code = up.stop()
        # Every child is gone: nothing answers on the engines' ports any more.
        for engine in up.engines() if up.run_dir.exists() else []:
            with pytest.raises(httpx.HTTPError):
                httpx.get(engine["url"] + "/health", timeout=1)
        assert code == 0, up.output()[-3000:]
        assert "stopped" in up.output()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(tiny_model, max_model_len=512)


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)


def gateway_metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    series = parse_metrics(text, only=[name]).samples.get(name, ())
    return sum(v for found, v in series if all(found.get(k) == x for k, x in labels.items()))


def test_openai_client_through_the_fleet_equals_a_single_engine(fleet, client, reference):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for prompt in (SHORT, LONG):
        (ref,) = reference.generate(prompt, greedy)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.outputs[0].text
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    messages = [{"role": "user", "content": LONG}]
    (ref,) = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10))
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert out.choices[0].message.content == ref.outputs[0].text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == ref.outputs[0].text


def test_decisions_are_visible_and_long_prompts_really_move_kv(fleet, client):
    decode = fleet.engine_url("decode")
    before = scrape(decode)["pdfleet_engine_kv_transfers_total"]
    short = gateway_metric(
        fleet.url, "pdfleet_gateway_disagg_decisions_total", decision="decode_only"
    )
    long_ = gateway_metric(
        fleet.url, "pdfleet_gateway_disagg_decisions_total", decision="prefill_decode"
    )
    client.completions.create(model="tiny", prompt=SHORT, max_tokens=2)
    # A prefix nobody has seen (a cached one would rightly go straight to decode).
    fresh = f"Fresh words {time.time()}: rivers carry sand from the mountains. " * 5
    client.completions.create(model="tiny", prompt=fresh, max_tokens=2)
    assert (
        gateway_metric(fleet.url, "pdfleet_gateway_disagg_decisions_total", decision="decode_only")
        == short + 1
    )
    assert (
        gateway_metric(
            fleet.url, "pdfleet_gateway_disagg_decisions_total", decision="prefill_decode"
        )
        == long_ + 1
    )
    assert scrape(decode)["pdfleet_engine_kv_transfers_total"] == before + 1


def test_the_gateway_follows_every_engines_kv_event_stream(fleet, client):
    engines = fleet.engines()
    assert {e["role"] for e in engines} == {"prefill", "decode"}
    for e in engines:
        assert e["kv_events"].startswith("tcp://127.0.0.1:"), e
        assert e["kv_events_replay"].startswith("tcp://127.0.0.1:"), e

    def fresh() -> bool:
        return all(
            gateway_metric(fleet.url, "pdfleet_gateway_kv_index_fresh", engine=e["url"]) == 1
            for e in engines
        )

    assert wait_until(fresh, timeout=30, interval=0.5), [
        gateway_metric(fleet.url, "pdfleet_gateway_kv_index_fresh", engine=e["url"])
        for e in engines
    ]
    # A new prompt's blocks reach the index through the decode engine's stream.
    decode = fleet.engine_url("decode")
    stored = gateway_metric(
        fleet.url, "pdfleet_gateway_kv_index_events_total", engine=decode, type="BlockStored"
    )
    prompt = f"Index words {time.time()}: the tide rose over the rocks. " * 5
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert wait_until(
        lambda: (
            gateway_metric(
                fleet.url,
                "pdfleet_gateway_kv_index_events_total",
                engine=decode,
                type="BlockStored",
            )
            > stored
        ),
        timeout=30,
        interval=0.5,
    )
    assert gateway_metric(fleet.url, "pdfleet_gateway_kv_index_blocks") > 0


def test_bad_input_through_the_fleet_is_an_openai_4xx(fleet):
    for body, status in (
        ({"prompt": "x", "max_tokens": -1}, 400),
        ({"prompt": "x", "model": "nope"}, 404),
        ({"prompt": LONG * 20, "max_tokens": 5}, 400),
    ):
        r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_200_concurrent_requests_complete_without_leaking_blocks(fleet):
    async def main():
        async with httpx.AsyncClient(
            base_url=fleet.url, timeout=300, limits=httpx.Limits(max_connections=250)
        ) as c:

            async def one(i: int) -> int:
                prompt = SHORT if i % 4 else LONG + str(i)
                r = await c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
                )
                return r.status_code

            return await asyncio.gather(*(one(i) for i in range(200)))

    codes = asyncio.run(main())
    assert codes.count(200) == 200, [c for c in codes if c != 200][:5]
    for engine in fleet.engines():
        assert wait_until(
            lambda url=engine["url"]: scrape(url)["pdfleet_engine_kv_cache_usage_ratio"] == 0, 30
        ), engine


def test_prefill_engine_killed_under_load_every_request_completes(fleet):
    async def main():
        async with httpx.AsyncClient(base_url=fleet.url, timeout=120) as c:

            async def one(i: int) -> int:
                r = await c.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": LONG + f" request {i}",
                        "max_tokens": 24,
                        "ignore_eos": True,
                    },
                )
                return r.status_code

            tasks = [asyncio.ensure_future(one(i)) for i in range(24)]
            await asyncio.sleep(0.5)
            kill_role(fleet, "prefill")
            return await asyncio.gather(*tasks)

    codes = asyncio.run(main())
    assert codes == [200] * 24
    # pdfleet up reports the death and restarts the engine.
    assert wait_until(lambda: "prefill-0 exited" in fleet.output(), 20), fleet.output()[-2000:]
    assert wait_until(lambda: any(e["role"] == "prefill" for e in fleet.engines()), 120)


def kill_role(fleet: Up, role: str) -> None:
    """kill -9 the engine process of ``role`` (found by its port)."""
    url = fleet.engine_url(role)
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout
    pids = [
        int(line.split()[0])
        for line in out.splitlines()
        if " serve " in line and f"--port {port}" in line
    ]
    assert pids, f"no process for {url}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def test_decode_engine_killed_mid_stream_ends_the_stream_within_the_hold(fleet):
    body = {"model": "tiny", "prompt": SHORT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        for line in it:
            if line:
                lines.append(line)
            if len(lines) == 3:
                break
        killed = time.monotonic()
        kill_role(fleet, "decode")
        for line in it:
            if line:
                lines.append(line)
    # The only decode engine is gone: the stream waits (bounded by the gateway's
    # hold, 10 s) for a decode engine to move to (docs/migration.md): the
    # restarted one if it is back in time, else it ends with an error event.
    assert time.monotonic() - killed < 10.0 + 15.0
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    if "error" not in last:
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert not any("error" in e for e in events)
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events) <= 400
    # The fleet restarts the decode engine and serves again.
    assert wait_until(lambda: "decode-0 exited" in fleet.output(), 20)
    assert wait_until(
        lambda: (
            httpx.post(
                fleet.url + "/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": SHORT, "max_tokens": 2},
            ).status_code
            == 200
        ),
        120,
        1.0,
    )
