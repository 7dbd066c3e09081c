"""The run-time LoRA routes' body and what a load's answer means."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.errors import ErrorBody
from pdfleet.engine.contracts.lora import (
    UNLOAD_FIELDS,
    LoRABodyError,
    LoRALoad,
    already_loaded,
    load_succeeded,
    name_taken,
)


def test_the_body_is_vllms_and_decodes_naming_the_field():
    assert json.loads(LoRALoad("a", "/p").encode()) == {"lora_name": "a", "lora_path": "/p"}
    assert json.loads(LoRALoad("a").encode()) == {"lora_name": "a"}
    assert LoRALoad.from_json({"lora_name": "a", "lora_path": "/p"}, "r") == LoRALoad("a", "/p")
    # vLLM's load_inplace: false is what a load does; true is refused naming it.
    inplace = {"lora_name": "a", "lora_path": "/p", "load_inplace": False}
    assert LoRALoad.from_json(inplace, "r") == LoRALoad("a", "/p")
    for raw, param in [
        ({**inplace, "load_inplace": True}, "load_inplace"),
        ({**inplace, "load_inplace": "no"}, "load_inplace"),
        ({"lora_name": "a", "x": 1}, "x"),
        ({"lora_path": "/p"}, "lora_name"),
        ({"lora_name": ""}, "lora_name"),
        ({"lora_name": "a", "lora_path": 3}, "lora_path"),
        ([], None),
    ]:
        with pytest.raises(LoRABodyError) as e:
            LoRALoad.from_json(raw, "/v1/load_lora_adapter")
        assert e.value.param == param
    with pytest.raises(LoRABodyError, match="load_inplace: unknown field"):
        LoRALoad.from_json({"lora_name": "a", "load_inplace": False}, "r", UNLOAD_FIELDS)
    # vLLM's unload body: the name and optionally its lora_int_id (an integer);
    # a lora_path there is refused, never ignored.
    unload = {"lora_name": "a", "lora_int_id": 3}
    assert LoRALoad.from_json(unload, "r", UNLOAD_FIELDS) == LoRALoad("a", lora_int_id=3)
    assert json.loads(LoRALoad("a", lora_int_id=3).encode()) == unload
    for raw, param in [
        ({"lora_name": "a", "lora_path": "/p"}, "lora_path"),
        ({"lora_name": "a", "lora_int_id": "3"}, "lora_int_id"),
        ({"lora_name": "a", "lora_int_id": True}, "lora_int_id"),
        ({"lora_name": "a", "lora_int_id": 0}, "lora_int_id"),
    ]:
        with pytest.raises(LoRABodyError) as e:
            LoRALoad.from_json(raw, "/v1/unload_lora_adapter", UNLOAD_FIELDS)
        assert e.value.param == param
    with pytest.raises(LoRABodyError, match="lora_int_id: unknown field"):
        LoRALoad.from_json({"lora_name": "a", "lora_path": "/p", "lora_int_id": 1}, "r")


def test_a_load_succeeded_on_200_and_a_taken_name_is_vllms_400_naming_lora_name():
    assert load_succeeded(200)
    assert not load_succeeded(400) and not load_succeeded(409)
    same, other = already_loaded("a", True), already_loaded("a", False)
    for answer in (same, other):
        assert answer.status == 400 and answer.param == "lora_name"
        assert answer.message.startswith("The lora adapter 'a' has already been loaded")
        assert name_taken(400, answer.encode())
    assert "same weights" in same.message and "unload it first" in other.message
    # Only the contract's shape says so: not another status, param or body.
    assert not name_taken(409, same.encode())
    assert not name_taken(400, ErrorBody("cannot be served", 400, "lora_path").encode())
    invalid = ErrorBody("LoRA adapter 'tiny': the name is the base model's", 400, "lora_name")
    assert not name_taken(400, invalid.encode())  # the name's fault, not a taken one
    assert not name_taken(400, b"has already been loaded")  # not an error body
    assert not name_taken(500, b"")
