"""Credentials of a fleet, in one place: API keys, the fleet secret, signed params.

Torch-free (the gateway, the operator and ``pdfleet up`` import it). Every
component that checks a credential goes through this module, so that keys
are split the same way everywhere and every comparison is constant-time.

* **API keys** are what clients present to the gateway (and, optionally, to
  an engine directly): ``Authorization: Bearer KEY``. They come from
  ``$PDFLEET_API_KEY`` (comma- or newline-separated) or, when that is unset,
  from the file ``$PDFLEET_API_KEY_FILE`` names (a mounted Secret).
* **Internal API keys** are keys an operator hands to an internal caller that
  is not a fleet member, such as vLLM's own P/D router (``vllm-router``, which
  sends ``$OPENAI_API_KEY`` to the engines it drives). They come from
  ``$PDFLEET_INTERNAL_API_KEY`` or the file ``$PDFLEET_INTERNAL_API_KEY_FILE``
  names. Only the fleet token and internal keys may send internal fields
  (``kv_transfer_params``) to an engine; a client API key never may.
* **The fleet secret** is shared by the gateway and every engine of one
  fleet (the operator mounts it from a Secret; ``pdfleet up`` generates one
  per run). It never travels: each use derives its own key from it
  (:func:`derive_key`), so a key leaked from one use opens nothing else.

  - ``engine-http``: the bearer token the gateway (and the operator) present
    to engine HTTP routes (:func:`fleet_token`).
  - ``kv-params``: the HMAC key that signs ``kv_transfer_params``
    (``kv_params.sign`` / ``kv_params.verify``).
  - ``kv-side-channel``: the key of the KV side channel's challenge-response;
    ``kv-side-channel-curve``: its sockets' CURVE key pair.
  - ``kv-events``: the CURVE key pair of KV event publishers
    (:func:`kv_events_server_key`).

See docs/security.md for the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping

API_KEY_ENV = "PDFLEET_API_KEY"
API_KEY_FILE_ENV = "PDFLEET_API_KEY_FILE"
INTERNAL_API_KEY_ENV = "PDFLEET_INTERNAL_API_KEY"
INTERNAL_API_KEY_FILE_ENV = "PDFLEET_INTERNAL_API_KEY_FILE"
FLEET_SECRET_ENV = "PDFLEET_FLEET_SECRET"
FLEET_SECRET_FILE_ENV = "PDFLEET_FLEET_SECRET_FILE"

# Who a forwarded request is for: the gateway names its client to the engines
# (a key's digest or an address); engines honour it only from the fleet token.
CALLER_HEADER = "x-pdfleet-caller"
# Smallest secret accepted (bytes): shorter ones are guessable.
MIN_SECRET_BYTES = 16


def split_keys(text: str) -> list[str]:
    """Keys in ``text``, separated by commas or newlines, blanks dropped."""
    return [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]


def _read_secret_file(env: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"${env}: cannot read {path}: {e.strerror}") from e
    if not text.strip():
        raise ValueError(f"${env}: {path} holds no key")
    return text


def api_keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Keys from $PDFLEET_API_KEY, else from the file $PDFLEET_API_KEY_FILE."""
    environ = os.environ if environ is None else environ
    text = environ.get(API_KEY_ENV, "")
    path = environ.get(API_KEY_FILE_ENV, "")
    if not text.strip() and path:
        text = _read_secret_file(API_KEY_FILE_ENV, path)
    return split_keys(text)


def internal_api_keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Internal keys from $PDFLEET_INTERNAL_API_KEY, else from the file
    $PDFLEET_INTERNAL_API_KEY_FILE names."""
    environ = os.environ if environ is None else environ
    text = environ.get(INTERNAL_API_KEY_ENV, "")
    path = environ.get(INTERNAL_API_KEY_FILE_ENV, "")
    if not text.strip() and path:
        text = _read_secret_file(INTERNAL_API_KEY_FILE_ENV, path)
    return split_keys(text)


def fleet_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The fleet secret from $PDFLEET_FLEET_SECRET, else the file
    $PDFLEET_FLEET_SECRET_FILE names; None when neither is set."""
    environ = os.environ if environ is None else environ
    text = environ.get(FLEET_SECRET_ENV, "").strip()
    path = environ.get(FLEET_SECRET_FILE_ENV, "")
    if not text and path:
        text = _read_secret_file(FLEET_SECRET_FILE_ENV, path).strip()
    if not text:
        return None
    secret = text.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the fleet secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            f"(pdfleet up and the operator generate 32 random bytes)"
        )
    return secret


def generate_secret() -> str:
    """A new fleet secret: 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(32)


def derive_key(secret: bytes, purpose: str) -> bytes:
    """The key for one use of the fleet secret (HMAC-SHA256 of the purpose)."""
    return hmac.new(secret, b"pdfleet/" + purpose.encode(), hashlib.sha256).digest()


def fleet_token(secret: bytes) -> str:
    """The bearer token that the gateway and the operator present to engines."""
    return derive_key(secret, "engine-http").hex()


def bearer_token(header: str | None) -> str | None:
    """The credential of an ``Authorization`` header (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def caller_id(token: str | None, address: str | None = None) -> str:
    """Who a client is, for per-caller bounds: a digest of its key (never the
    key itself; equal for the same key at the gateway and at an engine), else
    its network address."""
    if token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return f"addr:{address or 'unknown'}"


def key_matches(presented: str | None, keys: Iterable[str]) -> bool:
    """Whether ``presented`` is one of ``keys``, compared in constant time
    (every key is compared, so the timing says nothing about which matched)."""
    if presented is None:
        return False
    given = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def kv_events_server_key(secret: bytes) -> bytes:
    """The raw 32-byte CURVE secret key of every KV event publisher of a fleet.
    Its public key is what a subscriber must know to complete the handshake,
    so only holders of the fleet secret can subscribe (docs/kv_events.md)."""
    return derive_key(secret, "kv-events")


def challenge() -> bytes:
    """A fresh nonce for a challenge-response."""
    return secrets.token_bytes(32)


def prove(secret: bytes, purpose: str, *parts: bytes) -> bytes:
    """The response to a challenge: HMAC of the parts under the purpose's key."""
    mac = hmac.new(derive_key(secret, purpose), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def proof_ok(secret: bytes, purpose: str, proof: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(proof, prove(secret, purpose, *parts))
