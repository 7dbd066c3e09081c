"""The gateway's ``/engines`` answer: the gateway encodes it, ``pdfleet status`` decodes it."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.gateway_view import (
    EnginesView,
    EngineView,
    KVPairOpen,
    PeerPullCosts,
    TenantView,
)
from pdfleet.operator.status_cmd import render_tenant

VIEW = EnginesView(
    queued=2,
    tenants=[
        TenantView("anonymous", 0, 1.0, 3, 120, 2, 5, 0.25),
        TenantView("q", None, None, 0, 0, 1, 0, 0.0),
    ],
    worker="1/2",
    routable={"prefill": 1, "decode": 0},
    engines=[
        EngineView(
            "http://127.0.0.1:8001",
            "prefill",
            "healthy",
            1,
            False,
            1,
            None,
            0.5,
            30.0,
            None,
            {"a": "device", "b": "registered"},
            PeerPullCosts(1000.0, 0.02, None, 0.0, 0.0, 0.02),
        ),
        EngineView(
            "http://127.0.0.1:8002", "decode", "ejected", 0, True, 0, 8, 1.0, 30.0, 0.1, {}, None
        ),
    ],
    kv_pairs_open=[KVPairOpen("http://127.0.0.1:8001", "http://127.0.0.1:8002")],
)


def test_the_view_round_trips_with_every_field_written():
    wire = json.loads(VIEW.encode())
    assert list(wire) == ["queued", "tenants", "worker", "routable", "engines", "kv_pairs_open"]
    assert wire["engines"][0]["peer_pull"]["lend_s"] is None
    assert wire["engines"][0]["adapters"] == {"a": "device", "b": "registered"}
    assert wire["tenants"][1] == {
        "tenant": "q",
        "priority": None,
        "weight": None,
        "inflight": 0,
        "inflight_tokens": 0,
        "queued": 1,
        "waited": 0,
        "queue_s": 0.0,
    }
    assert EnginesView.decode(VIEW.encode()) == VIEW
    # A field a newer gateway adds is ignored.
    wire["engines"][1]["future"] = 1
    assert EnginesView.from_wire(wire) == VIEW


def test_pdfleet_status_renders_a_decoded_tenant():
    tenants = EnginesView.decode(VIEW.encode()).tenants
    assert render_tenant(tenants[0]).split() == ["anonymous", "0", "1", "3", "120", "2", "0.25"]
    assert render_tenant(tenants[1]).split() == ["q", "-", "-", "0", "0", "1", "0.00"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.pop("tenants"), "tenants: missing"),
        (lambda w: w["tenants"][0].update(inflight="3"), r"tenants\[0\]\.inflight: '3' is not"),
        (lambda w: w["engines"][1].update(stalled=1), r"engines\[1\]\.stalled: 1 is not"),
        (lambda w: w["engines"][0]["peer_pull"].update(step_s=True), r"peer_pull\.step_s: True"),
        (lambda w: w.update(routable={"decode": "1"}), "routable: not a count per role"),
        (lambda w: w["engines"][0]["adapters"].update(a="gpu"), r"adapters: 'a': 'gpu' is not"),
        (lambda w: w["kv_pairs_open"][0].pop("decode"), r"kv_pairs_open\[0\]\.decode: missing"),
    ],
)
def test_a_malformed_view_is_refused_naming_the_field(mutate, message):
    wire = json.loads(VIEW.encode())
    mutate(wire)
    with pytest.raises(ValueError, match=message):
        EnginesView.from_wire(wire)
