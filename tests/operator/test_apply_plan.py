"""What `pdfleet apply` plans for a change (no processes: the plan is pure)."""

from __future__ import annotations

import copy
import json
import re

import pytest
from helpers.up import fleet_spec

from pdfleet.operator.local.fleet import LocalFleet
from pdfleet.operator.local.rollout import plan, read_request
from pdfleet.operator.local.state import (
    ApplyReport,
    ApplyRequest,
    ChildInfo,
    FleetState,
    GatewayInfo,
    SupervisorInfo,
)
from pdfleet.operator.resource import load_inference_service

MODEL = "/models/tiny"


def fleet(tmp_path, resource: dict) -> LocalFleet:
    return LocalFleet(load_inference_service(resource), MODEL, tmp_path, say=lambda _: None)


def changed(resource: dict, **sections: dict) -> object:
    new = copy.deepcopy(resource)
    for key, value in sections.items():
        new["spec"].setdefault(key, {}).update(value)
    return load_inference_service(new)


def no_model(service: object) -> str:
    raise AssertionError("the model did not change")


def test_replica_counts_only_scale(tmp_path):
    resource = fleet_spec(MODEL)
    todo = plan(
        fleet(tmp_path, resource), changed(resource, decode={"replicas": 2}), no_model, False
    )
    assert todo.roll == [] and todo.replicas == {"decode": 2}
    assert todo.changed == ["spec.decode.replicas"]


def test_an_engine_setting_rolls_both_roles_decode_first_and_a_role_setting_only_its_role(tmp_path):
    resource = fleet_spec(MODEL)
    local = fleet(tmp_path, resource)
    todo = plan(local, changed(resource, engine={"maxNumSeqs": 8}), no_model, False)
    assert todo.roll == ["decode", "prefill"] and todo.replicas == {}
    todo = plan(local, changed(resource, prefill={"engine": {"maxNumSeqs": 8}}), no_model, False)
    assert todo.roll == ["prefill"]


def test_a_new_revision_resolves_the_model_and_rolls(tmp_path):
    resource = fleet_spec(MODEL)
    asked = []
    todo = plan(
        fleet(tmp_path, resource),
        changed(resource, model={"revision": "v2"}),
        lambda s: asked.append(s.spec.model.revision) or MODEL,
        False,
    )
    assert asked == ["v2"] and todo.roll == ["decode", "prefill"]


@pytest.mark.parametrize(
    ("sections", "autoscaling", "message"),
    [
        ({"gateway": {"maxMigrations": 1}}, False, "needs a new gateway (max_migrations)"),
        ({"disaggregation": {"minPromptTokens": 64}}, False, "min_prompt_tokens"),
        # The gateway renders chat prompts with the engines' template too.
        ({"serving": {"chatTemplate": "{{ messages }}"}}, False, "new gateway (chat_template)"),
        ({"autoscaling": {}}, False, "spec.autoscaling"),
        ({"decode": {"replicas": 2}}, True, "the autoscaler owns the replica count"),
    ],
)
def test_changes_a_running_gateway_or_autoscaler_cannot_take_are_refused(
    tmp_path, sections, autoscaling, message
):
    resource = fleet_spec(MODEL)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(fleet(tmp_path, resource), changed(resource, **sections), no_model, autoscaling)


def test_another_service_is_refused(tmp_path):
    resource = fleet_spec(MODEL)
    other = copy.deepcopy(resource)
    other["metadata"]["name"] = "other"
    with pytest.raises(ValueError, match="runs 'tiny', the file is for 'other'"):
        plan(fleet(tmp_path, resource), load_inference_service(other), no_model, False)


def test_the_apply_request_file_round_trips_and_refuses_naming_the_field():
    resource = {"kind": "InferenceService", "metadata": {"name": "x"}}
    text = ApplyRequest("abc", resource).encode()
    assert text == json.dumps({"id": "abc", "resource": resource})  # what apply wrote
    assert read_request(text) == ("abc", resource)
    for bad, field in [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"resource": {}}', "id: "),
        ('{"id": "a", "resource": []}', "resource: "),
        ('{"id": "a", "resource": {}, "force": true}', "force: unknown field"),
    ]:
        with pytest.raises(ValueError, match=f"^malformed apply request: {field}"):
            read_request(bad)


def test_fleet_json_keeps_its_text_and_refuses_naming_the_field():
    state = FleetState(
        "tiny",
        GatewayInfo("http://127.0.0.1:8000", "ready"),
        (ChildInfo("decode-0", "decode", "http://127.0.0.1:8001", "ready", 2),),
        SupervisorInfo(41, None),
        ({"from": 1, "to": 2, "reason": "load"},),
        ApplyReport("abc", "rolling", "", ("decode-1 ready",)),
    )
    # The text the writer built by hand, key for key.
    by_hand = {
        "service": "tiny",
        "supervisor": {"pid": 41, "startTicks": None},
        "gateway": {"url": "http://127.0.0.1:8000", "state": "ready"},
        "engines": [
            {
                "name": "decode-0",
                "role": "decode",
                "url": "http://127.0.0.1:8001",
                "state": "ready",
                "restarts": 2,
            }
        ],
        "lastDecisions": [{"from": 1, "to": 2, "reason": "load"}],
        "apply": {"id": "abc", "state": "rolling", "message": "", "steps": ["decode-1 ready"]},
    }
    assert state.encode() == json.dumps(by_hand, indent=2)
    assert FleetState.decode(state.encode()) == state
    older = {k: v for k, v in by_hand.items() if k not in ("supervisor", "apply")}
    assert FleetState.decode(json.dumps(older)).supervisor is None
    for change, field in [
        ({"engines": [{"name": "d", "role": "decode", "url": "u"}]}, "engines[0].state"),
        ({"engines": [{**by_hand["engines"][0], "restarts": "2"}]}, "engines[0].restarts"),
        ({"gateway": {"url": "u", "state": "ready", "port": 1}}, "gateway.port"),
        ({"supervisor": {"pid": "41"}}, "supervisor.pid"),
        ({"apply": {"id": "a", "state": "done", "steps": [1]}}, "apply.steps"),
        ({"extra": 1}, "extra"),
    ]:
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            FleetState.decode(json.dumps({**by_hand, **change}))
