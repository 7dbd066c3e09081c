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
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(raw, param):
    with pytest.raises(MigrationStateError, match=f"^{param}: ") as e:
        MigrationState.from_json(raw)
    assert e.value.param == param


def test_the_bytes_of_something_else_are_refused():
    with pytest.raises(MigrationStateError, match="^migration: not JSON"):
        MigrationState.decode(b"{")
