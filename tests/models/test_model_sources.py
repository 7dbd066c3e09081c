"""Model sources: one cache directory for every user, GGUF files prepared by the
model layer before the configuration reads a directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.contracts.model_source import CACHE_DIR_ENV, cache_dir


def test_cache_dir_prefers_its_variable_then_the_older_one_then_xdg(tmp_path):
    home = os.path.expanduser("~")
    assert cache_dir({}) == Path(home) / ".cache" / "pdfleet"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pdfleet"
    both = {CACHE_DIR_ENV: str(tmp_path / "a"), "PDFLEET_CACHE": str(tmp_path / "b")}
    assert cache_dir(both) == tmp_path / "a"
    assert cache_dir({"PDFLEET_CACHE": str(tmp_path / "b")}) == tmp_path / "b"


def test_the_tiny_model_and_gguf_directories_share_the_one_cache(tmp_path, monkeypatch):
    from pdfleet.engine.tiny.builder import default_tiny_model_dir

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("PDFLEET_CACHE", raising=False)
    assert default_tiny_model_dir() == str(tmp_path / "tiny-llama")


@pytest.fixture(scope="module")
def gguf_file(smollm2_dir):
    return os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))


def test_a_gguf_file_without_its_prepared_directory_is_refused_with_the_way(gguf_file):
    with pytest.raises(ValueError, match=r"GGUF file.*models\.sources\.create_engine_config"):
        EngineArgs(model=gguf_file).create_engine_config(device="cpu")


def test_the_model_layer_prepares_a_gguf_file_and_a_directory_holding_one(gguf_file, tmp_path):
    from pdfleet.engine.models.sources import create_engine_config

    config = create_engine_config(EngineArgs(model=gguf_file), device="cpu")
    prepared = config.model_config.model_dir
    assert prepared is not None and os.path.isfile(os.path.join(prepared, "config.json"))
    assert config.model_config.architecture == "LlamaForCausalLM"

    only = tmp_path / "only-gguf"
    only.mkdir()
    os.symlink(gguf_file, only / "model.gguf")
    with pytest.raises(ValueError, match="GGUF file"):
        EngineArgs(model=str(only)).create_engine_config(device="cpu")
    config = create_engine_config(EngineArgs(model=str(only)), device="cpu")
    assert config.model_config.model_dir == prepared
