"""The grammar compile workers' frames: the engine's and the child's messages."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.grammar_worker import (
    READY,
    Compiled,
    CompileRequest,
    Failed,
    TooLarge,
    decode_answer,
    frame,
    frame_size,
    is_ready,
)


def test_the_messages_are_the_json_they_always_were_and_round_trip():
    request = CompileRequest("regex", "a+", 1024)
    assert (
        request.encode() == json.dumps({"kind": "regex", "text": "a+", "max_bytes": 1024}).encode()
    )
    assert CompileRequest.decode(request.encode()) == request
    assert READY == b'{"ready": true}' and is_ready(READY)
    assert not is_ready(b'{"ready": false}') and not is_ready(b"junk")
    for answer, wire in [
        (Compiled(10), {"ok": True, "bytes": 10}),
        (TooLarge(99), {"ok": False, "too_large": 99}),
        (Failed("bad regex"), {"ok": False, "error": "bad regex"}),
    ]:
        assert answer.encode() == json.dumps(wire).encode()
        assert decode_answer(answer.encode()) == answer
    assert frame(b"abc") == b"\0" * 7 + b"\3abc"
    assert frame_size(frame(b"abc")[:8]) == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"kind": "python", "text": "", "max_bytes": 1}', "kind 'python' is not one of"),
        (b'{"kind": "regex", "text": 1, "max_bytes": 1}', "text is not a string"),
        (b'{"kind": "regex", "text": "a", "max_bytes": -1}', "max_bytes is not a byte count"),
        (b"[1]", "not a JSON object"),
    ],
)
def test_a_malformed_request_is_refused(data, message):
    with pytest.raises(ValueError, match=message):
        CompileRequest.decode(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"ok": "yes"}', "ok is not a boolean"),
        (b'{"ok": true}', "bytes is not a byte count"),
        (b'{"ok": false}', "error is not a string"),
        (b"\xff", "not JSON"),
    ],
)
def test_a_malformed_answer_is_refused(data, message):
    with pytest.raises(ValueError, match=message):
        decode_answer(data)
