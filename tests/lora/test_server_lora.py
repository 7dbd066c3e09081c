"""A real `pdfleet serve --enable-lora` process: adapters named by `model`,
listed by /v1/models, loaded and unloaded at run time behind the fleet token,
bad adapters refused by name while the engine keeps serving, and the metrics."""

from __future__ import annotations

import httpx
import pytest
from helpers.engine import hf_greedy, random_prompts
from helpers.server import ServerProcess, fleet_headers, scrape

PROMPT = random_prompts(1800, [13], seed=11)[0]


@pytest.fixture(scope="module")
def setup(tiny_model, adapter_factory, tmp_path_factory):
    a = adapter_factory(tiny_model, 1, r=8)
    tmp = tmp_path_factory.mktemp("lora-server")
    keys = tmp / "keys"
    keys.write_text("client-key\n")
    proc = ServerProcess(
        [
            "serve",
            tiny_model,
            "--max-model-len",
            "256",
            "--served-model-name",
            "tiny",
            "--disable-log-stats",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a={a}",
            "--api-key-file",
            str(keys),
        ],
        tmp,
        env={"PDFLEET_API_KEY": ""},
    )
    try:
        yield proc.wait_healthy(), a
    finally:
        proc.stop()


def complete(url: str, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_adapters_are_listed_served_loaded_and_unloaded(
    setup, tiny_model, adapter_factory, peft_factory
):
    server, a = setup
    fleet = fleet_headers()
    client = {"Authorization": "Bearer client-key"}
    models = httpx.get(server.url + "/v1/models", headers=client, timeout=10).json()["data"]
    cards = {c["id"]: c for c in models}
    assert set(cards) == {"tiny", "a"}
    assert cards["a"]["parent"] == "tiny" and cards["a"]["root"] == a
    assert cards["a"]["lora_identity"].startswith("a@")
    assert cards["tiny"]["parent"] is None

    # A client key may use an adapter, and gets what peft computes.
    assert tokens(complete(server.url, "a", client)) == hf_greedy(
        peft_factory(tiny_model, a), PROMPT, 8
    )
    assert tokens(complete(server.url, "tiny", client)) == hf_greedy(
        peft_factory(tiny_model, None), PROMPT, 8
    )

    b = adapter_factory(tiny_model, 2, r=8)
    load = {"lora_name": "b", "lora_path": b}
    url = server.url + "/v1/load_lora_adapter"
    refused = httpx.post(url, json=load, headers=client, timeout=30)
    assert refused.status_code == 403 and "fleet token" in refused.text
    loaded = httpx.post(url, json=load, headers=fleet, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert tokens(complete(server.url, "b", client)) == hf_greedy(
        peft_factory(tiny_model, b), PROMPT, 8
    )

    # Bad adapters: a 400 naming the adapter and what is wrong; nothing changes.
    big = adapter_factory(tiny_model, 4, r=16)
    bad = httpx.post(url, json={"lora_name": "big", "lora_path": big}, headers=fleet, timeout=30)
    assert bad.status_code == 400
    assert "'big'" in bad.json()["error"]["message"] and "--max-lora-rank" in bad.text
    missing = httpx.post(
        url, json={"lora_name": "gone", "lora_path": "/nonexistent"}, headers=fleet, timeout=30
    )
    assert missing.status_code == 400 and "'gone'" in missing.text
    dup = httpx.post(url, json=load, headers=fleet, timeout=30)
    assert dup.status_code == 400 and "already loaded" in dup.text
    unknown = httpx.post(url, json={**load, "x": 1}, headers=fleet, timeout=30)
    assert unknown.status_code == 400 and "x: unknown field" in unknown.text
    assert tokens(complete(server.url, "a", client))  # still serving

    unload = server.url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "b"}, headers=client).status_code == 403
    assert httpx.post(unload, json={"lora_name": "b"}, headers=fleet).status_code == 200
    assert complete(server.url, "b", client).status_code == 404
    assert httpx.post(unload, json={"lora_name": "b"}, headers=fleet).status_code == 404
    ids = {c["id"] for c in httpx.get(server.url + "/v1/models", headers=client).json()["data"]}
    assert ids == {"tiny", "a"}

    samples = scrape(server.url)
    assert samples["pdfleet_engine_lora_adapters"] == 1
    assert samples["pdfleet_engine_lora_loads_total"] >= 2
    assert samples["pdfleet_engine_lora_requests_total"] >= 3
    text = httpx.get(server.url + "/metrics", headers=fleet, timeout=10).text
    assert 'pdfleet_engine_lora_requests_total{lora_name="a",model_name="tiny"} 2.0' in text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
