"""Prefill and decode servers joined by a real connector (NIXL in host memory, or ZMQ)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from helpers.server import ServerProcess, free_port, scrape, wait_until

MAX_LEN = 512


def kv_args(connector: str, role: str, port: int, **extra) -> list[str]:
    cfg = {"kv_connector": connector, "kv_role": role, "kv_port": port}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


def serve(model: str, log_dir, name: str, *extra: str, port: int | None = None) -> ServerProcess:
    return ServerProcess(
        ["serve", model, "--max-model-len", str(MAX_LEN), "--disable-log-stats", *extra],
        log_dir,
        name,
        port=port,
    )


@pytest.fixture(scope="module", params=["NixlConnector", "ZmqConnector"])
def fleet(request, tiny_model, tmp_path_factory):
    connector = request.param
    logs = tmp_path_factory.mktemp(f"pd-{connector}")
    procs = {
        "prefill": serve(
            tiny_model,
            logs,
            "prefill",
            *kv_args(connector, "kv_producer", free_port(), lease_seconds=3),
        ),
        "decode": serve(
            tiny_model, logs, "decode", *kv_args(connector, "kv_consumer", free_port())
        ),
        "agg": serve(tiny_model, logs, "agg"),
    }
    try:
        for p in procs.values():
            p.wait_healthy()
        yield {k: p.url for k, p in procs.items()} | {"connector": connector}
    finally:
        for p in procs.values():
            p.stop()


def two_legs(fleet, body: dict, stream: bool = False, endpoint: str = "/v1/completions"):
    """The gateway's protocol (DESIGN §1), done by hand."""
    pre = httpx.post(
        fleet["prefill"] + endpoint,
        timeout=60,
        json={
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
    )
    assert pre.status_code == 200, pre.text
    params = pre.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    decode_body = {**body, "kv_transfer_params": params}
    if not stream:
        r = httpx.post(fleet["decode"] + endpoint, json=decode_body, timeout=60)
        assert r.status_code == 200, r.text
        return params, r.json()["choices"][0][
            "text" if "completions" in endpoint and "chat" not in endpoint else "message"
        ]
    text = ""
    with httpx.stream(
        "POST", fleet["decode"] + endpoint, json={**decode_body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
    return params, text


def aggregated(fleet, body: dict) -> str:
    r = httpx.post(fleet["agg"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


WORDS = [
    "the",
    "harbor",
    "was",
    "quiet",
    "before",
    "dawn",
    "and",
    "boats",
    "rocked",
    "against",
    "the",
    "pier",
]


def prompt_of(n_tokens_hint: int, seed: int) -> list[int]:
    # Token-id prompts give exact lengths: shorter than a block, exact multiples, long.
    return [(seed * 131 + i * 17) % 1700 + 20 for i in range(n_tokens_hint)]


LENGTHS = [3, 10, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 127, 128, 200, 300]


def test_two_leg_protocol_is_token_identical_to_one_engine(fleet):
    async def run_all():
        async def one(i: int, n: int):
            body = {
                "prompt": prompt_of(n, i),
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            ref = await asyncio.to_thread(aggregated, fleet, body)
            params, text = await asyncio.to_thread(two_legs, fleet, body, i % 2 == 1)
            return n, params, text, ref

        return await asyncio.gather(*(one(i, n) for i, n in enumerate(LENGTHS)))

    for n, params, text, ref in asyncio.run(run_all()):
        assert text == ref, f"prompt of {n} tokens"
        assert len(params["remote_block_ids"]) == (n - 1) // 16
    d = scrape(fleet["decode"])
    assert d["pdfleet_engine_kv_transfers_total"] >= sum(1 for n in LENGTHS if (n - 1) // 16)
    assert d["pdfleet_engine_kv_transfer_blocks_pulled_total"] > 0
    # Every lease was claimed: the producer's blocks are free again.
    assert wait_until(
        lambda: scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] == 0, 10
    )
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_transfer_expired_leases_total"] == 0


def test_chat_through_both_legs(fleet):
    body = {
        "messages": [{"role": "user", "content": " ".join(WORDS * 3)}],
        "max_tokens": 8,
        "temperature": 0,
    }
    _, message = two_legs(fleet, body, endpoint="/v1/chat/completions")
    ref = httpx.post(fleet["agg"] + "/v1/chat/completions", json=body, timeout=60).json()
    assert message["content"] == ref["choices"][0]["message"]["content"]


def test_decode_prefix_cache_reduces_blocks_pulled(fleet):
    base = prompt_of(96, 777)
    body = {"prompt": base, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    two_legs(fleet, body)
    before = scrape(fleet["decode"])["pdfleet_engine_kv_transfer_blocks_pulled_total"]
    longer = {**body, "prompt": base + prompt_of(40, 778)}  # 136 tokens: 8 full blocks
    _, text = two_legs(fleet, longer)
    pulled = scrape(fleet["decode"])["pdfleet_engine_kv_transfer_blocks_pulled_total"] - before
    # The first 6 blocks are already cached on the decode engine: only 2 are pulled.
    assert pulled == 2
    assert text == aggregated(fleet, longer)


def test_unclaimed_lease_frees_the_producers_blocks(fleet):
    pre = httpx.post(
        fleet["prefill"] + "/v1/completions",
        timeout=60,
        json={
            "prompt": prompt_of(80, 999),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()
    assert len(pre["kv_transfer_params"]["remote_block_ids"]) == 4
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] > 0
    assert wait_until(
        lambda: scrape(fleet["prefill"])["pdfleet_engine_kv_transfer_expired_leases_total"] >= 1,
        15,
    )
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] == 0


@pytest.mark.parametrize(
    "params, message",
    [
        ({"do_remote_prefill": True}, "not signed"),
        ({"do_remote_decode": True}, "not a KV producer"),
    ],
)
def test_bad_kv_transfer_params_are_a_400(fleet, params, message):
    r = httpx.post(
        fleet["decode"] + "/v1/completions",
        timeout=30,
        json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
    )
    assert r.status_code == 400 and message in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def nixl_pair(tiny_model, tmp_path_factory):
    """A consumer with each failure policy, and an aggregated reference."""
    logs = tmp_path_factory.mktemp("pd-failures")
    procs = {
        "recompute": serve(
            tiny_model, logs, "d-recompute", *kv_args("NixlConnector", "kv_consumer", free_port())
        ),
        "fail": serve(
            tiny_model,
            logs,
            "d-fail",
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": "kv_consumer",
                    "kv_port": free_port(),
                    "kv_load_failure_policy": "fail",
                }
            ),
        ),
        "agg": serve(tiny_model, logs, "agg"),
    }
    try:
        for p in procs.values():
            p.wait_healthy()
        yield {k: p.url for k, p in procs.items()} | {"logs": logs}
    finally:
        for p in procs.values():
            p.stop()


def start_producer(model, logs, http_port=None, kv_port=None, name="prefill") -> ServerProcess:
    return serve(
        model,
        logs,
        name,
        *kv_args("NixlConnector", "kv_producer", kv_port or free_port(), lease_seconds=5),
        port=http_port,
    ).wait_healthy()


def prefill(url: str, body: dict) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_producer_killed_recompute_completes_and_fail_errors_in_bound(tiny_model, nixl_pair):
    producer = start_producer(tiny_model, nixl_pair["logs"], name="doomed")
    body = {"prompt": prompt_of(120, 5), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    params = prefill(producer.url, body)
    os.kill(producer.proc.pid, signal.SIGKILL)
    producer.stop()
    ref = httpx.post(nixl_pair["agg"] + "/v1/completions", json=body, timeout=60).json()
    r = httpx.post(
        nixl_pair["recompute"] + "/v1/completions",
        timeout=60,
        json={**body, "kv_transfer_params": params},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert (
        scrape(nixl_pair["recompute"])["pdfleet_engine_kv_transfer_handshake_failures_total"] >= 1
    )
    start = time.monotonic()
    r = httpx.post(
        nixl_pair["fail"] + "/v1/completions",
        timeout=60,
        json={**body, "kv_transfer_params": params},
    )
    elapsed = time.monotonic() - start
    assert r.status_code == 502 and "kv_load_failure_policy is fail" in r.json()["error"]["message"]
    assert elapsed < 5.0
    # A stream with the fail policy ends with an error event, not a hang.
    with httpx.stream(
        "POST",
        nixl_pair["fail"] + "/v1/completions",
        timeout=30,
        json={**body, "stream": True, "kv_transfer_params": params},
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert "error" in json.loads(lines[-2][6:]) and lines[-1] == "data: [DONE]"


def test_producer_frozen_before_the_handshake_is_bounded(tiny_model, nixl_pair):
    producer = start_producer(tiny_model, nixl_pair["logs"], name="frozen")
    try:
        body = {"prompt": prompt_of(160, 6), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        params = prefill(producer.url, body)
        os.kill(producer.proc.pid, signal.SIGSTOP)  # alive but silent: the handshake hangs
        start = time.monotonic()
        r = httpx.post(
            nixl_pair["recompute"] + "/v1/completions",
            timeout=60,
            json={**body, "kv_transfer_params": params},
        )
        assert r.status_code == 200 and time.monotonic() - start < 8
        ref = httpx.post(nixl_pair["agg"] + "/v1/completions", json=body, timeout=60).json()
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
        producer.stop()


def test_restarted_producer_on_the_same_address(tiny_model, nixl_pair):
    http_port, kv_port = free_port(), free_port()

    def body(seed: int) -> dict:
        return {
            "prompt": prompt_of(90, seed),
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }

    def expected(seed: int) -> str:
        r = httpx.post(nixl_pair["agg"] + "/v1/completions", json=body(seed), timeout=60)
        return r.json()["choices"][0]["text"]

    def pd(producer_url: str, seed: int, params: dict | None = None) -> str:
        params = params or prefill(producer_url, body(seed))
        r = httpx.post(
            nixl_pair["recompute"] + "/v1/completions",
            timeout=60,
            json={**body(seed), "kv_transfer_params": params},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def transfers() -> float:
        return scrape(nixl_pair["recompute"])["pdfleet_engine_kv_transfers_total"]

    first = start_producer(tiny_model, nixl_pair["logs"], http_port, kv_port, "first")
    assert pd(first.url, 80) == expected(80)
    stale = prefill(first.url, body(81))
    first.stop()
    second = start_producer(tiny_model, nixl_pair["logs"], http_port, kv_port, "second")
    try:
        # A new handshake with the new instance on the same address.
        before = transfers()
        assert pd(second.url, 82) == expected(82)
        assert transfers() == before + 1
        # Params naming the old instance are refused and recomputed, still correct.
        assert pd(second.url, 81, stale) == expected(81)
        assert transfers() == before + 1
    finally:
        second.stop()


def test_incompatible_engines_are_refused_naming_the_field(tiny_model, tmp_path, nixl_pair):
    producer = start_producer(tiny_model, tmp_path, name="p16")
    consumer = serve(
        tiny_model,
        tmp_path,
        "d32",
        "--block-size",
        "32",
        *kv_args("NixlConnector", "kv_consumer", free_port()),
    ).wait_healthy()
    try:
        body = {"prompt": prompt_of(100, 9), "max_tokens": 3, "temperature": 0}
        params = prefill(producer.url, body)
        r = httpx.post(
            consumer.url + "/v1/completions",
            timeout=30,
            json={**body, "kv_transfer_params": params},
        )
        assert r.status_code == 400 and "block_size" in r.json()["error"]["message"]
        # Params without the factors are altered params: refused before any dial.
        bare = {k: v for k, v in params.items() if k != "pdfleet_compat"}
        r = httpx.post(
            consumer.url + "/v1/completions", timeout=30, json={**body, "kv_transfer_params": bare}
        )
        assert r.status_code == 400 and "signature" in r.json()["error"]["message"]
        assert scrape(consumer.url).get("pdfleet_engine_kv_transfers_total", 0) == 0
        assert scrape(consumer.url).get("pdfleet_engine_kv_transfer_handshakes_total", 0) == 0
    finally:
        producer.stop()
        consumer.stop()
