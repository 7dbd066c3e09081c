"""`pdfleet up` with spec.adapters: both engines of a P/D fleet start with the
adapter, and a request naming it through the gateway gives transformers +
peft's greedy tokens."""

from __future__ import annotations

import httpx
import pytest
from helpers.engine import hf_greedy, random_prompts
from helpers.fleet import metric
from helpers.server import fleet_headers, wait_until
from helpers.up import Up, fleet_spec

PROMPT = random_prompts(1000, [48], seed=5)[0]


@pytest.fixture(scope="module")
def up(tiny_model, adapter_factory, tmp_path_factory):
    adapter = adapter_factory(tiny_model, 3, r=8)
    spec = fleet_spec(
        tiny_model,
        adapters=[{"name": "team/sql", "source": f"file://{adapter}"}],
        disaggregation={"mode": "Conditional", "minPromptTokens": 16},
    )
    spec["spec"]["engine"]["maxLoraRank"] = 8
    fleet = Up(spec, tmp_path_factory.mktemp("up-lora"), "lora")
    try:
        yield fleet.wait_ready(), adapter
    finally:
        fleet.stop()


def test_up_starts_both_roles_with_the_adapters_and_serves_them(up, tiny_model, peft_factory):
    fleet, adapter = up
    headers = fleet_headers()
    engines = {e["role"]: e["url"] for e in fleet.engines()}
    assert set(engines) == {"prefill", "decode"}
    for url in engines.values():
        cards = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"]
        served = {c["id"]: c["root"] for c in cards if c.get("parent")}
        assert served == {"team/sql": adapter}

    def listed() -> set[str]:
        r = httpx.get(fleet.url + "/v1/models", headers=headers, timeout=10)
        return {c["id"] for c in r.json()["data"]} if r.status_code == 200 else set()

    if not wait_until(lambda: "team/sql" in listed(), timeout=30):
        r = httpx.get(fleet.url + "/v1/models", headers=headers, timeout=10)
        raise AssertionError(f"{r.status_code} {r.text}\n{fleet.output()[-3000:]}")
    body = {
        "model": "team/sql",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(fleet.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "team/sql"
    got = r.json()["choices"][0]["token_ids"]
    assert got == hf_greedy(peft_factory(tiny_model, adapter), PROMPT, 8)
    assert got != hf_greedy(peft_factory(tiny_model, None), PROMPT, 8)
    # Split into a prefill leg and a decode leg, each under the adapter.
    for role, url in engines.items():
        count = metric(url, "pdfleet_engine_lora_requests_total", lora_name="team/sql")
        assert count == 1, role
