"""The credential helpers every component shares (engine/contracts/security.py)."""

import pytest

from pdfleet.engine.contracts import security as sec

SECRET = b"s" * 32


def test_keys_split_on_commas_and_newlines_and_the_file_is_read_when_env_is_unset(tmp_path):
    assert sec.api_keys_from_env({"PDFLEET_API_KEY": "ka, kb\nkc,,"}) == ["ka", "kb", "kc"]
    f = tmp_path / "keys"
    f.write_text("k1\nk2\n")
    assert sec.api_keys_from_env({"PDFLEET_API_KEY_FILE": str(f)}) == ["k1", "k2"]
    with pytest.raises(ValueError, match="PDFLEET_API_KEY_FILE"):
        sec.api_keys_from_env({"PDFLEET_API_KEY_FILE": str(tmp_path / "missing")})


def test_fleet_secret_from_env_or_file_and_short_secrets_are_refused(tmp_path):
    assert sec.fleet_secret_from_env({}) is None
    f = tmp_path / "secret"
    f.write_text("x" * 40 + "\n")
    assert sec.fleet_secret_from_env({"PDFLEET_FLEET_SECRET_FILE": str(f)}) == b"x" * 40
    with pytest.raises(ValueError, match="at least 16"):
        sec.fleet_secret_from_env({"PDFLEET_FLEET_SECRET": "short"})
    assert len(sec.generate_secret()) >= 40


def test_bearer_scheme_is_case_insensitive_and_keys_compare_by_value():
    assert sec.bearer_token("bearer abc") == "abc"
    assert sec.bearer_token("BEARER  abc ") == "abc"
    assert sec.bearer_token("Basic abc") is None
    assert sec.bearer_token("Bearer ") is None
    assert sec.key_matches("kb", ["ka", "kb"])
    assert not sec.key_matches("k", ["ka", "kb"])
    assert not sec.key_matches(None, ["ka"])


def test_derived_keys_differ_per_purpose_and_per_secret():
    assert sec.derive_key(SECRET, "a") != sec.derive_key(SECRET, "b")
    assert sec.derive_key(SECRET, "a") != sec.derive_key(b"t" * 32, "a")
    assert sec.fleet_token(SECRET) != sec.fleet_token(b"t" * 32)


def test_challenge_proofs_bind_every_part():
    nonce = sec.challenge()
    proof = sec.prove(SECRET, "kv-side-channel", nonce, b"peer")
    assert sec.proof_ok(SECRET, "kv-side-channel", proof, nonce, b"peer")
    assert not sec.proof_ok(SECRET, "kv-side-channel", proof, nonce, b"other")
    assert not sec.proof_ok(SECRET, "other-purpose", proof, nonce, b"peer")
    assert not sec.proof_ok(b"t" * 32, "kv-side-channel", proof, nonce, b"peer")
