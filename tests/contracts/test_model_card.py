"""The /v1/models entry (contracts/model_card.py): what engines write is what
every reader decodes, in the field order vLLM's cards have."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.model_card import ModelCard, decode_list, encode_list


def test_cards_round_trip_in_the_engines_field_order():
    base = ModelCard("tiny", created=7, root="/models/tiny", max_model_len=256)
    hub = ModelCard(
        "sql",
        created=7,
        root="/cache/snap",
        parent="tiny",
        max_model_len=256,
        lora_identity="sql@ab",
        source="hf://org/sql",
        revision=None,
    )
    local = ModelCard("chat", root="/adapters/chat", parent="tiny", lora_identity=None)
    listing = encode_list([base, hub, local])
    assert json.dumps(listing["data"][0]) == json.dumps(
        {
            "id": "tiny",
            "object": "model",
            "created": 7,
            "owned_by": "pdfleet",
            "root": "/models/tiny",
            "parent": None,
            "max_model_len": 256,
        }
    )
    assert list(listing["data"][1])[-3:] == ["lora_identity", "source", "revision"]
    assert "source" not in listing["data"][2] and listing["data"][2]["lora_identity"] is None
    assert decode_list(json.loads(json.dumps(listing))) == [base, hub, local]
    assert [c.is_adapter for c in (base, hub, local)] == [False, True, True]


def test_unknown_fields_are_kept_and_bad_entries_dropped():
    vllm = {"id": "m", "object": "model", "created": 1, "permission": [{"x": 1}]}
    cards = decode_list({"object": "list", "data": [vllm, "junk", {"id": 3}]})
    assert len(cards) == 1 and cards[0].extra == {"permission": [{"x": 1}]}
    assert cards[0].to_wire()["permission"] == [{"x": 1}]
    for bad in (None, [], {"data": "x"}):
        with pytest.raises(ValueError, match="no data list"):
            decode_list(bad)
