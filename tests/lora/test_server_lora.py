"""Real `pdfleet serve --enable-lora` processes: adapters named by `model`,
listed by /v1/models, loaded and unloaded at run time behind the fleet token,
bad adapters refused by name while the engine keeps serving, the metrics; a
gateway in front of two of them that routes an adapter to the engine that
serves it; and the P/D split between the same two (a ZMQ producer and
consumer): both legs run the adapter, and KV computed under the adapter is
never used for a base-model decode leg."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import httpx
import openai
import pytest
from helpers.engine import hf_greedy, random_prompts
from helpers.fake_hub import FakeHub
from helpers.fleet import metric, start_gateway
from helpers.server import ServerProcess, fleet_headers, free_port, scrape, wait_until

from pdfleet.engine.contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.contracts.lora import name_taken
from pdfleet.engine.gateway.prompt import PromptAnalyzer

PROMPT = random_prompts(1800, [13], seed=11)[0]


def kv(role: str) -> list[str]:
    cfg: dict = {"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": free_port()}
    if role == "kv_producer":
        # The lease the base-model decode leg refuses expires soon: a stop waits for it.
        cfg["kv_connector_extra_config"] = {"lease_seconds": 3}
    return ["--kv-transfer-config", json.dumps(cfg)]


def engine(tiny_model, tmp, name, *flags, env=None):
    return ServerProcess(
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
            "--api-key-file",
            str(tmp / "keys"),
            *flags,
        ],
        tmp,
        name,
        env={"PDFLEET_API_KEY": "", "OMP_NUM_THREADS": "1", **(env or {})},
    )


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_TOKEN = "hf_engine_token"


@pytest.fixture(scope="module")
def hub(tiny_model, adapter_factory):
    """A fake Hub serving adapter c as acme/c-lora (token required)."""
    c = adapter_factory(tiny_model, 3, r=8)
    with FakeHub("acme/c-lora", c, HUB_COMMIT, token=HUB_TOKEN, branches=("main", "v1")) as h:
        yield h, c


@pytest.fixture(scope="module")
def fleet(tiny_model, adapter_factory, tmp_path_factory, hub):
    """Engine A serves adapter a from the start, engine B none (and has one
    device slot); B reaches the fake Hub as a pod's engine does (endpoint, token file, cache directory)."""
    a = adapter_factory(tiny_model, 1, r=8)
    tmp = tmp_path_factory.mktemp("lora-server")
    (tmp / "keys").write_text("client-key\n")
    (tmp / "hf-token").write_text(HUB_TOKEN + "\n")
    hub_env = {
        "HF_ENDPOINT": hub[0].url,
        "HF_TOKEN_PATH": str(tmp / "hf-token"),
        "HF_TOKEN": "",
        "HF_HUB_CACHE": str(tmp / "hf-cache"),
    }
    procs = [
        # vLLM's JSON form of --lora-modules (engine B's test covers name=path).
        engine(
            tiny_model,
            tmp,
            "a",
            "--lora-modules",
            json.dumps({"name": "a", "path": a, "base_model_name": "tiny"}),
            *kv("kv_producer"),
        ),
        # One device slot, two host copies: a second adapter evicts the first
        # from the device, not from host memory.
        engine(
            tiny_model,
            tmp,
            "b",
            "--max-loras",
            "1",
            "--max-cpu-loras",
            "2",
            *kv("kv_consumer"),
            env=hub_env,
        ),
    ]
    gateway = None
    try:
        for p in procs:
            p.wait_healthy()
        gateway = start_gateway(
            ["--decode", procs[0].url, "--decode", procs[1].url, "--scrape-interval", "0.2"], tmp
        )
        yield procs, gateway, a
    finally:
        for p in [*procs, *([gateway] if gateway else [])]:
            p.stop()


@pytest.fixture(scope="module")
def setup(fleet):
    procs, _, a = fleet
    return procs[0], a


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
    setup, tiny_model, adapter_factory, peft_factory, tmp_path
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
    want_a = hf_greedy(peft_factory(tiny_model, a), PROMPT, 8)
    assert tokens(complete(server.url, "a", client)) == want_a
    # The official client: the adapter is a model it lists and can name.
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="client-key", max_retries=0)
    assert {"tiny", "a"} <= {m.id for m in oai.models.list()}
    done = oai.completions.create(
        model="a",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert done.model == "a" and done.choices[0].model_extra["token_ids"] == want_a
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
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
    # A name that cannot be served is the name's fault (param lora_name), and
    # never reads as "already loaded".
    for name in ("tiny", "-bad"):
        r = httpx.post(url, json={"lora_name": name, "lora_path": a}, headers=fleet, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
        assert not name_taken(r.status_code, r.content)
    # Loaded again, from the same weights or other ones: vLLM's 400 naming
    # lora_name; the message says which (the gateway then reads the card).
    dup = httpx.post(url, json=load, headers=fleet, timeout=30)
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name"
    assert "'b' has already been loaded (from the same weights)" in dup.text
    assert name_taken(dup.status_code, dup.content)
    taken = httpx.post(url, json={**load, "lora_path": a}, headers=fleet, timeout=30)
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    assert "'b' has already been loaded (with other weights; unload it first)" in taken.text
    unknown = httpx.post(url, json={**load, "x": 1}, headers=fleet, timeout=30)
    assert unknown.status_code == 400 and "x: unknown field" in unknown.text
    assert tokens(complete(server.url, "a", client))  # still serving

    unload = server.url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "b"}, headers=client).status_code == 403
    # vLLM's body: lora_int_id as /v1/models reports it, else refused naming
    # it (and nothing unloaded); a lora_path is refused, not ignored.
    card = httpx.get(server.url + "/v1/models/b", headers=client).json()
    int_id = card["lora_int_id"]
    for body, param in (
        ({"lora_name": "b", "lora_int_id": int_id + 1000}, "lora_int_id"),
        ({"lora_name": "b", "lora_int_id": "x"}, "lora_int_id"),
        ({"lora_name": "b", "lora_path": "/nonexistent/other"}, "lora_path"),
    ):
        refused = httpx.post(unload, json=body, headers=fleet)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    body = {"lora_name": "b", "lora_int_id": int_id}
    assert httpx.post(unload, json=body, headers=fleet).status_code == 200
    assert complete(server.url, "b", client).status_code == 404
    assert httpx.post(unload, json={"lora_name": "b"}, headers=fleet).status_code == 404
    ids = {c["id"] for c in httpx.get(server.url + "/v1/models", headers=client).json()["data"]}
    assert ids == {"tiny", "a"}

    samples = scrape(server.url)
    assert samples["pdfleet_engine_lora_adapters"] == 1
    assert samples["pdfleet_engine_lora_loads_total"] >= 2
    assert samples["pdfleet_engine_lora_requests_total"] >= 4
    text = httpx.get(server.url + "/metrics", headers=fleet, timeout=10).text
    assert 'pdfleet_engine_lora_requests_total{lora_name="a",model_name="tiny"} 3.0' in text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]

    # An adapter whose host copy was evicted, then its directory deleted:
    # its request fails naming it (a 502; a stream ends with an error event),
    # the engine unloads it and serves the others on.
    h = shutil.copytree(a, tmp_path / "h")
    for name, path in (("h", h), ("x1", a), ("x2", a)):  # two host copies: h goes
        body = {"lora_name": name, "lora_path": str(path)}
        assert httpx.post(url, json=body, headers=fleet, timeout=30).status_code == 200
    for name in ("x1", "x2"):
        assert httpx.post(unload, json={"lora_name": name}, headers=fleet).status_code == 200
    shutil.rmtree(h)
    body = {"model": "h", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=client, timeout=60
    ) as streamed:
        assert streamed.status_code == 200  # the stream had started
        text = "".join(streamed.iter_text())
    assert text.startswith('data: {"error":') and '"code":502' in text, text
    assert "'h'" in text and "is not a directory" in text
    assert complete(server.url, "h", client).status_code == 404  # unloaded
    ids = {c["id"] for c in httpx.get(server.url + "/v1/models", headers=client).json()["data"]}
    assert ids == {"tiny", "a"}
    assert tokens(complete(server.url, "a", client)) == want_a


def test_an_hf_adapter_is_fetched_when_it_is_loaded_and_a_failed_fetch_is_refused_by_name(
    fleet, hub, tiny_model, peft_factory
):
    (_, server), _, _ = fleet
    fake, c = hub
    fleet_h = fleet_headers()
    url = server.url + "/v1/load_lora_adapter"
    body = {"lora_name": "c", "lora_path": "hf://acme/c-lora", "revision": "v1"}

    async def twice() -> list[httpx.Response]:
        # A caller asking again while the download runs joins it (one fetch).
        async with httpx.AsyncClient(headers=fleet_h, timeout=120) as http:
            return await asyncio.gather(*(http.post(url, json=body) for _ in range(2)))

    for loaded in asyncio.run(twice()):
        assert loaded.status_code == 200, loaded.text
    assert tokens(complete(server.url, "c", fleet_h)) == hf_greedy(
        peft_factory(tiny_model, c), PROMPT, 8
    )
    card = httpx.get(server.url + "/v1/models/c", headers=fleet_h, timeout=10).json()
    assert card["source"] == "hf://acme/c-lora" and card["revision"] == "v1"
    assert card["root"].endswith(f"models--acme--c-lora/snapshots/{HUB_COMMIT}")
    assert sorted(p.rsplit("/", 1)[-1] for p in fake.downloads()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    # Failed fetches: a 400 naming the adapter and the Hub's reason; nothing changes.
    for name, source, revision, reason in [
        ("gone", "hf://acme/no-such-lora", None, "repository not found"),
        ("old", "hf://acme/c-lora", "v9", "revision 'v9' does not exist"),
    ]:
        body = {
            "lora_name": name,
            "lora_path": source,
            **({"revision": revision} if revision else {}),
        }
        refused = httpx.post(url, json=body, headers=fleet_h, timeout=120)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert f"LoRA adapter {name!r}" in message and reason in message, message
    bad = {"lora_name": "x", "lora_path": "/some/dir", "revision": "v1"}
    refused = httpx.post(url, json=bad, headers=fleet_h, timeout=30)
    assert refused.status_code == 400 and "revision" in refused.text
    ids = {c["id"] for c in httpx.get(server.url + "/v1/models", headers=fleet_h).json()["data"]}
    assert "c" in ids and not ids & {"gone", "old", "x"}
    assert tokens(complete(server.url, "tiny", fleet_h))  # still serving

    unload = server.url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "c"}, headers=fleet_h).status_code == 200
    assert complete(server.url, "c", fleet_h).status_code == 404


def test_the_gateway_routes_an_adapter_to_the_engine_that_serves_it(
    fleet, tiny_model, peft_factory
):
    (a_engine, b_engine), gateway, a = fleet
    fleet_h = fleet_headers()

    def listed() -> set[str]:
        r = httpx.get(gateway.url + "/v1/models", headers=fleet_h, timeout=10)
        return {c["id"] for c in r.json()["data"]} if r.status_code == 200 else set()

    assert wait_until(lambda: "a" in listed(), timeout=30)
    before_a = metric(a_engine.url, "pdfleet_engine_lora_requests_total", lora_name="a")
    want = hf_greedy(peft_factory(tiny_model, a), PROMPT, 8)
    for _ in range(4):
        assert tokens(complete(gateway.url, "a", fleet_h)) == want
    assert metric(a_engine.url, "pdfleet_engine_lora_requests_total", lora_name="a") == before_a + 4
    assert metric(b_engine.url, "pdfleet_engine_lora_requests_total", lora_name="a") == 0
    # A name no engine serves is the gateway's own 404.
    assert complete(gateway.url, "nope", fleet_h).status_code == 404


def test_the_gateway_prefers_the_engine_where_the_adapter_is_on_the_device(
    fleet, tiny_model, adapter_factory
):
    (a_engine, b_engine), gateway, _ = fleet
    fleet_h = fleet_headers()
    paths = {"x": adapter_factory(tiny_model, 1, r=8), "y": adapter_factory(tiny_model, 3, r=8)}
    engines = (a_engine, b_engine)
    try:
        # Both engines serve both adapters: registration alone says nothing.
        for e in engines:
            for name, path in paths.items():
                load = {"lora_name": name, "lora_path": path}
                r = httpx.post(
                    e.url + "/v1/load_lora_adapter", json=load, headers=fleet_h, timeout=30
                )
                assert r.status_code == 200, r.text
        # B (one device slot): x, then y, which evicts x from the device to
        # host memory; A runs x (two slots, y never ran there).
        tokens(complete(b_engine.url, "x", fleet_h))
        tokens(complete(b_engine.url, "y", fleet_h))
        tokens(complete(a_engine.url, "x", fleet_h))

        def view() -> dict[str, dict[str, str]]:
            r = httpx.get(gateway.url + "/engines", headers=fleet_h, timeout=10)
            return {e["url"]: e["adapters"] for e in r.json()["engines"]}

        want = {a_engine.url: ("device", "host"), b_engine.url: ("host", "device")}
        assert wait_until(
            lambda: {u: (v.get("x"), v.get("y")) for u, v in view().items()} == want, timeout=30
        ), view()

        def counts(name: str) -> list[float]:
            return [
                metric(e.url, "pdfleet_engine_lora_requests_total", lora_name=name) for e in engines
            ]

        before_x, before_y = counts("x"), counts("y")
        for _ in range(3):
            tokens(complete(gateway.url, "x", fleet_h))
            tokens(complete(gateway.url, "y", fleet_h))
        # Each to the engine where it is on the device, none to the other.
        assert counts("x") == [before_x[0] + 3, before_x[1]]
        assert counts("y") == [before_y[0], before_y[1] + 3]
    finally:
        for e in engines:
            for name in paths:
                httpx.post(
                    e.url + "/v1/unload_lora_adapter",
                    json={"lora_name": name},
                    headers=fleet_h,
                    timeout=30,
                )


def test_exact_prefix_keys_are_the_engines_per_adapter():
    analyzer = PromptAnalyzer(None, max_blocks=8, exact=True)
    analyzer.lora_identity = {"a": "a@0123456789abcdef"}.get
    ids = list(range(100, 164))
    base = analyzer.analyze({"model": "tiny", "prompt": ids}, False, 16)
    lora = analyzer.analyze({"model": "a", "prompt": ids}, False, 16)
    assert lora.adapter == "a" and base.adapter is None
    want = prompt_block_hashes(ids, 16, get_hash_fn("sha256"), 8, None, "a@0123456789abcdef")
    assert lora.exact_hashes == [external_block_hash(d) for d in want]
    assert not set(lora.exact_hashes or []) & set(base.exact_hashes or [])
    assert not set(lora.block_hashes) & set(base.block_hashes)


PD_PROMPT = [(7 * 131 + i * 17) % 1700 + 20 for i in range(70)]


def prefill(url: str, model: str) -> dict:
    body = {
        "model": model,
        "prompt": PD_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    r = httpx.post(url + "/v1/completions", json=body, headers=fleet_headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(url: str, model: str, params: dict) -> list[int]:
    body = {
        "model": model,
        "prompt": PD_PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    r = httpx.post(url + "/v1/completions", json=body, headers=fleet_headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_pd_both_legs_run_the_adapter_and_other_kv_is_never_used(fleet, tiny_model, peft_factory):
    (producer, consumer), _, a = fleet
    p_url, d_url = producer.url, consumer.url
    load = {"lora_name": "a", "lora_path": a}
    r = httpx.post(d_url + "/v1/load_lora_adapter", json=load, headers=fleet_headers())
    assert r.status_code == 200, r.text
    params = prefill(p_url, "a")
    assert len(params["remote_block_ids"]) == 4
    pulled = scrape(d_url).get("pdfleet_engine_kv_transfer_blocks_pulled_total", 0)
    assert decode(d_url, "a", params) == hf_greedy(peft_factory(tiny_model, a), PD_PROMPT, 8)
    assert scrape(d_url)["pdfleet_engine_kv_transfer_blocks_pulled_total"] >= pulled + 4

    # The adapter's KV offered to a base-model decode leg: its block chain does
    # not match the base model's, so the decode engine refuses it and computes
    # the prompt itself; the answer is the base model's.
    params = prefill(p_url, "a")
    before = scrape(d_url).get("pdfleet_engine_kv_transfer_blocks_pulled_total", 0)
    got = decode(d_url, "tiny", params)
    assert got == hf_greedy(peft_factory(tiny_model, None), PD_PROMPT, 8)
    assert scrape(d_url)["pdfleet_engine_kv_transfer_blocks_pulled_total"] == before


def test_a_bad_lora_module_at_start_is_one_error_line_and_exit_2(
    tiny_model, adapter_factory, tmp_path
):
    big = adapter_factory(tiny_model, 4, r=16)
    done = subprocess.run(
        [
            *python_module("pdfleet.engine.cli"),
            "serve",
            tiny_model,
            "--max-model-len",
            "64",
            "--port",
            str(free_port()),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"big={big}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDFLEET_API_KEY": "", "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "pdfleet serve: error: --lora-modules: LoRA adapter 'big': rank 16" in done.stderr, (
        done.stderr[-3000:]
    )
