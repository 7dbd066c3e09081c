"""``hf://`` model sources: the operator's init container against a local fake Hub.

The init container is rendered by the operator's manifest builder and its
command run here, with its paths moved under a temporary directory: the model
lands at the engine's path, linked to the snapshot of the served commit, with
only the files the engine reads; a second pod on the same cache downloads
nothing; a wrong token, a missing repository and a revision the Hub does not
serve fail with a message.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from helpers.fake_hub import FakeHub

from pdfleet.engine.contracts.launch import python_module
from pdfleet.operator.manifests import build_children
from pdfleet.operator.resource import parse_spec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PINNED = "fedcba9876543210fedcba9876543210fedcba98"
TOKEN = "hf_good_token"


@pytest.fixture(scope="module")
def repo_dir(tiny_model_factory, tmp_path_factory):
    """The tiny model plus files the engine does not need (never downloaded)."""
    directory = tmp_path_factory.mktemp("repo") / "tiny"
    shutil.copytree(tiny_model_factory(), directory)
    (directory / "README.md").write_text("# tiny\n")
    (directory / "pytorch_model.bin").write_bytes(b"\0" * 1024)
    return str(directory)


def init_container(endpoint: str, uri: str = "hf://acme/tiny", **model) -> dict:
    spec = {
        "model": {
            "name": "tiny",
            "uri": uri,
            "revision": "main",
            "tokenSecret": {"name": "hf"},
            "cache": {"claim": "hf-cache"},
            "hfEndpoint": endpoint,
            **model,
        },
        "disaggregation": {"mode": "Disabled"},
    }
    objects = build_children("demo", parse_spec(spec), namespace="ns")
    pod = next(
        o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-decode"
    )
    (container,) = pod["initContainers"]
    return container


def run_in(container: dict, root, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    """Run the init container's command with /models, /hf-cache, /tmp and the
    token mount under ``root`` (the secret's file written there)."""
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
    if token is not None and "HF_TOKEN_PATH" in env:
        with open(env["HF_TOKEN_PATH"], "w") as f:
            f.write(token + "\n")
    command = [local(c) for c in container["command"]]
    assert command[0] == "pdfleet"
    return subprocess.run(
        [*python_module("pdfleet.engine.cli"), *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_init_container_downloads_the_engine_files_of_the_served_commit(repo_dir, tmp_path):
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        container = init_container(hub.url)
        assert container["name"] == "fetch-model"
        done = run_in(container, tmp_path / "pod1")
        assert done.returncode == 0, done.stderr
        model = tmp_path / "pod1" / "models" / "hf"
        assert done.stdout.strip().endswith("/models/hf")
        target = os.path.realpath(model)
        assert target.endswith(f"models--acme--tiny/snapshots/{COMMIT}")
        files = sorted(os.listdir(model))
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
        assert "README.md" not in files and "pytorch_model.bin" not in files
        first = hub.downloads()
        assert first and not any("pytorch_model.bin" in p or "README" in p for p in first)

        # A second pod sharing the cache claim (fresh /models) downloads nothing.
        shutil.copytree(tmp_path / "pod1" / "hf-cache", tmp_path / "pod2" / "hf-cache")
        again = run_in(container, tmp_path / "pod2")
        assert again.returncode == 0, again.stderr
        assert hub.downloads() == first
        assert os.path.realpath(tmp_path / "pod2" / "models" / "hf").endswith(COMMIT)


def test_engine_reads_the_downloaded_model(repo_dir, tmp_path):
    from pdfleet.engine.config import ModelConfig

    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        done = run_in(init_container(hub.url), tmp_path)
    assert done.returncode == 0, done.stderr
    config = ModelConfig.from_model_dir("cpu", model=str(tmp_path / "models" / "hf"))
    assert config.architecture == "LlamaForCausalLM"


def test_wrong_token_fails_with_a_message_naming_the_token(repo_dir, tmp_path):
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        done = run_in(init_container(hub.url), tmp_path, token="hf_wrong")
    assert done.returncode == 2
    assert "refused the token (HTTP 401)" in done.stderr
    assert not os.path.exists(tmp_path / "models" / "hf")


def test_missing_repository_fails_with_a_message(repo_dir, tmp_path):
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        done = run_in(init_container(hub.url, uri="hf://acme/nothing-here"), tmp_path)
    assert done.returncode == 2
    assert "hf://acme/nothing-here" in done.stderr and "repository not found" in done.stderr
    assert "Traceback" not in done.stderr


def test_pinned_commit_the_hub_does_not_serve_is_refused(repo_dir, tmp_path):
    # A mirror that answers for the pinned commit with another snapshot.
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN, branches=("main", PINNED)) as hub:
        done = run_in(init_container(hub.url, revision=PINNED), tmp_path)
        assert hub.downloads() == []
    assert done.returncode == 2
    assert f"revision {PINNED} was asked for" in done.stderr and COMMIT in done.stderr


def test_unknown_revision_fails_with_a_message(repo_dir, tmp_path):
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        done = run_in(init_container(hub.url, revision="v9"), tmp_path)
    assert done.returncode == 2
    assert "revision 'v9' does not exist" in done.stderr


def test_pdfleet_up_resolves_hf_uris_into_the_local_cache(repo_dir, tmp_path, monkeypatch):
    from pdfleet.operator.local.cli import resolve_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    said: list[str] = []
    with FakeHub("acme/tiny", repo_dir, COMMIT, token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        path = resolve_model("hf://acme/tiny", "main", said.append)
    assert path.startswith(str(tmp_path / "hf-home"))
    assert path.endswith(f"snapshots/{COMMIT}")
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert said == ["preparing hf://acme/tiny ..."]
