"""`pdfleet up` with spec.adapters: both engines of a P/D fleet start with the
adapter, and a request naming it through the gateway gives transformers +
peft's greedy tokens; `pdfleet apply` of a file whose adapters changed loads
and unloads them on the running engines, restarting none."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import httpx
import pytest
import yaml
from helpers.engine import hf_greedy, random_prompts
from helpers.fleet import metric
from helpers.server import fleet_headers, wait_until
from helpers.up import Up, fleet_spec, process_argv

from pdfleet.engine.contracts.launch import python_module
from pdfleet.operator.local.fleet import LocalFleet
from pdfleet.operator.resource import InferenceService, load_inference_service

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
        yield fleet.wait_ready(), adapter, spec
    finally:
        fleet.stop()


def test_up_starts_both_roles_with_the_adapters_and_serves_them(up, tiny_model, peft_factory):
    fleet, adapter, _ = up
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


def served(fleet: Up) -> dict[str, dict[str, str]]:
    """Engine role -> {adapter: directory} it serves."""
    out = {}
    for e in fleet.engines():
        r = httpx.get(e["url"] + "/v1/models", headers=fleet_headers(), timeout=10)
        out[e["role"]] = {c["id"]: c["root"] for c in r.json()["data"] if c.get("parent")}
    return out


def test_apply_loads_and_unloads_adapters_without_restarts(
    up, tiny_model, adapter_factory, peft_factory, tmp_path
):
    fleet, adapter, spec = up
    engines = sorted(p for p in fleet.child_pids() if "serve" in process_argv(p))
    other = adapter_factory(tiny_model, 7, r=8)
    run_dir = ["--run-dir", str(fleet.run_dir), "--timeout", "120"]

    def apply(adapters: list[dict], ok: bool = True) -> str:
        changed = copy.deepcopy(spec)
        changed["spec"]["adapters"] = adapters
        path = tmp_path / f"apply-{'-'.join(a['name'].replace('/', '_') for a in adapters)}.yaml"
        path.write_text(yaml.safe_dump(changed))
        done = subprocess.run(
            [*python_module("pdfleet.engine.cli"), "apply", str(path), *run_dir],
            capture_output=True,
            text=True,
            timeout=180,
        )
        out = done.stdout + done.stderr
        assert (done.returncode == 0) == ok, out + fleet.output()[-3000:]
        return out

    both = [
        {"name": "team/sql", "source": f"file://{adapter}"},
        {"name": "other", "source": f"file://{other}"},
    ]
    apply(both)
    assert served(fleet) == {
        r: {"team/sql": adapter, "other": other} for r in ("prefill", "decode")
    }
    body = {
        "model": "other",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    assert wait_until(
        lambda: (
            httpx.post(
                fleet.url + "/v1/completions", json=body, headers=fleet_headers(), timeout=120
            ).status_code
            == 200
        ),
        timeout=30,
    )
    r = httpx.post(fleet.url + "/v1/completions", json=body, headers=fleet_headers(), timeout=120)
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(
        peft_factory(tiny_model, other), PROMPT, 8
    )
    apply(both[1:])  # team/sql removed
    assert served(fleet) == {r: {"other": other} for r in ("prefill", "decode")}
    assert sorted(p for p in fleet.child_pids() if "serve" in process_argv(p)) == engines

    # An added adapter above the engines' maxLoraRank refuses the file before
    # any engine is touched.
    big = adapter_factory(tiny_model, 4, r=16)
    out = apply([{"name": "big", "source": f"file://{big}"}], ok=False)
    assert "rank 16 exceeds the decode engines' maxLoraRank 8" in out
    assert served(fleet) == {r: {"other": other} for r in ("prefill", "decode")}
    # One the engines refuse at the load (its tensors outside its config's
    # target_modules): what the apply loaded and unloaded is rolled back, every
    # role serves what it did, and the failed file is not recorded.
    good = adapter_factory(tiny_model, 8, r=8)
    bad = shutil.copytree(good, tmp_path / "bad")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    out = apply(
        [{"name": "good", "source": f"file://{good}"}, {"name": "bad", "source": f"file://{bad}"}],
        ok=False,
    )
    assert "load of adapter 'bad' failed" in out and "rolled back the 1 adapter change" in out
    assert served(fleet) == {r: {"other": other} for r in ("prefill", "decode")}
    assert "no change" in apply(both[1:])


def test_an_engine_restarted_after_apply_starts_with_the_current_adapters(tmp_path):
    """The restart itself is `LocalFleet.tick` re-running the child's command
    line (its process is gone here), so no engine process is needed."""

    def service(adapters: list[dict]) -> InferenceService:
        body = {"apiVersion": "pdfleet.dev/v1alpha1", "kind": "InferenceService"}
        spec = {"model": {"name": "tiny"}, "disaggregation": {"mode": "Disabled"}}
        return load_inference_service(
            {**body, "metadata": {"name": "lora"}, "spec": {**spec, "adapters": adapters}}
        )

    first = [{"name": "a", "source": "file:///lora/a"}, {"name": "b", "source": "file:///lora/b"}]
    fleet = LocalFleet(
        service(first), "/m", tmp_path, adapter_paths={"a": "/lora/a", "b": "/lora/b"}
    )
    child = fleet._engine_child("decode")
    original = list(child.argv)
    i = original.index("--lora-modules")
    assert original[i : i + 3] == ["--lora-modules", "a=/lora/a", "b=/lora/b"]
    started: list[list[str]] = []
    child.start = lambda: started.append(list(child.argv))  # type: ignore[method-assign]
    fleet.engines.append(child)
    # `pdfleet apply`: b removed, c added (loaded on running engines by the API).
    second = [{"name": "a", "source": "file:///lora/a"}, {"name": "c", "source": "file:///lora/c"}]
    fleet.use(service(second), "/m", {"a": "/lora/a", "c": "/lora/c"})
    fleet.tick()  # the engine's process is not running: restarted
    (argv,) = started
    j = argv.index("--lora-modules")
    assert argv[j:] == ["--lora-modules", "a=/lora/a", "c=/lora/c"]
    # Everything else is the command line it first started with.
    assert argv[:j] == original[:i] + original[i + 3 :]
