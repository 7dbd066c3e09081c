"""The migration state a decode leg carries: one carrier the gateway encodes and
an engine decodes, its bytes as they always were, refusals naming the field."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.migration import (
    FIRST_LEG,
    MAX_IDENTITY_CHARS,
    MigrationState,
    MigrationStateError,
    ids_comment,
    parse_choice_ids,
)
from pdfleet.engine.gateway.migration import Migration, add_state, with_state


def test_the_gateways_bytes_are_the_carriers_and_the_engine_reads_them_back():
    assert FIRST_LEG.encode() == b"{}"
    assert with_state(b'{"prompt":"x"}', {"prompt": "x"}) == b'{"migration":{},"prompt":"x"}'
    assert add_state({"prompt": "x"}) == {"prompt": "x", "migration": {}}
    m = Migration({"prompt": "x"}, sent=[5, 6], created=7, identity="r1")
    assert m.payload() == (
        b'{"prompt":"x","migration":{"output_token_ids":[5,6],"created":7,"resume_identity":"r1"}}'
    )
    # A leg resumed before any token went out still names the (empty) list.
    assert Migration({}).payload() == b'{"migration":{"output_token_ids":[]}}'
    state = MigrationState.from_json(json.loads(m.payload())["migration"])
    assert state == MigrationState((5, 6), 7, "r1") == m.state()
    assert MigrationState.decode(state.encode()) == state
    assert MigrationState.from_json({}) == FIRST_LEG and FIRST_LEG.sent == ()
    assert MigrationState.from_json({"created": None}) == FIRST_LEG


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([], "migration"),
        ({"bogus": 1}, "migration.bogus"),
        ({"output_token_ids": 3}, "migration.output_token_ids"),
        ({"output_token_ids": [1, "2"]}, "migration.output_token_ids"),
        ({"output_token_ids": [1, -2]}, "migration.output_token_ids"),
        ({"output_token_ids": [True]}, "migration.output_token_ids"),
        ({"created": "7"}, "migration.created"),
        ({"resume_identity": 5}, "migration.resume_identity"),
        ({"resume_identity": "x" * (MAX_IDENTITY_CHARS + 1)}, "migration.resume_identity"),
        ({"choices": []}, "migration.choices"),
        ({"choices": [[1], "x"]}, "migration.choices"),
        ({"choices": [[1]], "output_token_ids": [1]}, "migration.choices"),
        ({"finished": [0]}, "migration.finished"),
        ({"choices": [[1], None], "finished": [1]}, "migration.finished"),
        ({"choices": [[1], None], "finished": [2]}, "migration.finished"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(raw, param):
    with pytest.raises(MigrationStateError, match=f"^{param}: ") as e:
        MigrationState.from_json(raw)
    assert e.value.param == param


def test_the_bytes_of_something_else_are_refused():
    with pytest.raises(MigrationStateError, match="^migration: not JSON"):
        MigrationState.decode(b"{")


def test_a_state_of_several_choices_names_each_choice_s_sent_tokens():
    raw = {"choices": [[5, 6], None, []], "finished": [0], "created": 3}
    state = MigrationState.from_json(raw)
    assert state.choices == ((5, 6), None, ()) and state.finished == (0,)
    assert state.choice_sent(0) == (5, 6) and state.choice_sent(1) is None
    assert state.sent == () and state.to_json() == raw
    assert ids_comment([5, 6]) == ": ids 5 6\n"
    assert ids_comment([5, 6], end=True) == ": end 5 6\n"
    assert ids_comment([], 2) == ": ids.2\n"
    assert parse_choice_ids(ids_comment([7, 8], 1, end=True)[:-1].encode()) == (1, [7, 8], True)
    assert parse_choice_ids(b": ids.2") == (2, [], False)


def test_the_state_is_spliced_into_a_utf8_body_and_not_into_others():
    from pdfleet.engine.contracts.migration import FIELD, FIRST_LEG, splice_state

    for body in (b'{"a":1}', b" {\n}", b"{}"):
        spliced = splice_state(body, FIRST_LEG)
        assert spliced is not None and spliced.startswith(b'{"' + FIELD.encode())
        decoded = json.loads(spliced)
        assert decoded.pop(FIELD) == FIRST_LEG.to_json()
        assert decoded == json.loads(body)
    assert splice_state('{"a": 1}'.encode("utf-16"), FIRST_LEG) is None
