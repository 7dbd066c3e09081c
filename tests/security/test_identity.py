"""Fleet identities on the KV side channel: the fleet secret proves membership,
an operator-signed identity (with its own key) proves which member.

Every attacker here holds the fleet secret, as a compromised fleet member
would. Before identities, the producer took the engine id a peer stated, so
any of them could pose as the consumer a lease is bound to.
"""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.security_pair import post, prefill_leg, prompt, text_of

from pdfleet.engine.contracts import identity, security
from pdfleet.engine.kv_transfer.side_channel import AuthError, SideChannelClient

TRANSFERS = "pdfleet_engine_kv_transfers_total"


def client(
    pair, own: identity.EngineIdentity | None, engine_id: str, compat_hash: str
) -> SideChannelClient:
    """A side-channel client holding the fleet secret, with ``own`` identity."""
    secret = security.fleet_secret_from_env()
    assert secret is not None
    fleet = identity.FleetIdentity(pair.authority.public_key, own)
    return SideChannelClient(secret, engine_id, "instance-x", compat_hash, fleet)


def connect(c: SideChannelClient, pair) -> dict:
    reply, _ = c.connect("127.0.0.1", pair.kv_ports["prefill"], 5.0)
    return reply


def decode_token(pair) -> str:
    return json.loads((pair.tmp / "decode.identity.json").read_text())["token"]


def body(seed: int) -> dict:
    return {"prompt": prompt(seed), "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_forged_stolen_or_missing_identities_get_nothing_and_the_real_consumer_pulls(pair):
    a = body(9301)
    params = prefill_leg(pair, a)
    refused_before = pair.metric("prefill", "pdfleet_engine_kv_side_channel_refused_total")
    other_authority = identity.Authority.generate()
    stolen = identity.verify_token(pair.authority.public_key, decode_token(pair))
    attackers = {
        "no identity": (None, "no identity token"),
        "another authority's token": (
            identity.EngineIdentity.issue(other_authority, "sec/decode", "decode", "sec", 60),
            "not signed by this fleet's authority",
        ),
        "the decode engine's token without its key": (
            identity.EngineIdentity(Ed25519PrivateKey.generate(), decode_token(pair), stolen),
            "does not hold the identity's key",
        ),
    }
    compat = params["pdfleet_compat_hash"]
    for name, (own, why) in attackers.items():
        c = client(pair, own, "sec-decode", compat)
        try:
            with pytest.raises((RuntimeError, AuthError), match=why):
                connect(c, pair)
        finally:
            c.close()
        assert not c.sessions, name
    # A member with an identity of its own, but not a consumer's, gets no handshake.
    prefill_only = identity.EngineIdentity.issue(pair.authority, "sec/p2", "prefill", "sec", 60)
    c = client(pair, prefill_only, "sec-p2", compat)
    try:
        with pytest.raises(RuntimeError, match="may not pull KV"):
            connect(c, pair)
    finally:
        c.close()
    assert (
        pair.metric("prefill", "pdfleet_engine_kv_side_channel_refused_total") >= refused_before + 4
    )
    # The real decode engine, acting under its own identity, still pulls the lease.
    before = pair.metric("decode", TRANSFERS)
    got = text_of(post(pair.decode.url + "/v1/completions", {**a, "kv_transfer_params": params}))
    assert got == text_of(post(pair.prefill.url + "/v1/completions", a))
    assert pair.metric("decode", TRANSFERS) == before + 1


def test_a_lease_binds_to_a_vouched_identity_not_to_a_stated_engine_id(pair):
    b = body(9302)
    params = prefill_leg(pair, b)
    lease = params["pdfleet_lease_id"]
    blocks = params["remote_block_ids"]
    # An insider with a valid consumer identity of its own claims the lease first,
    # stating the real decode engine's ids: the lease binds to the insider's
    # vouched subject, which the real decode engine does not share.
    insider = identity.EngineIdentity.issue(pair.authority, "sec/insider", "decode", "sec", 60)
    c = client(pair, insider, "sec-decode", params["pdfleet_compat_hash"])
    try:
        connect(c, pair)
        c.call(
            "127.0.0.1",
            pair.kv_ports["prefill"],
            {"op": "claim", "lease_id": lease, "block_ids": blocks},
            5.0,
        )
    finally:
        c.close()
    # The real decode leg cannot read a lease bound to the insider: it recomputes,
    # and its answer is right.
    before = pair.metric("decode", TRANSFERS)
    got = text_of(post(pair.decode.url + "/v1/completions", {**b, "kv_transfer_params": params}))
    assert got == text_of(post(pair.prefill.url + "/v1/completions", b))
    assert pair.metric("decode", TRANSFERS) == before
