"""Requests that need the prompt's logprobs are served correctly in P/D: through
the gateway in every disaggregation mode (they run on one engine), and on a
decode engine handed a prefill's KV params (it computes the whole prompt and
releases the lease). Never a 5xx. Over NIXL and over ZMQ."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from helpers.fleet import ENGINE_ARGS, kv_transfer_args, metric, start_gateway
from helpers.server import ServerProcess, fleet_headers, wait_until

PROMPT = "The harbor was quiet before dawn. Boats rocked against the pier. " * 4
BODY = {
    "model": "tiny",
    "prompt": PROMPT,
    "max_tokens": 4,
    "temperature": 0,
    "echo": True,
    "logprobs": 2,
}


@pytest.fixture(scope="module", params=["NixlConnector", "ZmqConnector"])
def fleet(request, tiny_model, tmp_path_factory):
    """A prefill and a decode engine joined by the connector, and an `Always` gateway."""
    connector = request.param
    logs = tmp_path_factory.mktemp(f"pd-logprobs-{connector}")
    procs = [
        ServerProcess(
            ["serve", tiny_model, *ENGINE_ARGS, *kv_transfer_args(connector, role)], logs, name
        )
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    gateway = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.wait_healthy(180), procs))
        prefill, decode = procs
        gateway = start_gateway(
            ["--prefill", prefill.url, "--decode", decode.url, "--disaggregation-mode", "Always"],
            logs,
        )
        yield prefill, decode, gateway
    finally:
        for p in [*procs, *([gateway] if gateway else [])]:
            p.stop()


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def reference(decode: ServerProcess) -> dict:
    """The answer of one engine computing the whole request (no KV params)."""
    resp = post(decode.url, BODY, fleet_headers())
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def same_answer(choice: dict, ref: dict) -> None:
    assert choice["text"] == ref["text"]
    got, want = choice["logprobs"], ref["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"][0] is None  # nothing predicts the first prompt token
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert [list(t or {}) for t in got["top_logprobs"]] == [
        list(t or {}) for t in want["top_logprobs"]
    ]


def test_echo_with_logprobs_through_the_gateway_runs_on_one_engine(fleet):
    _, decode, gateway = fleet
    ref = reference(decode)
    before = metric(gateway.url, "pdfleet_gateway_disagg_decisions_total", reason="prompt_logprobs")
    resp = post(gateway.url, BODY)
    assert resp.status_code == 200, resp.text
    same_answer(resp.json()["choices"][0], ref)
    # vLLM's prompt_logprobs field takes the same route (Always mode: no prefill leg).
    chat = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2,
            "prompt_logprobs": 1,
        },
        timeout=120,
    )
    assert chat.status_code < 500, chat.text
    after = metric(gateway.url, "pdfleet_gateway_disagg_decisions_total", reason="prompt_logprobs")
    assert after == before + 2


def test_a_streamed_echo_with_logprobs_through_the_gateway(fleet):
    _, decode, gateway = fleet
    ref = reference(decode)
    tokens: list[str] = []
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json={**BODY, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert '"error"' not in line, line
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    tokens += (c.get("logprobs") or {}).get("tokens") or []
    assert tokens == ref["logprobs"]["tokens"]


def prefill_leg(prefill: ServerProcess, body: dict) -> dict:
    leg = post(
        prefill.url,
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        fleet_headers(),
    )
    assert leg.status_code == 200, leg.text
    params = leg.json()["kv_transfer_params"]
    assert params["remote_block_ids"], "the prefill engine holds blocks under a lease"
    return params


def test_a_decode_leg_with_kv_params_and_echo_computes_the_prompt_itself(fleet):
    prefill, decode, _ = fleet
    ref = reference(decode)
    # A plain P/D request first: the decode engine pulls, and knows the producer.
    plain = {**BODY, "prompt": "Another prompt entirely. " * 12, "echo": False, "logprobs": None}
    params = prefill_leg(prefill, plain)
    resp = post(decode.url, {**plain, "kv_transfer_params": params}, fleet_headers())
    assert resp.status_code == 200, resp.text
    pulled = "pdfleet_engine_kv_transfer_blocks_pulled_total"
    before = metric(decode.url, pulled)
    assert before > 0

    params = prefill_leg(prefill, BODY)
    resp = post(decode.url, {**BODY, "kv_transfer_params": params}, fleet_headers())
    assert resp.status_code == 200, resp.text
    same_answer(resp.json()["choices"][0], ref)
    # Nothing was pulled for it, and the producer was told to let its blocks go.
    assert metric(decode.url, pulled) == before
    assert wait_until(
        lambda: metric(prefill.url, "pdfleet_engine_kv_transfer_held_requests") == 0, 30
    )
