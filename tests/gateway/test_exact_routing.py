"""Exact prefix routing end to end: real engines publishing KV events, two
pdfleet gateway replicas, and vLLM's own router (``vllm-router --policy
kv_aware``) reading the same streams."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.fleet import metric, start_engines, start_gateway
from helpers.server import fleet_headers, free_port, stop_all, wait_until

ROOT = Path(__file__).resolve().parents[2]
ROUTER_VENV = ROOT / "build" / "vllm-router-venv"
ROUTER_BIN = ROUTER_VENV / "bin" / "vllm-router"


def events_config(pub: int, replay: int) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "heartbeat_interval": 0.5,
        # vLLM's router reads these streams too: in the clear, with token ids
        # (the pdfleet gateways below subscribe with --kv-events-auth none).
        "auth": "none",
        "include_token_ids": True,
    }
    return ["--kv-events-config", json.dumps(config)]


@pytest.fixture(scope="module")
def kv_engines(tiny_model, tmp_path_factory):
    """Two aggregated engines publishing KV events: [(engine, pub, replay), ...]."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    procs = start_engines(
        tiny_model,
        tmp_path_factory.mktemp("kv-engines"),
        ["kv1", "kv2"],
        per_engine=[events_config(*p) for p in ports],
    )
    try:
        yield [(proc, *p) for proc, p in zip(procs, ports, strict=True)]
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def kv_gateways(kv_engines, tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-gateways")
    engines_file = log_dir / "engines.json"
    engines_file.write_text(
        json.dumps(
            {
                "engines": [
                    {
                        "url": e.url,
                        "role": "decode",
                        "kv_events": f"tcp://127.0.0.1:{pub}",
                        "kv_events_replay": f"tcp://127.0.0.1:{replay}",
                    }
                    for e, pub, replay in kv_engines
                ]
            }
        )
    )
    args = [
        "--engines-file",
        str(engines_file),
        "--disaggregation-mode",
        "Disabled",
        "--tokenizer",
        tiny_model,
        "--scrape-interval",
        "0.2",
        "--kv-events-auth",
        "none",
    ]
    procs = []
    try:
        for _ in range(2):
            procs.append(start_gateway(args, log_dir))
        yield procs
    finally:
        stop_all(procs)


def served(engines) -> list[float]:
    return [metric(e.url, "pdfleet_engine_request_success_total") for e, _, _ in engines]


def chat(url: str, messages: list[dict], headers: dict | None = None) -> str:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0},
        headers=headers or {},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def where(engines, url: str, messages: list[dict], headers: dict | None = None) -> int:
    """Index of the engine that served one request (requests run one at a time)."""
    before = served(engines)
    reply = chat(url, messages, headers)
    messages.append({"role": "assistant", "content": reply})
    # An engine counts a finished request after the step that delivered its
    # answer, so the count may move just after the client has the reply.
    after = before

    def counted() -> bool:
        nonlocal after
        after = served(engines)
        return sum(after) > sum(before)

    assert wait_until(counted, 10), (before, after)
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
    assert len(moved) == 1, (before, after)
    return moved[0]


def conversation(n: int) -> list[dict]:
    return [
        {"role": "system", "content": f"Conversation {n}. " + "Answer briefly and kindly. " * 8},
        {"role": "user", "content": f"first question of conversation {n} " * 3},
    ]


def stored_events(url: str, engine_url: str) -> float:
    return metric(
        url, "pdfleet_gateway_kv_index_events_total", engine=engine_url, type="BlockStored"
    )


def test_both_gateway_replicas_route_each_conversation_to_the_engine_that_cached_it(
    kv_engines, kv_gateways
):
    gw1, gw2 = kv_gateways
    for gw in kv_gateways:
        for e, _, _ in kv_engines:
            assert wait_until(
                lambda gw=gw, e=e: (
                    metric(gw.url, "pdfleet_gateway_kv_index_fresh", engine=e.url) == 1
                ),
                30,
            ), f"{gw.url} does not follow {e.url}'s KV events"
    # Each conversation's first turn goes straight to "its" engine, behind the
    # gateways' backs: only the KV events can tell them where it is cached.
    convs = {i: conversation(i) for i in range(2)}
    for i, (e, _, _) in enumerate(kv_engines):
        before = [stored_events(gw.url, e.url) for gw in kv_gateways]
        reply = chat(e.url, convs[i], fleet_headers())
        convs[i].append({"role": "assistant", "content": reply})
        for gw, b in zip(kv_gateways, before, strict=True):
            assert wait_until(lambda gw=gw, b=b, e=e: stored_events(gw.url, e.url) > b, 30)
    for turn in range(2):
        for i in convs:
            convs[i].append({"role": "user", "content": f"follow-up {turn} of {i} " * 3})
            gw = (gw1, gw2)[(i + turn) % 2]  # the replicas take turns
            assert where(kv_engines, gw.url, convs[i]) == i, (turn, i)
    # The engines' own counters agree: the follow-ups were served from cache.
    for e, _, _ in kv_engines:
        assert metric(e.url, "pdfleet_engine_prefix_cache_hits_total") > 0


def install_vllm_router() -> Path:
    """vllm-router in a cached venv under build/ (bounded); skip if it cannot be had."""
    if ROUTER_BIN.exists():
        return ROUTER_BIN
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", "vllm-router"],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"vllm-router could not be installed ({type(e).__name__}: {e})")
    if not ROUTER_BIN.exists():
        pytest.skip("the vllm-router package installed no vllm-router binary")
    return ROUTER_BIN


def test_vllm_router_kv_aware_decodes_our_events_and_routes_back_to_the_cached_engine(
    kv_engines, tiny_model, tmp_path
):
    binary = install_vllm_router()
    port = free_port()
    (e1, pub1, rep1), (e2, pub2, rep2) = kv_engines
    log_path = tmp_path / "vllm-router.log"
    args = [
        str(binary),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        e1.url,
        e2.url,
        "--policy",
        "kv_aware",
        "--kv-event-source",
        f"{e1.url}=tcp://127.0.0.1:{pub1}",
        "--kv-event-source",
        f"{e2.url}=tcp://127.0.0.1:{pub2}",
        "--kv-event-replay-source",
        f"{e1.url}=tcp://127.0.0.1:{rep1}",
        "--kv-event-replay-source",
        f"{e2.url}=tcp://127.0.0.1:{rep2}",
        "--kv-event-block-size",
        "16",
        "--kv-event-model",
        tiny_model,
        "--log-level",
        "debug",
        "--prometheus-port",
        str(free_port()),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"}
        )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, 60), log_path.read_text(errors="replace")[-3000:]
        url = f"http://127.0.0.1:{port}"

        def text() -> str:
            raw = log_path.read_bytes().replace(b"\x00", b"").decode(errors="replace")
            return re.sub(r"\x1b\[[0-9;]*m", "", raw)

        # The router applies our heartbeats as live batches.
        assert wait_until(lambda: text().count("live sequence advanced") >= 4, 30), text()[-3000:]
        convs = {i: conversation(10 + i) for i in range(2)}
        for i, (e, _, _) in enumerate(kv_engines):
            convs[i].append(
                {"role": "assistant", "content": chat(e.url, convs[i], fleet_headers())}
            )
            # Batches are applied in order: two more after the reply (heartbeats)
            # mean the blocks stored while answering were applied.
            seen = text().count(f"source={e.url} ")
            assert wait_until(lambda e=e, n=seen: text().count(f"source={e.url} ") >= n + 2, 30)
        for turn in range(2):
            for i in convs:
                convs[i].append({"role": "user", "content": f"and then {turn} for {i} " * 3})
                # The router passes the client's credential on (here the fleet's,
                # which the test engines want).
                got = where(kv_engines, url, convs[i], fleet_headers())
                assert got == i, (turn, i, text()[-3000:])
        log_text = text()
        credited = [int(x) for x in re.findall(r"credited_prefix_tokens=(\d+)", log_text)]
        assert credited and max(credited) > 0, log_text[-3000:]
        bad = [
            line
            for line in log_text.splitlines()
            if ("WARN" in line or "ERROR" in line) and "kv" in line.lower()
        ]
        assert not bad, bad[:5]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
