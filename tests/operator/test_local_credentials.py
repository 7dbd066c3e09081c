"""What `pdfleet up` hands its children: one fleet secret, one list of API keys."""

from __future__ import annotations

import pytest

from pdfleet.engine.contracts import security
from pdfleet.operator.local.fleet import LocalFleet, fleet_credentials
from pdfleet.operator.resource import load_inference_service

SERVICE = {
    "apiVersion": "pdfleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"name": "tiny", "uri": "builtin://tiny"},
        "kvTransfer": {"connector": "ZmqConnector"},
    },
}


def test_the_given_secret_is_used_else_a_new_one_per_run(tmp_path):
    given = "g" * 40
    assert fleet_credentials({"PDFLEET_FLEET_SECRET": given}) == (given, [])
    path = tmp_path / "secret"
    path.write_text(given + "\n")
    assert fleet_credentials({"PDFLEET_FLEET_SECRET_FILE": str(path)})[0] == given
    first, second = fleet_credentials({})[0], fleet_credentials({})[0]
    assert first != second and len(first) >= 32


def test_unusable_credentials_are_refused_naming_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="at least 16"):
        fleet_credentials({"PDFLEET_FLEET_SECRET": "short"})
    with pytest.raises(ValueError, match="PDFLEET_API_KEY_FILE"):
        fleet_credentials({"PDFLEET_API_KEY_FILE": str(tmp_path / "missing")})


def test_children_get_the_secret_and_one_canonical_key_list_and_present_the_token(tmp_path):
    _, keys = fleet_credentials({"PDFLEET_API_KEY": " ka ,\nkb,, "})
    assert keys == ["ka", "kb"]
    fleet = LocalFleet(
        load_inference_service(SERVICE),
        str(tmp_path),
        tmp_path,
        say=lambda _: None,
        fleet_secret="s" * 40,
        api_keys=keys,
    )
    child = fleet._engine_child("decode")
    assert child.env["PDFLEET_FLEET_SECRET"] == "s" * 40
    # The client keys go to the gateway only; engines get none (nor a key file
    # this process's environment may name).
    assert child.env["PDFLEET_API_KEY"] == "" and child.env["PDFLEET_API_KEY_FILE"] == ""
    assert fleet.gateway_env["PDFLEET_API_KEY"] == "ka,kb"
    assert security.split_keys(fleet.gateway_env["PDFLEET_API_KEY"]) == keys
    token = security.fleet_token(b"s" * 40)
    assert child.headers == {"Authorization": f"Bearer {token}"}
    # The KV side channel binds the fleet's host (loopback by default).
    kv = child.argv[child.argv.index("--kv-transfer-config") + 1]
    assert '"kv_ip": "127.0.0.1"' in kv


def test_engines_get_the_client_keys_only_with_direct_engine_access(tmp_path):
    fleet = LocalFleet(
        load_inference_service(SERVICE),
        str(tmp_path),
        tmp_path,
        say=lambda _: None,
        fleet_secret="s" * 40,
        api_keys=["ka", "kb"],
        direct_engine_access=True,
    )
    assert fleet._engine_child("prefill").env["PDFLEET_API_KEY"] == "ka,kb"


@pytest.mark.parametrize("mode", ["Required", "Disabled"])
def test_engines_get_identities_unless_the_service_disables_them(tmp_path, mode):
    doc = {**SERVICE, "spec": {**SERVICE["spec"], "kvTransfer": {"connector": "ZmqConnector"}}}
    doc["spec"]["kvTransfer"]["identity"] = mode
    fleet = LocalFleet(
        load_inference_service(doc),
        str(tmp_path),
        tmp_path,
        say=lambda _: None,
        fleet_secret="s" * 40,
    )
    env = fleet._engine_child("decode").env
    # Set (or hidden, when empty) whatever this process's environment holds.
    given = {k for k in env if k.startswith("PDFLEET_IDENTITY") and env[k]}
    assert env["PDFLEET_IDENTITY_ENDPOINT"] == ""
    if mode == "Required":
        assert given == {"PDFLEET_IDENTITY_FILE", "PDFLEET_IDENTITY_AUTHORITY"}
    else:
        assert given == set() and not (tmp_path / "identity").exists()
