"""How an engine pod obtains its identity token from the operator (Kubernetes).

The engine generates its own Ed25519 key pair at start; the private key never
leaves the process. It sends the public key to the operator's identity
endpoint (``POST https://.../v1/identity``, TLS verified against the CA the
operator publishes), authenticated by the pod's projected ServiceAccount token
(audience :data:`AUDIENCE`) as ``Authorization: Bearer``. The operator checks
that token with a TokenReview, reads the pod it names, and answers a token of
the identity authority (``engine/contracts/identity.py``) whose subject is the
pod's name and whose role is the pod's role label (or ``both``, for an engine
that lends and pulls, where its pod says so). The engine renews it, for
the same key, before it expires.

Both ends read the messages here (:class:`IdentityRequest`,
:class:`IdentityGrant`): JSON, a few hundred bytes. The variables the operator
sets on engine pods are named here too. See docs/security.md ("Identities").
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

# Variables of an engine pod (set by the operator; PDFLEET_* cannot be set by a
# role's env). The authority's public key itself is $PDFLEET_IDENTITY_AUTHORITY
# (engine/contracts/identity.py).
ENDPOINT_ENV = "PDFLEET_IDENTITY_ENDPOINT"
"""The identity endpoint's URL (``https://HOST:PORT``)."""
CA_FILE_ENV = "PDFLEET_IDENTITY_CA_FILE"
"""PEM file of the CA the endpoint's certificate must chain to (re-read on every request)."""
SA_TOKEN_FILE_ENV = "PDFLEET_IDENTITY_SA_TOKEN_FILE"
"""The projected ServiceAccount token (re-read on every request: the kubelet rotates it)."""
SERVICE_ENV = "PDFLEET_IDENTITY_SERVICE"
"""The InferenceService this engine belongs to (the operator checks it against the pod)."""
WAIT_ENV = "PDFLEET_IDENTITY_WAIT_SECONDS"
"""How long an engine waits at start for the endpoint before it exits (default below)."""

AUDIENCE = "pdfleet.dev/identity"
"""Audience of the projected ServiceAccount token: the API server refuses it
(it is not the API server's audience), and the operator accepts no other."""
PATH = "/v1/identity"
DEFAULT_WAIT_SECONDS = 120.0
# Bound on a request body (bytes): a real one is about 150.
MAX_REQUEST_BYTES = 4096
# Bound on a ServiceAccount token (characters): a real one is about 1,000.
MAX_SA_TOKEN_CHARS = 16384
ROLES = ("prefill", "decode")
"""Engine pods' role labels."""
ASKED_ROLES = (*ROLES, "both")
"""The roles an engine may ask for: its pod's label, or ``both`` for an engine that
lends and pulls (``kv_both``), where its pod says so."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class IdentityRequest:
    """What an engine asks for: a token for ``public_key`` as a ``role`` engine of ``service``."""

    public_key: bytes  # raw Ed25519 public key, 32 bytes
    role: str
    service: str

    def encode(self) -> bytes:
        return json.dumps(
            {"public_key": _b64(self.public_key), "role": self.role, "service": self.service}
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> IdentityRequest:
        """The request in ``body``; ValueError naming the field that is wrong."""
        if len(body) > MAX_REQUEST_BYTES:
            raise ValueError(f"the request is over {MAX_REQUEST_BYTES} bytes")
        try:
            data: Any = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("the request is not JSON") from None
        if not isinstance(data, dict):
            raise ValueError("the request is not a JSON object")
        unknown = sorted(set(data) - {"public_key", "role", "service"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field")
        key = data.get("public_key")
        try:
            if not isinstance(key, str):
                raise ValueError
            raw = base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))
        except (ValueError, binascii.Error):
            raise ValueError("public_key: not base64url") from None
        if len(raw) != 32:
            raise ValueError("public_key: not a raw Ed25519 public key (32 bytes)")
        role = data.get("role")
        if role not in ASKED_ROLES:
            raise ValueError(f"role: one of {', '.join(ASKED_ROLES)}")
        service = data.get("service")
        if not isinstance(service, str) or not 0 < len(service) <= 63:
            raise ValueError("service: the InferenceService's name")
        return cls(raw, role, service)


@dataclass(frozen=True)
class IdentityGrant:
    """The operator's answer: the identity token (``pdfleet-id1....``)."""

    token: str

    def encode(self) -> bytes:
        return json.dumps({"token": self.token}).encode()

    @classmethod
    def decode(cls, body: bytes) -> IdentityGrant:
        try:
            data = json.loads(body)
            token = data["token"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            raise ValueError("the identity endpoint's answer holds no token") from None
        if not isinstance(token, str):
            raise ValueError("the identity endpoint's answer holds no token")
        return cls(token)


def error_body(message: str) -> bytes:
    """A refusal's body: ``{"error": message}``."""
    return json.dumps({"error": message}).encode()


def error_of(body: bytes) -> str:
    """The message of a refusal's body (its text when it is not one)."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return str(data["error"])
    except (ValueError, UnicodeDecodeError):
        pass
    return body[:200].decode(errors="replace")
