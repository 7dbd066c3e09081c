"""The gateway workers' events: their JSON lines, round trips, refusals."""

import json

import pytest

from pdfleet.engine.contracts import gateway_events as ev


@pytest.mark.parametrize(
    ("event", "wire"),
    [
        (
            ev.EngineStalled("http://e:1", 12.5),
            {"kind": "stall", "url": "http://e:1", "since": 12.5},
        ),
        (ev.EngineRefused("http://e:1"), {"kind": "refused", "url": "http://e:1"}),
        (
            ev.KVPairUsed("http://p", "http://d"),
            {"kind": "kv_pair_used", "prefill": "http://p", "decode": "http://d"},
        ),
        (
            ev.KVPairFailed("http://p", "http://d"),
            {"kind": "kv_pair_failed", "prefill": "http://p", "decode": "http://d"},
        ),
    ],
)
def test_each_event_is_the_json_line_it_always_was_and_round_trips(event, wire):
    line = ev.encode_event(event)
    assert line == json.dumps(wire).encode() + b"\n"
    assert ev.decode_event(line) == event


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"kind": "reboot", "url": "http://e"}\n', "kind: unknown sibling event 'reboot'"),
        (b'{"kind": "stall", "url": "http://e"}\n', "since: not a number"),
        (b'{"kind": "stall", "url": "http://e", "since": NaN}\n', "since: not a number"),
        (b'{"kind": "stall", "url": "http://e", "since": true}\n', "since: not a number"),
        (b'{"kind": "refused", "url": ""}\n', "url: not a URL"),
        (b'{"kind": "kv_pair_used", "prefill": "http://p"}\n', "decode: not a URL"),
        (b'{"kind": "refused", "url": "' + b"u" * 70000 + b'"}\n', "at most 65536 bytes"),
    ],
)
def test_a_malformed_or_hostile_event_is_refused_naming_what(line, why):
    with pytest.raises(ValueError, match=why):
        ev.decode_event(line)
