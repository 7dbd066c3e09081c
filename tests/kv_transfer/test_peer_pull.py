"""Peer pulls between aggregated ``kv_both`` engines (real processes, NIXL in host
memory): a holder lends the cached prefix blocks it holds, from its device or its
host tier, under a prefill leg's lease; a puller pulls them and computes the tail."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.server import ServerProcess, fleet_headers, free_port, scrape, wait_until

MAX_LEN = 512
BLOCK = 16
LOADED = "pdfleet_engine_kv_offload_loaded_bytes_total"


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, headers=fleet_headers(), **kw)


def kv_args(connector: str, role: str, port: int, **extra) -> list[str]:
    cfg = {"kv_connector": connector, "kv_role": role, "kv_port": port}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1700 + 20 for i in range(n)]


def both(model: str, logs, name: str, *extra: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        [
            "serve",
            model,
            "--max-model-len",
            str(MAX_LEN),
            "--disable-log-stats",
            *extra,
            *kv_args("NixlConnector", "kv_both", free_port(), lease_seconds=10),
        ],
        logs,
        name,
        env=env,
    )


@pytest.fixture(scope="module")
def peers(tiny_model, tmp_path_factory):
    """A holder whose device cache holds 40 blocks (a host tier behind it) and a
    puller whose READs can be delayed (the transports' test hook)."""
    logs = tmp_path_factory.mktemp("peer-pull")
    delay = logs / "read-delay"
    delay.write_text("0")
    holder = both(
        tiny_model, logs, "holder", "--num-gpu-blocks-override", "40", "--kv-offload-bytes", "64M"
    )
    puller = both(tiny_model, logs, "puller", env={"PDFLEET_KV_TEST_READ_DELAY_FILE": str(delay)})
    try:
        holder.wait_healthy()
        puller.wait_healthy()
        yield {"holder": holder.url, "puller": puller.url, "logs": logs, "delay": delay}
    finally:
        holder.stop()
        puller.stop()


def complete(url: str, body: dict, **extra) -> str:
    r = post(url + "/v1/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def lend(url: str, body: dict, blocks: int):
    return post(
        url + "/v1/completions",
        timeout=60,
        json={
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "pdfleet_lend_blocks": blocks},
        },
    )


def body_of(prefix_seed: int, prefix: int = 200, tail: int = 60) -> dict:
    prompt = prompt_of(prefix, prefix_seed) + prompt_of(tail, prefix_seed + 1000)
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def recomputed(url: str, body: dict) -> str:
    """The same prompt computed from scratch there (another cache namespace)."""
    return complete(url, body, cache_salt="reference")


def pulled(peers, body: dict, blocks: int) -> tuple[str, float]:
    before = scrape(peers["puller"])
    r = lend(peers["holder"], body, blocks)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == blocks
    text = complete(peers["puller"], body, kv_transfer_params=params)
    after = scrape(peers["puller"])
    got = after["pdfleet_engine_kv_transfer_blocks_pulled_total"] - before.get(
        "pdfleet_engine_kv_transfer_blocks_pulled_total", 0.0
    )
    return text, got


def test_pull_from_a_peers_device_tier_is_token_identical(peers):
    body = body_of(1)
    prefix = {"prompt": body["prompt"][:200], "max_tokens": 1}
    complete(peers["holder"], prefix)  # the holder caches the prefix
    text, blocks = pulled(peers, body, 200 // BLOCK)
    assert blocks == 200 // BLOCK
    assert text == recomputed(peers["puller"], body)


def test_pull_from_a_peers_host_tier_is_token_identical(peers):
    holder = peers["holder"]
    body = body_of(2)
    complete(holder, {"prompt": body["prompt"][:200], "max_tokens": 1})
    loaded = scrape(holder).get(LOADED, 0.0)
    # Other prompts take the 40 device blocks: the prefix lives on in the host tier.
    for seed in range(3):
        complete(holder, {"prompt": prompt_of(300, 500 + seed), "max_tokens": 1})
    text, blocks = pulled(peers, body, 200 // BLOCK)
    assert blocks == 200 // BLOCK
    assert scrape(holder)[LOADED] > loaded
    assert text == recomputed(peers["puller"], body)


def test_a_lend_of_blocks_the_holder_no_longer_holds_is_refused(peers):
    body = body_of(3)  # never computed on the holder
    r = lend(peers["holder"], body, 200 // BLOCK)
    assert r.status_code == 502, r.text
    assert "pdfleet_lend_blocks" in r.json()["error"]["message"]
    # Nothing computed on the holder for it: a refused lend costs no prefill there.


def test_holder_killed_mid_pull_recomputes_correctly(tiny_model, peers):
    doomed = both(tiny_model, peers["logs"], "doomed").wait_healthy()
    body = body_of(4)
    try:
        complete(doomed.url, {"prompt": body["prompt"][:200], "max_tokens": 1})
        r = lend(doomed.url, body, 200 // BLOCK)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        failures = scrape(peers["puller"]).get("pdfleet_engine_kv_transfer_failures_total", 0.0)
        peers["delay"].write_text("1.5")  # the READ waits: kill the holder meanwhile
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, peers["puller"], body, kv_transfer_params=params)
            assert wait_until(
                lambda: scrape(peers["puller"]).get("pdfleet_engine_kv_pulls_in_flight", 0) > 0,
                timeout=30,
                interval=0.02,
            )
            os.kill(doomed.proc.pid, signal.SIGKILL)
            text = fut.result(timeout=60)
    finally:
        peers["delay"].write_text("0")
        doomed.stop()
    assert scrape(peers["puller"])["pdfleet_engine_kv_transfer_failures_total"] > failures
    assert text == recomputed(peers["puller"], body)
