"""Identity tokens: signed by the authority, bound to the engine's own key, expiring."""

from __future__ import annotations

import os
import stat

import pytest

from pdfleet.engine.contracts import identity


def test_a_token_verifies_only_under_its_authority_and_until_it_expires():
    authority = identity.Authority.generate()
    own = identity.EngineIdentity.issue(authority, "svc/decode-0", "decode", "svc", 60)
    claims = identity.verify_token(authority.public_key, own.token)
    assert (claims.subject, claims.role, claims.service) == ("svc/decode-0", "decode", "svc")
    assert claims.consumes
    with pytest.raises(identity.InvalidIdentity, match="not signed by this fleet's authority"):
        identity.verify_token(identity.Authority.generate().public_key, own.token)
    with pytest.raises(identity.InvalidIdentity, match="expired"):
        identity.verify_token(authority.public_key, own.token, now=claims.expires + 1)
    # An edited payload (another role) breaks the signature.
    prefix, payload, sig = own.token.split(".")
    forged = identity._b64(identity._unb64(payload).replace(b"decode", b"prefill"))
    with pytest.raises(identity.InvalidIdentity):
        identity.verify_token(authority.public_key, f"{prefix}.{forged}.{sig}")
    for junk in (None, "", "pdfleet-id1.", "x" * 5000):
        with pytest.raises(identity.InvalidIdentity):
            identity.verify_token(authority.public_key, junk)


def test_signatures_bind_to_the_key_the_token_names():
    authority = identity.Authority.generate()
    own = identity.EngineIdentity.issue(authority, "svc/p", "prefill", "svc", 60)
    other = identity.EngineIdentity.issue(authority, "svc/q", "prefill", "svc", 60)
    sig = own.sign(b"transcript")
    assert identity.signature_ok(own.claims.public_key, sig, b"transcript")
    assert not identity.signature_ok(own.claims.public_key, sig, b"another transcript")
    assert not identity.signature_ok(other.claims.public_key, sig, b"transcript")
    assert not own.claims.consumes


def test_identity_files_are_owner_only_and_checked_against_the_authority(tmp_path):
    authority = identity.Authority.generate()
    own = identity.EngineIdentity.issue(authority, "svc/d", "decode", "svc", 60)
    path = tmp_path / "d.json"
    own.write(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    env = {
        identity.IDENTITY_FILE_ENV: str(path),
        identity.IDENTITY_AUTHORITY_ENV: authority.public_key,
    }
    fleet = identity.fleet_identity_from_env(env)
    assert fleet.required and fleet.own is not None
    assert fleet.own.claims.subject == "svc/d"
    assert not identity.fleet_identity_from_env({}).required
    with pytest.raises(ValueError, match="PDFLEET_IDENTITY_AUTHORITY"):
        identity.fleet_identity_from_env({identity.IDENTITY_FILE_ENV: str(path)})
    with pytest.raises(ValueError, match="PDFLEET_IDENTITY_FILE"):
        identity.fleet_identity_from_env({identity.IDENTITY_AUTHORITY_ENV: authority.public_key})
    with pytest.raises(ValueError, match="not signed"):
        identity.fleet_identity_from_env(
            {**env, identity.IDENTITY_AUTHORITY_ENV: identity.Authority.generate().public_key}
        )
