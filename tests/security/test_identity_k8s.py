"""Identities as a Kubernetes fleet gets them: from the operator, per pod, renewed.

The real operator runs in-process against kmock (tests/helpers/identity_cluster.py)
with its identity endpoint over real HTTPS; the test answers the API server's
TokenReviews. Engines run as real processes with what the operator's pod
template gives them (the endpoint, its CA, a ServiceAccount token file, the
authority's public key): each makes its own key, gets its token through the
endpoint, renews it, and transfers KV over ZMQ and NIXL. Tokens live 8 s here
(an hour by default), so renewals happen during the module.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.identity_cluster import IdentityCluster
from helpers.security_pair import kv_config, post, prefill_leg, prompt, text_of
from helpers.server import ServerProcess, free_port, scrape, stop_all, wait_until

from pdfleet.engine.contracts import identity, security
from pdfleet.engine.kv_transfer.identity_client import EndpointClient
from pdfleet.engine.kv_transfer.side_channel import AuthError, SideChannelClient

TTL = 8.0
CONNECTORS = {"zmq": "ZmqConnector", "nixl": "NixlConnector"}
SPEC = {
    "model": {"name": "tiny"},
    "kvTransfer": {"connector": "ZmqConnector"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 2},
}
TRANSFERS = "pdfleet_engine_kv_transfers_total"
FAILED = "pdfleet_engine_kv_transfer_failures_total"
REFUSED = "pdfleet_engine_kv_side_channel_refused_total"


@pytest.fixture(scope="module")
def cluster():
    started = IdentityCluster({"demo": SPEC}, ttl_seconds=TTL).start()
    try:
        for name in CONNECTORS:
            for role in ("prefill", "decode"):
                started.add_engine_pod(f"demo-{role}-{name}", "demo", role, f"sa-{role}-{name}")
        # A genuine decode pod of the service that runs no engine here: an insider.
        started.add_engine_pod("demo-decode-insider", "demo", "decode", "sa-decode-insider")
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def refused(cluster, tiny_model, tmp_path_factory):
    """An engine that would be a decode engine, holding a prefill pod's ServiceAccount
    token. Started with the fleet (its start overlaps theirs); it should exit."""
    tmp = tmp_path_factory.mktemp("identity-refused")
    engine = ServerProcess(
        [
            "serve",
            tiny_model,
            "--max-model-len",
            "512",
            *kv_config("ZmqConnector", "kv_consumer", free_port()),
        ],
        tmp,
        "refused",
        env=cluster.engine_env("demo", tmp, "refused", "sa-prefill-zmq"),
    )
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def fleet(cluster, refused, tiny_model, tmp_path_factory):
    """A prefill/decode pair per connector, all four engines started at once."""
    tmp = tmp_path_factory.mktemp("identity-k8s")
    engines: dict[str, ServerProcess] = {}
    kv_ports: dict[str, int] = {}
    common = ["--max-model-len", "512", "--disable-log-stats"]
    try:
        for name, connector in CONNECTORS.items():
            for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
                key = f"{role}-{name}"
                kv_ports[key] = free_port()
                engines[key] = ServerProcess(
                    ["serve", tiny_model, *common, *kv_config(connector, kv_role, kv_ports[key])],
                    tmp,
                    key,
                    env=cluster.engine_env("demo", tmp, key, f"sa-{key}"),
                )
        for engine in engines.values():
            engine.wait_healthy()
        yield engines, kv_ports
    finally:
        stop_all(engines.values())


def metric(engine: ServerProcess, name: str) -> float:
    return scrape(engine.url).get(name, 0.0)


def transfer(engines: dict[str, ServerProcess], name: str, seed: int) -> dict:
    """A P/D request by hand (the gateway's two legs); its params. Asserts the
    decode engine pulled the KV and answered what the prefill engine answers alone."""
    prefill, decode = engines[f"prefill-{name}"], engines[f"decode-{name}"]
    body = {"prompt": prompt(seed), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    params = prefill_leg_of(prefill, body)
    before = metric(decode, TRANSFERS)
    got = text_of(post(decode.url + "/v1/completions", {**body, "kv_transfer_params": params}))
    assert got == text_of(post(prefill.url + "/v1/completions", body))
    assert metric(decode, TRANSFERS) == before + 1, decode.log()
    return params


def prefill_leg_of(prefill: ServerProcess, body: dict) -> dict:
    return prefill_leg(SimpleNamespace(prefill=prefill), body)


def identity_of(cluster, folder, sa_token: str, role: str) -> identity.EngineIdentity:
    """What the operator's endpoint issues for ``sa_token`` to a key of our own."""
    env = cluster.engine_env("demo", folder, sa_token, sa_token)
    return EndpointClient(
        env["PDFLEET_IDENTITY_ENDPOINT"],
        env["PDFLEET_IDENTITY_CA_FILE"],
        env["PDFLEET_IDENTITY_SA_TOKEN_FILE"],
        env["PDFLEET_IDENTITY_AUTHORITY"],
        "demo",
        role,
        Ed25519PrivateKey.generate(),
    ).obtain(10)


@pytest.mark.parametrize("name", CONNECTORS)
def test_engines_get_their_identities_from_the_operator_and_transfer_kv(cluster, fleet, name):
    engines, _ = fleet
    params = transfer(engines, name, 9401)
    # The producer's identity is the one the operator issued: its pod's name.
    assert params["pdfleet_producer"] == f"demo-prefill-{name}"
    for role in ("prefill", "decode"):
        assert cluster.reviewed[f"sa-{role}-{name}"] >= 1


@pytest.mark.parametrize("name", CONNECTORS)
def test_forged_identities_get_nothing_and_the_real_consumer_still_pulls(
    cluster, fleet, name, tmp_path
):
    engines, kv_ports = fleet
    authority = cluster.published("demo")["authority"]
    secret = security.fleet_secret_from_env()
    assert secret is not None
    params = prefill_leg_of(
        engines[f"prefill-{name}"],
        {"prompt": prompt(9402), "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    # The attacker holds the fleet secret. Forged: the real decode pod's subject,
    # signed by an authority of its own making.
    forged = identity.EngineIdentity.issue(
        identity.Authority.generate(), f"demo-decode-{name}", "decode", "demo", 60
    )
    # Genuine but of the wrong role: what the operator issues to a prefill pod's
    # ServiceAccount token (an attacker in a prefill pod).
    prefill_identity = identity_of(cluster, tmp_path, f"sa-prefill-{name}", "prefill")
    refused_before = metric(engines[f"prefill-{name}"], REFUSED)
    for own, why in (
        (forged, "not signed by this fleet's authority"),
        (prefill_identity, "may not pull KV"),
    ):
        client = SideChannelClient(
            secret,
            f"demo-decode-{name}",
            "attacker",
            params["pdfleet_compat_hash"],
            identity.FleetIdentity(authority, own),
        )
        try:
            with pytest.raises((RuntimeError, AuthError), match=why):
                client.connect("127.0.0.1", kv_ports[f"prefill-{name}"], 5.0)
        finally:
            client.close()
    assert metric(engines[f"prefill-{name}"], REFUSED) >= refused_before + 2
    # The lease is untouched: the real decode engine pulls it.
    decode = engines[f"decode-{name}"]
    body = {"prompt": prompt(9402), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = metric(decode, TRANSFERS)
    text_of(post(decode.url + "/v1/completions", {**body, "kv_transfer_params": params}))
    assert metric(decode, TRANSFERS) == before + 1


@pytest.mark.parametrize("name", CONNECTORS)
def test_a_lease_binds_to_the_operator_vouched_subject_not_to_a_stated_engine_id(
    cluster, fleet, name, tmp_path
):
    engines, kv_ports = fleet
    secret = security.fleet_secret_from_env()
    assert secret is not None
    body = {"prompt": prompt(9405), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    params = prefill_leg_of(engines[f"prefill-{name}"], body)
    # An insider with a genuine decode identity of its own pod (issued by the real
    # endpoint) claims the lease first, stating the real decode engine's ids.
    insider = identity_of(cluster, tmp_path, "sa-decode-insider", "decode")
    assert insider.claims.subject == "demo-decode-insider"
    client = SideChannelClient(
        secret,
        f"demo-decode-{name}",
        "insider",
        params["pdfleet_compat_hash"],
        identity.FleetIdentity(cluster.published("demo")["authority"], insider),
    )
    try:
        client.connect("127.0.0.1", kv_ports[f"prefill-{name}"], 5.0)
        client.call(
            "127.0.0.1",
            kv_ports[f"prefill-{name}"],
            {
                "op": "claim",
                "lease_id": params["pdfleet_lease_id"],
                "block_ids": params["remote_block_ids"],
                "chain": params["pdfleet_block_chain"],  # the leased blocks' chain
            },
            5.0,
        )
    finally:
        client.close()
    # The lease is bound to the insider's vouched subject, which the real decode
    # pod does not share: it cannot read it, recomputes, and answers right.
    decode = engines[f"decode-{name}"]
    before = metric(decode, TRANSFERS)
    got = text_of(post(decode.url + "/v1/completions", {**body, "kv_transfer_params": params}))
    assert got == text_of(post(engines[f"prefill-{name}"].url + "/v1/completions", body))
    assert metric(decode, TRANSFERS) == before


def test_identities_renew_without_interrupting_transfers(cluster, fleet):
    engines, _ = fleet
    # Sessions open on the current tokens (the decode engines cache them).
    for name in CONNECTORS:
        transfer(engines, name, 9403)
    failed = {key: metric(e, FAILED) for key, e in engines.items()}
    refused = {name: metric(engines[f"prefill-{name}"], REFUSED) for name in CONNECTORS}
    issued = dict(cluster.reviewed)
    started = time.time()
    # Every engine renews twice (a token lives TTL, renewals come at half of it), so
    # every token the open sessions were authenticated with has expired.
    assert wait_until(
        lambda: (
            all(cluster.reviewed[f"sa-{key}"] >= issued[f"sa-{key}"] + 2 for key in engines)
            and time.time() > started + TTL
        ),
        timeout=4 * TTL,
    )
    for name in CONNECTORS:
        transfer(engines, name, 9404)
    assert {key: metric(e, FAILED) for key, e in engines.items()} == failed
    # No session was refused for an expired token: each re-authenticated first.
    assert {name: metric(engines[f"prefill-{name}"], REFUSED) for name in CONNECTORS} == refused


def test_an_engine_the_operator_refuses_exits_at_start_saying_why(refused):
    with pytest.raises(RuntimeError, match="exited"):
        refused.wait_healthy(timeout=120)
    log = refused.log()
    assert "refused this engine an identity (403)" in log
    assert "is a prefill engine, not decode" in log
