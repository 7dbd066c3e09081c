"""An hf:// adapter's init container, rendered by the operator and run here
against a local fake Hub: the adapter lands where --lora-modules says, with
only the files the engine reads, through the token Secret's file; `pdfleet up`
refuses what only exists in Kubernetes."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from helpers.fake_hub import FakeHub

from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.lora.adapter import read_adapter_config
from pdfleet.operator.local.cli import resolve_adapters
from pdfleet.operator.manifests import build_children
from pdfleet.operator.resource import parse_spec

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
TOKEN = "hf_adapter_token"


def fetch_step(endpoint: str) -> tuple[dict, list[str]]:
    spec = {
        "model": {
            "name": "tiny",
            "tokenSecret": {"name": "hf"},
            "cache": {"claim": "hf-cache"},
            "hfEndpoint": endpoint,
        },
        "adapters": [{"name": "acme/sql", "source": "hf://acme/sql-lora", "revision": "main"}],
        "disaggregation": {"mode": "Disabled"},
    }
    objects = build_children("demo", parse_spec(spec), namespace="ns")
    pod = next(
        o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-decode"
    )
    (step,) = [c for c in pod["initContainers"] if c["name"].startswith("fetch-adapter-")]
    return step, pod["containers"][0]["command"]


def run_in(container: dict, root) -> subprocess.CompletedProcess:
    """The init container's command with its mounts under ``root``."""
    mounts = {
        m["mountPath"]: str(root / m["mountPath"].strip("/")) for m in container["volumeMounts"]
    }

    def local(value: str) -> str:
        for mount, path in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount or value.startswith(mount + "/"):
                return path + value[len(mount) :]
        return value

    for path in mounts.values():
        os.makedirs(path, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    for item in container["env"]:
        env[item["name"]] = local(item["value"])
    with open(env["HF_TOKEN_PATH"], "w") as f:
        f.write(TOKEN + "\n")
    command = [local(c) for c in container["command"]]
    return subprocess.run(
        [*python_module("pdfleet.engine.cli"), *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_init_container_fetches_the_adapter_where_the_engine_loads_it(
    tiny_model, adapter_factory, tmp_path
):
    repo = tmp_path / "repo"
    shutil.copytree(adapter_factory(tiny_model, 7, r=8), repo)
    (repo / "README.md").write_text("# sql\n")
    (repo / "adapter_model.bin").write_bytes(b"\0" * 64)  # pickled weights: never fetched
    with FakeHub("acme/sql-lora", str(repo), COMMIT, token=TOKEN) as hub:
        step, engine_command = fetch_step(hub.url)
        done = run_in(step, tmp_path / "pod")
        assert done.returncode == 0, done.stderr
        fetched = hub.downloads()
    path = step["command"][step["command"].index("--output") + 1]
    assert f"acme/sql={path}" in engine_command
    local = tmp_path / "pod" / path.strip("/")
    assert os.path.realpath(local).endswith(f"models--acme--sql-lora/snapshots/{COMMIT}")
    assert sorted(os.listdir(local)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not any("README" in p or ".bin" in p for p in fetched)
    assert read_adapter_config("acme/sql", str(local))["r"] == 8


def test_pdfleet_up_takes_file_and_refuses_pvc_adapters_naming_them(tmp_path):
    spec = parse_spec(
        {
            "model": {"name": "tiny"},
            "adapters": [
                {"name": "here", "source": f"file://{tmp_path}"},
                {"name": "there", "source": "pvc://loras/x"},
            ],
        }
    )
    with pytest.raises(
        ValueError, match=r"spec.adapters\[1\].source: .* only exists in Kubernetes"
    ):
        resolve_adapters(spec.adapters, print)
    assert resolve_adapters(spec.adapters[:1], print) == {"here": str(tmp_path)}
    missing = parse_spec(
        {"model": {"name": "tiny"}, "adapters": [{"name": "a", "source": "file:///no/such"}]}
    )
    with pytest.raises(
        ValueError, match=r"spec.adapters\[0\].source: '/no/such' is not a directory"
    ):
        resolve_adapters(missing.adapters, print)


def test_an_engine_side_fetch_is_bounded_and_refused_by_name():
    """The engine's run-time download (lora/hub.py): a bad source never starts
    one; one past its deadline is killed, and both errors name the adapter."""
    import asyncio

    from pdfleet.engine.lora.adapter import LoRAError
    from pdfleet.engine.lora.hub import fetch_hub_adapter

    with pytest.raises(LoRAError, match=r"LoRA adapter 'x': .* an adapter is a Hub repository"):
        asyncio.run(fetch_hub_adapter("x", "hf://org/repo/model.gguf"))
    with pytest.raises(LoRAError, match=r"'y': 'hf://nope': an adapter is a Hub repository") as e:
        asyncio.run(fetch_hub_adapter("y", "hf://nope"))
    assert "GGUF" not in str(e.value)
    with pytest.raises(LoRAError, match=r"LoRA adapter 's': fetching hf://org/slow took longer"):
        asyncio.run(fetch_hub_adapter("s", "hf://org/slow", timeout=0.05))
