"""The run-time LoRA routes' body and what a load's answer means."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.errors import ErrorBody
from pdfleet.engine.contracts.lora import (
    LoRABodyError,
    LoRALoad,
    already_loaded,
    load_succeeded,
)


def test_the_body_is_vllms_and_decodes_naming_the_field():
    assert json.loads(LoRALoad("a", "/p").encode()) == {"lora_name": "a", "lora_path": "/p"}
    assert json.loads(LoRALoad("a").encode()) == {"lora_name": "a"}
    assert LoRALoad.from_json({"lora_name": "a", "lora_path": "/p"}, "r") == LoRALoad("a", "/p")
    for raw, param in [
        ({"lora_name": "a", "x": 1}, "x"),
        ({"lora_path": "/p"}, "lora_name"),
        ({"lora_name": ""}, "lora_name"),
        ({"lora_name": "a", "lora_path": 3}, "lora_path"),
        ([], None),
    ]:
        with pytest.raises(LoRABodyError) as e:
            LoRALoad.from_json(raw, "/v1/load_lora_adapter")
        assert e.value.param == param


def test_only_a_load_or_the_same_weights_already_loaded_count_as_done():
    assert load_succeeded(200, b"Success: LoRA adapter 'a' added successfully.")
    assert load_succeeded(409, already_loaded("a").encode())
    other = ErrorBody("LoRA adapter 'a' is already loaded with other weights", 400, "lora_path")
    assert not load_succeeded(400, other.encode())
    assert not load_succeeded(409, ErrorBody("already loaded", 409).encode())
    assert not load_succeeded(409, b"already loaded")  # not an error body
    assert not load_succeeded(500, b"")
