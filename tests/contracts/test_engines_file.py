"""The engines file ``pdfleet up`` writes and the gateway reads: one carrier,
the bytes the writer always wrote, refusals naming the field."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.engines_file import EngineEntry, EnginesFile, EnginesFileError


def test_the_writers_bytes_decode_to_the_same_entries():
    entries = (
        EngineEntry("http://127.0.0.1:8001", "prefill", "p-0"),
        EngineEntry("http://127.0.0.1:8002/", "decode", "d-0", "tcp://h:1", "tcp://h:2"),
    )
    raw = EnginesFile(entries).encode()
    # The file as the writer built it by hand: url, role, name, then the events.
    by_hand = {
        "engines": [
            {"url": "http://127.0.0.1:8001", "role": "prefill", "name": "p-0"},
            {
                "url": "http://127.0.0.1:8002",
                "role": "decode",
                "name": "d-0",
                "kv_events": "tcp://h:1",
                "kv_events_replay": "tcp://h:2",
            },
        ]
    }
    assert raw == json.dumps(by_hand, indent=2).encode()
    assert EnginesFile.decode(raw).engines == entries
    assert entries[1].url == "http://127.0.0.1:8002"  # no trailing slash
    assert EngineEntry.from_json({"url": "http://x", "role": "both"}).name == ""


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], "engines"),
        ({"engines": {}}, "engines"),
        ({"engines": [], "version": 2}, "version"),
        ({"engines": [3]}, "engines[0]"),
        ({"engines": [{"role": "decode"}]}, "engines[0].url"),
        (
            {"engines": [{"url": "http://x", "role": "decode"}, {"url": "http://y"}]},
            "engines[1].role",
        ),
        ({"engines": [{"url": 5, "role": "decode"}]}, "engines[0].url"),
        ({"engines": [{"url": "http://x", "role": "decode", "name": 3}]}, "engines[0].name"),
        (
            {"engines": [{"url": "http://x", "role": "decode", "kv_events_replay": "x"}]},
            "engines[0].kv_events_replay",
        ),
    ],
)
def test_a_malformed_file_is_refused_naming_the_field(data, field):
    with pytest.raises(EnginesFileError) as e:
        EnginesFile.from_json(data)
    assert e.value.field == field
    assert str(e.value).startswith(field + ": ")


def test_bytes_that_are_not_json_are_refused():
    with pytest.raises(EnginesFileError, match="^not JSON"):
        EnginesFile.decode(b"{")
