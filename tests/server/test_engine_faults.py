"""No request kills an engine: admissibility checks, model-loop failures, request ids.

Against real `pdfleet serve` processes. The fault hook
(``$PDFLEET_FAULT_RAISE_ON_TOKEN``) makes every step that schedules a prompt
holding that token id raise, as a model failing on one input would;
``$PDFLEET_FAULT_BREAK_ON_TOKEN`` makes that step and every later one raise, as
a broken device would.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers.server import ServerProcess, free_port, scrape, stop_all, wait_until

FAULT = 5  # prompts holding this token id make their step raise
BREAK = 6  # prompts holding this token id break the engine for good
BLOCK = 16


@pytest.fixture(scope="module")
def vocab_size(tiny_model) -> int:
    with open(f"{tiny_model}/config.json") as f:
        return json.load(f)["vocab_size"]


LEASE = 4.0  # seconds the SIGTERM test's producer holds blocks nobody claims


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """The module's engines, started side by side (one engine's start is mostly
    waiting on one core) and not yet waited on: the shared one (``server``), the
    one the broken-engine test breaks, the producer the SIGTERM test stops."""
    logs = tmp_path_factory.mktemp("faults")
    # A KV consumer, so that kv_transfer_params are validated by a real connector.
    kv = {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": free_port()}
    producer = {
        "kv_connector": "ZmqConnector",
        "kv_role": "kv_producer",
        "kv_port": free_port(),
        "kv_connector_extra_config": {"lease_seconds": LEASE},
    }
    procs = {
        "server": ServerProcess(
            [
                "serve",
                tiny_model,
                "--max-model-len",
                "512",
                "--block-size",
                str(BLOCK),
                "--served-model-name",
                "tiny",
                "--disable-log-stats",
                "--kv-transfer-config",
                json.dumps(kv),
            ],
            logs,
            "server",
            env={"PDFLEET_FAULT_RAISE_ON_TOKEN": str(FAULT)},
        ),
        "broken": ServerProcess(
            ["serve", tiny_model, "--max-model-len", "256", "--disable-log-stats"],
            logs,
            "broken",
            env={"PDFLEET_FAULT_BREAK_ON_TOKEN": str(BREAK)},
        ),
        "producer": ServerProcess(
            [
                "serve",
                tiny_model,
                "--max-model-len",
                "256",
                "--block-size",
                str(BLOCK),
                "--disable-log-stats",
                "--kv-transfer-config",
                json.dumps(producer),
            ],
            logs,
            "producer",
        ),
    }
    try:
        yield procs
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def server(engines):
    return engines["server"].wait_healthy()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def sse_events(http: httpx.Client, body: dict, headers: dict | None = None) -> list[str]:
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def assert_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- admissibility ------------------------------------------------------------------------


def repro_bodies(vocab: int) -> list[tuple[dict, str]]:
    return [
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [vocab]}, "stop"),
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [vocab * 9]}, "stop"),
        ({"prompt": "hi", "top_k": 2**63, "temperature": 1}, "top_k"),
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [2**70]}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop"),
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "n": 10**6}, "n"),
        ({"prompt": "hi", "max_tokens": 5, "min_tokens": 10}, "min_tokens"),
        ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 2**40}, "logprobs"),
        ({"prompt": "hi", "priority": 2**64}, "priority"),
        ({"prompt": [1, 2, vocab]}, "prompt"),
        ({"prompt": "hi", "best_of": 2, "n": 3}, "best_of"),
    ]


@pytest.mark.parametrize("case", range(13))
@pytest.mark.parametrize("stream", [False, True])
def test_inadmissible_sampling_is_a_400_naming_the_field(http, vocab_size, case, stream):
    body, field = repro_bodies(vocab_size)[case]
    r = http.post("/v1/completions", json={**body, "stream": stream})
    # A 400 before any response starts, streamed or not: never an SSE error event.
    assert r.status_code == 400, r.text
    param = r.json()["error"]["param"] or ""
    assert param.startswith(field), r.text
    assert http.get("/health").status_code == 200


def test_chat_logprobs_bound_is_a_400(http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2**40,
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_in_range_extremes_are_served(http, vocab_size):
    # top_k beyond the vocabulary means "no top-k"; the last token id is a valid stop id.
    for body in (
        {"prompt": "hi", "max_tokens": 4, "top_k": 10**6, "temperature": 1, "seed": 2**63 - 1},
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [vocab_size - 1]},
        {"prompt": "hi", "max_tokens": 4, "n": 2, "seed": 2**63 - 1, "temperature": 1},
    ):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert_serving(http)


def test_forged_kv_transfer_params_are_a_400_streamed_or_not(http, server):
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_request_id": "x"}
    for stream in (False, True):
        r = http.post(
            "/v1/completions",
            json={
                "prompt": "hi " * 40,
                "max_tokens": 2,
                "stream": stream,
                "kv_transfer_params": params,
            },
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("kv_transfer_params")
    assert scrape(server.url)["pdfleet_engine_kv_cache_usage_ratio"] == 0
    assert_serving(http)


# -- a failing step ---------------------------------------------------------------------------


def test_exception_in_the_model_fails_its_request_and_the_engine_serves_on(http, server):
    before = scrape(server.url).get("pdfleet_engine_failed_steps_total", 0)
    r = http.post("/v1/completions", json={"prompt": [10, 11, FAULT, 12], "max_tokens": 4})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "InternalServerError"
    for secret in ("Traceback", "RuntimeError", "injected", "File "):
        assert secret not in error["message"]
    events = sse_events(http, {"prompt": [FAULT, 10], "max_tokens": 4})
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == 500
    assert scrape(server.url)["pdfleet_engine_failed_steps_total"] >= before + 2
    assert wait_until(lambda: scrape(server.url)["pdfleet_engine_kv_cache_usage_ratio"] == 0, 10)
    assert_serving(http)


def test_blocks_of_a_failed_step_are_never_served_from_the_prefix_cache(http):
    prefix = [100 + i for i in range(3 * BLOCK)]  # three full blocks, published when allocated
    failed = http.post("/v1/completions", json={"prompt": [*prefix, FAULT], "max_tokens": 2})
    assert failed.status_code == 500
    body = {"prompt": [*prefix, 7], "max_tokens": 6, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()
    # The failed step never wrote those blocks: nothing may be reused from it.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = http.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_broken_engine_exits_nonzero_instead_of_staying_up_unhealthy(engines):
    proc = engines["broken"]
    try:
        proc.wait_healthy()
        with httpx.Client(base_url=proc.url, headers=proc.headers, timeout=30) as c:
            ok = c.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 2})
            assert ok.status_code == 200
            r = c.post("/v1/completions", json={"prompt": [10, BREAK], "max_tokens": 2})
            assert r.status_code == 500
        deadline = time.monotonic() + 30
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.proc.returncode == 1, proc.log()
        assert "probe steps after a failure" in proc.log()
    finally:
        proc.stop()


# -- request ids ---------------------------------------------------------------------------


def test_duplicate_client_request_id_while_streaming_both_complete(server):
    async def main():
        async with httpx.AsyncClient(
            base_url=server.url, headers={**server.headers, "x-request-id": "dup"}, timeout=60
        ) as c:
            body = {"prompt": "a story", "max_tokens": 40, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as first:
                lines = first.aiter_lines()
                got = [await anext(lines)]  # the first is streaming now
                second = await c.post(
                    "/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True}
                )
                got += [line async for line in lines]
            return first, [g for g in got if g], second

    first, events, second = asyncio.run(main())
    assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 3
    assert second.headers["x-request-id"] == "dup"
    assert first.headers["x-request-id"] == "dup"
    assert events[-1] == "data: [DONE]"
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length"


@pytest.mark.parametrize("n2_first", [True, False])
def test_n2_request_id_c_and_request_id_c0_both_complete(server, n2_first):
    async def one(c: httpx.AsyncClient, rid: str, n: int, delay: float) -> httpx.Response:
        await asyncio.sleep(delay)
        body = {"prompt": "tell me", "max_tokens": 12, "ignore_eos": True, "n": n}
        return await c.post("/v1/completions", json=body, headers={"x-request-id": rid})

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as c:
            return await asyncio.gather(
                one(c, "c", 2, 0.0 if n2_first else 0.05),
                one(c, "c-0", 1, 0.05 if n2_first else 0.0),
            )

    pair, single = asyncio.run(asyncio.wait_for(main(), 60))
    assert pair.status_code == 200 and single.status_code == 200
    assert sorted(ch["index"] for ch in pair.json()["choices"]) == [0, 1]
    assert pair.json()["usage"]["completion_tokens"] == 24
    assert single.json()["usage"]["completion_tokens"] == 12


# -- shutdown ----------------------------------------------------------------------------------


def test_sigterm_on_a_producer_waits_for_its_held_leases_then_exits_zero(engines):
    lease = LEASE
    proc = engines["producer"]
    try:
        proc.wait_healthy()
        body = {
            "prompt": [100 + i for i in range(3 * BLOCK)],
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        # The lease starts while the request runs, after this instant: it cannot
        # expire before `sent + lease` (the response may come back much later).
        sent = time.monotonic()
        r = httpx.post(proc.url + "/v1/completions", json=body, headers=proc.headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["remote_block_ids"]
        # No decode leg ever claims the blocks: the producer holds them for the lease.
        proc.signal()
        deadline = time.monotonic() + lease + 20
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        exited = time.monotonic()
        assert proc.proc.returncode == 0, proc.log()
        assert exited - sent >= lease, (
            f"exited {exited - sent:.2f}s after the request: a lease held"
        )
    finally:
        proc.stop()
