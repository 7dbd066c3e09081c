"""Fleet identities: which member of a fleet an engine is, vouched for by the operator.

The fleet secret proves membership, not identity: every holder can compute
every key derived from it. An identity adds who:

* The **identity authority** is an Ed25519 key pair. Only the operator (or
  ``pdfleet up``) holds its private key; engines get only its public key
  (``$PDFLEET_IDENTITY_AUTHORITY``, base64; not a secret).
* Each engine has **its own Ed25519 key pair** and an **identity token**: the
  authority's signature over the engine's subject (a name unique in the
  fleet), role (``prefill``, ``decode`` or ``both``), service and public key,
  with an expiry. Both are in the file ``$PDFLEET_IDENTITY_FILE`` names
  (owner-only; its private key is the one secret of the file).
* On the KV side channel each side sends its token and signs the handshake
  transcript (both nonces and the client's hello) with its private key
  (:meth:`EngineIdentity.sign`). A token alone is not enough to pose as its
  subject: peers see tokens, never private keys. Another fleet member, which
  holds the fleet secret and its own identity, can act only as itself.

Token wire format: ``pdfleet-id1.<payload>.<signature>``, both base64url
without padding; the payload is canonical JSON, the signature covers the
prefix and the payload. See docs/security.md ("Identities").
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

IDENTITY_FILE_ENV = "PDFLEET_IDENTITY_FILE"
IDENTITY_AUTHORITY_ENV = "PDFLEET_IDENTITY_AUTHORITY"
TOKEN_PREFIX = "pdfleet-id1."
ROLES = ("prefill", "decode", "both")
# Longest token accepted (characters): a real one is about 300.
MAX_TOKEN_CHARS = 2048


class InvalidIdentity(ValueError):
    """An identity token that is malformed, not signed by this fleet's authority,
    or expired."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _raw_private(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


@dataclass(frozen=True)
class IdentityClaims:
    """What a verified token says."""

    subject: str  # unique in the fleet: "SERVICE/ROLE/POD" (pdfleet up: "SERVICE/NAME")
    role: str  # prefill | decode | both
    service: str
    public_key: bytes  # the engine's raw Ed25519 public key (32 bytes)
    expires: float  # Unix seconds

    @property
    def consumes(self) -> bool:
        """Whether this member may pull KV (and so claim or release a lease)."""
        return self.role in ("decode", "both")


class Authority:
    """The identity authority: signs tokens. Only the operator (or ``pdfleet up``) has one."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> Authority:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Authority:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return _raw_private(self._key)

    @property
    def public_key(self) -> str:
        """Base64 of the raw public key: what engines get as ``$PDFLEET_IDENTITY_AUTHORITY``."""
        return _b64(_raw_public(self._key.public_key()))

    def issue(self, subject: str, role: str, service: str, public_key: bytes, ttl: float) -> str:
        """A token binding ``public_key`` to ``subject`` for ``ttl`` seconds."""
        if role not in ROLES:
            raise ValueError(f"identity role must be one of {ROLES}, not {role!r}")
        payload = json.dumps(
            {
                "sub": subject,
                "role": role,
                "svc": service,
                "pub": _b64(public_key),
                "exp": round(time.time() + ttl, 3),
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        body = TOKEN_PREFIX + _b64(payload)
        return body + "." + _b64(self._key.sign(body.encode()))


def verify_token(authority: str, token: object, now: float | None = None) -> IdentityClaims:
    """The claims of ``token`` if ``authority`` (base64 public key) signed it and it
    has not expired; InvalidIdentity naming why otherwise."""
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        raise InvalidIdentity("no identity token (this fleet requires one)")
    if len(token) > MAX_TOKEN_CHARS:
        raise InvalidIdentity("the identity token is too long")
    body, _, sig = token.rpartition(".")
    try:
        Ed25519PublicKey.from_public_bytes(_unb64(authority)).verify(_unb64(sig), body.encode())
        payload = json.loads(_unb64(body[len(TOKEN_PREFIX) :]))
        claims = IdentityClaims(
            subject=str(payload["sub"]),
            role=str(payload["role"]),
            service=str(payload["svc"]),
            public_key=_unb64(str(payload["pub"])),
            expires=float(payload["exp"]),
        )
    except InvalidSignature:
        raise InvalidIdentity(
            "the identity token is not signed by this fleet's authority"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidIdentity(f"the identity token is malformed ({type(e).__name__})") from None
    if len(claims.public_key) != 32 or claims.role not in ROLES:
        raise InvalidIdentity("the identity token is malformed")
    if (time.time() if now is None else now) > claims.expires:
        raise InvalidIdentity("the identity token has expired")
    return claims


def signature_ok(public_key: bytes, signature: object, data: bytes) -> bool:
    """Whether ``signature`` is the Ed25519 signature of ``data`` under ``public_key``."""
    if not isinstance(signature, bytes):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class EngineIdentity:
    """One engine's identity: its private key and the token that names its public key."""

    def __init__(self, key: Ed25519PrivateKey, token: str, claims: IdentityClaims) -> None:
        self._key = key
        self.token = token
        self.claims = claims

    @classmethod
    def issue(
        cls, authority: Authority, subject: str, role: str, service: str, ttl: float
    ) -> EngineIdentity:
        """A new key pair and its token (what ``pdfleet up`` does for each engine)."""
        key = Ed25519PrivateKey.generate()
        token = authority.issue(subject, role, service, _raw_public(key.public_key()), ttl)
        return cls(key, token, verify_token(authority.public_key, token))

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def write(self, path: Path) -> None:
        """Save to ``path``, readable by its owner only."""
        text = json.dumps({"token": self.token, "key": _b64(_raw_private(self._key))})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    @classmethod
    def read(cls, path: str, authority: str) -> EngineIdentity:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            key = Ed25519PrivateKey.from_private_bytes(_unb64(str(data["key"])))
            token = str(data["token"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"${IDENTITY_FILE_ENV}: cannot read an identity from {path}: {e}"
            ) from None
        try:
            claims = verify_token(authority, token)
        except InvalidIdentity as e:
            raise ValueError(f"${IDENTITY_FILE_ENV}: {path}: {e}") from None
        if claims.public_key != _raw_public(key.public_key()):
            raise ValueError(f"${IDENTITY_FILE_ENV}: {path}: the token names another key")
        return cls(key, token, claims)


@dataclass(frozen=True)
class FleetIdentity:
    """What an engine knows about identities: the authority's public key (None:
    this fleet uses none) and its own identity."""

    authority: str | None = None
    own: EngineIdentity | None = None

    @property
    def required(self) -> bool:
        """Peers must present a valid identity (an authority is configured)."""
        return self.authority is not None


def fleet_identity_from_env(environ: Mapping[str, str] | None = None) -> FleetIdentity:
    """The authority from $PDFLEET_IDENTITY_AUTHORITY and this engine's identity from
    the file $PDFLEET_IDENTITY_FILE names. Neither set: no identities (the fleet
    secret alone authenticates, as before identities). One without the other is an
    error naming the variable."""
    environ = os.environ if environ is None else environ
    authority = environ.get(IDENTITY_AUTHORITY_ENV, "").strip() or None
    path = environ.get(IDENTITY_FILE_ENV, "").strip() or None
    if authority is None and path is None:
        return FleetIdentity()
    if authority is None:
        raise ValueError(f"${IDENTITY_FILE_ENV} is set but ${IDENTITY_AUTHORITY_ENV} is not")
    try:
        if len(_unb64(authority)) != 32:
            raise ValueError
    except ValueError:
        raise ValueError(f"${IDENTITY_AUTHORITY_ENV} is not a base64 Ed25519 public key") from None
    if path is None:
        raise ValueError(
            f"${IDENTITY_AUTHORITY_ENV} is set but ${IDENTITY_FILE_ENV} is not: this engine "
            "has no identity of its own"
        )
    return FleetIdentity(authority, EngineIdentity.read(path, authority))
