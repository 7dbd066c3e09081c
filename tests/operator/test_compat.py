"""Cross-role checks, per-role engine arguments and the compatibility hash."""

from __future__ import annotations

import json
import re

import pytest

from pdfleet.operator.compat import check_service, compat_hash
from pdfleet.operator.resource import parse_spec
from pdfleet.operator.roles import engine_command, model_source, role_engine_args

BASE = {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}}


def spec(**overrides):
    return parse_spec({**BASE, **overrides})


def fields(violations):
    return {v.field for v in violations}


def test_a_valid_spec_has_no_violations():
    assert check_service(spec(engine={"blockSize": 32})) == []


def test_connector_is_required_while_disaggregating():
    violations = check_service(spec(kvTransfer={}))
    assert fields(violations) == {"spec.kvTransfer.connector"}
    assert "Disabled" in violations[0].fix
    assert check_service(spec(kvTransfer={}, disaggregation={"mode": "Disabled"})) == []


def test_every_cross_field_problem_is_reported_at_once():
    with pytest.raises(ValueError, match="peerPull") as e:
        spec(decode={"peerPull": True, "engine": {"blockSize": 32}})
    lines = str(e.value).splitlines()
    assert lines[0].startswith("spec.decode.peerPull: in a disaggregating fleet the prefill")
    assert lines[1].startswith("spec.decode.engine.blockSize: prefill has 16 but decode has 32")


def test_kv_shape_settings_must_match_across_roles():
    # blockSize, kvCacheDtype and dtype are the resource model's rules (and the
    # CRD's); hfOverrides, a free-form object, is checked here.
    with pytest.raises(ValueError, match=r"spec\.decode\.engine\.blockSize: prefill has 16"):
        spec(decode={"engine": {"blockSize": 32}})
    violations = check_service(spec(decode={"engine": {"hfOverrides": {"num_layers": 2}}}))
    assert fields(violations) == {"spec.decode.engine.hfOverrides"}
    # No KV moves when disaggregation is off: the roles may differ.
    assert not check_service(
        spec(
            disaggregation={"mode": "Disabled"},
            decode={"engine": {"blockSize": 32, "hfOverrides": {"num_layers": 2}}},
        )
    )


def test_tensor_parallelism_may_differ_between_the_roles_in_both_directions():
    for prefill_tp, decode_tp in ((1, 4), (4, 2)):
        service = spec(
            prefill={"engine": {"tensorParallelSize": prefill_tp}},
            decode={"engine": {"tensorParallelSize": decode_tp}},
        )
        assert check_service(service) == []
    with pytest.raises(ValueError, match=r"spec\.decode\.engine\.tensorParallelSize: must be >= 1"):
        spec(decode={"engine": {"tensorParallelSize": 0}})


def test_unsupported_engine_features_and_bad_values_are_reported_where_set():
    violations = check_service(spec(engine={"maxLoras": 2}, decode={"engine": {"maxNumSeqs": 1}}))
    assert "spec.engine.maxLoras" in fields(violations)
    # The engine's constant bounds are the resource model's (and the CRD's).
    with pytest.raises(ValueError, match=r"spec\.decode\.engine\.maxNumSeqs: must be >= 1"):
        spec(decode={"engine": {"maxNumSeqs": 0}})
    # A problem of spec.engine is reported once, not once per role.
    assert len([v for v in violations if v.field == "spec.engine.maxLoras"]) == 1


@pytest.mark.parametrize(
    ("autoscaling", "field"),
    [
        ({"prefill": {"minReplicas": 2, "maxReplicas": 1}}, "spec.autoscaling.prefill.maxReplicas"),
        ({"prefillDecodeRatio": {"min": 2, "max": 1}}, "spec.autoscaling.prefillDecodeRatio.max"),
        (
            {"maxTotalReplicas": 3, "decode": {"minReplicas": 3}},
            "spec.autoscaling.maxTotalReplicas",
        ),
    ],
)
def test_autoscaling_rules_reject_the_spec_before_any_check_runs(autoscaling, field):
    # The autoscaling section validates itself (its dataclasses' rules, the same ones
    # the CRD's CEL rules come from), so a bad one never reaches check_service.
    with pytest.raises(ValueError, match=re.escape(f"{field}: must be at least")):
        spec(autoscaling=autoscaling)


def test_extra_config_may_not_repeat_typed_kv_settings():
    with pytest.raises(ValueError, match=r"spec\.kvTransfer\.extraConfig\.lease_seconds: repeats"):
        spec(kvTransfer={"connector": "NixlConnector", "extraConfig": {"lease_seconds": 5}})


def test_roles_get_producer_and_consumer_kv_configs_from_kv_transfer():
    s = spec(kvTransfer={"connector": "NixlConnector", "leaseSeconds": 12, "port": 15000})
    prefill = role_engine_args(s, "prefill", engine_id="p")
    decode = role_engine_args(s, "decode", engine_id="d")
    assert prefill.kv_transfer_config.kv_role == "kv_producer"
    assert decode.kv_transfer_config.kv_role == "kv_consumer"
    extra = decode.kv_transfer_config.kv_connector_extra_config
    assert extra == {"lease_seconds": 12.0, "backends": ["UCX"]}
    assert decode.kv_transfer_config.kv_port == 15000
    assert decode.served_model_name == ["m"]
    disabled = parse_spec({**BASE, "disaggregation": {"mode": "Disabled"}})
    assert role_engine_args(disabled, "decode").kv_transfer_config is None


def test_role_override_replaces_base_keys_only():
    s = spec(engine={"maxNumSeqs": 8, "seed": 3}, decode={"engine": {"maxNumSeqs": 64}})
    assert role_engine_args(s, "decode").max_num_seqs == 64
    assert role_engine_args(s, "decode").seed == 3
    assert role_engine_args(s, "prefill").max_num_seqs == 8


def test_engine_command_renders_flags_and_the_role_kv_config():
    s = spec(engine={"maxNumBatchedTokens": "8K", "enforceEager": True})
    command = engine_command(role_engine_args(s, "prefill", kv_ip="10.0.0.1", engine_id="e1"))
    assert command[:3] == ["pdfleet", "serve", "/models/tiny"]
    assert command[command.index("--max-num-batched-tokens") + 1] == "8192"
    assert "--enforce-eager" in command
    kv = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_ip"] == "10.0.0.1"
    assert "--model" not in command


def test_model_uris_map_to_paths_in_the_pod():
    assert model_source("pvc://models/llama/8b").path == "/models/models/llama/8b"
    assert model_source("pvc://models/llama/8b").claim == "models"
    assert model_source("file:///opt/m").path == "/opt/m"
    assert model_source("builtin://tiny").builtin == "tiny"


def test_compat_hash_changes_with_what_must_match_only():
    base = compat_hash(spec())
    assert compat_hash(spec()) == base
    assert compat_hash(spec(engine={"maxNumSeqs": 7}, decode={"replicas": 9})) == base
    assert compat_hash(spec(engine={"blockSize": 32})) != base
    assert compat_hash(spec(model={"name": "m", "revision": "r2"})) != base
    assert compat_hash(spec(kvTransfer={"connector": "ZmqConnector"})) != base


def test_peer_pulls_serve_the_decode_role_of_an_aggregated_fleet_with_a_connector():
    aggregated = {"disaggregation": {"mode": "Disabled"}}
    assert check_service(spec(decode={"peerPull": True}, **aggregated)) == []
    # The other cases are the resource model's rules (and the CRD's).
    for bad, field in (
        ({"decode": {"peerPull": True}}, "spec.decode.peerPull"),
        ({"prefill": {"peerPull": True}, **aggregated}, "spec.prefill.peerPull"),
        (
            {"decode": {"peerPull": True}, "kvTransfer": {}, **aggregated},
            "spec.kvTransfer.connector",
        ),
        (
            {"decode": {"peerPull": True}, "gateway": {"kvEvents": False}, **aggregated},
            "spec.gateway.kvEvents",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{field}: ")):
            spec(**bad)
    # The decode engines lend and pull: kv_both, on the connector's port.
    args = role_engine_args(spec(decode={"peerPull": True}, **aggregated), "decode")
    assert args.kv_transfer_config is not None
    assert args.kv_transfer_config.kv_role == "kv_both"
    assert role_engine_args(spec(**aggregated), "decode").kv_transfer_config is None


def test_peer_pulls_serve_the_prefill_role_of_a_disaggregating_fleet():
    assert check_service(spec(prefill={"peerPull": True})) == []
    for bad, field in (
        ({"prefill": {"peerPull": True}, "kvTransfer": {}}, "spec.kvTransfer.connector"),
        ({"prefill": {"peerPull": True}, "gateway": {"kvEvents": False}}, "spec.gateway.kvEvents"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{field}: ")):
            spec(**bad)
    # The prefill engines lend to and pull from each other, the decode engines lend
    # to them (and still consume the prefill legs' KV): kv_both, both roles.
    pulling = spec(prefill={"peerPull": True})
    prefill = role_engine_args(pulling, "prefill").kv_transfer_config
    assert prefill is not None and prefill.kv_role == "kv_both"
    decode = role_engine_args(pulling, "decode").kv_transfer_config
    assert decode is not None and decode.kv_role == "kv_both"
    decode = role_engine_args(spec(), "decode").kv_transfer_config
    assert decode is not None and decode.kv_role == "kv_consumer"
    plain = role_engine_args(spec(), "prefill").kv_transfer_config
    assert plain is not None and plain.kv_role == "kv_producer"
