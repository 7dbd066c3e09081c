"""The identity authority of an InferenceService: one Secret, created once, never patched.

Each service with identities (``kvTransfer.identity: Required``) has its own
authority, an Ed25519 key pair (``engine/contracts/identity.py``). Its private
key lives in the Secret ``NAME-identity`` (key ``authority``), which no pod
mounts and no role but the operator's may read; the operator signs engine
identity tokens with it (:mod:`.identity_issuer`). Its public key reaches the
engine pods in the ConfigMap ``NAME-identity``, with the identity endpoint's
URL and CA.

One authority per service, not one per operator: a service trusts only tokens
of its own authority, so a leaked key (or a bug in one service's issuance)
vouches for nothing in another, and rotating one service's authority (delete
the Secret) rolls that service's engine pods only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

from ..engine.contracts import identity
from .kube import KubeClient, KubeError
from .manifests import (
    IDENTITY_SECRET_KEY,
    Owner,
    build_identity_secret,
    identity_secret_name,
)


class IdentityAuthorityError(ValueError):
    """The service's identity Secret exists but holds no usable key."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def authority_of(obj: dict[str, Any]) -> identity.Authority:
    """The authority a live Secret holds."""
    name = (obj.get("metadata") or {}).get("name", "?")
    encoded = (obj.get("data") or {}).get(IDENTITY_SECRET_KEY)
    try:
        if not isinstance(encoded, str):
            raise ValueError(f"no key {IDENTITY_SECRET_KEY!r}")
        text = base64.b64decode(encoded, validate=True).decode()
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        if len(raw) != 32:
            raise ValueError("not a raw Ed25519 private key")
        return identity.Authority.from_private_bytes(raw)
    except (ValueError, binascii.Error, UnicodeDecodeError) as e:
        raise IdentityAuthorityError(
            f"Secret {name}: {e}; delete it to get a new identity authority"
        ) from None


def authority_version(authority: identity.Authority) -> str:
    """A fingerprint of the authority's public key (what pod templates carry)."""
    return hashlib.sha256(authority.public_key.encode()).hexdigest()[:16]


async def read_authority(
    client: KubeClient, name: str, namespace: str
) -> identity.Authority | None:
    """The service's authority, or None when it has none (yet)."""
    live = await client.get("Secret", namespace, identity_secret_name(name))
    return None if live is None else authority_of(live)


async def ensure_identity_authority(
    client: KubeClient, name: str, namespace: str, *, owner: Owner | None
) -> tuple[identity.Authority, bool]:
    """(the service's authority, whether it was created just now)."""
    live = await read_authority(client, name, namespace)
    if live is not None:
        return live, False
    fresh = identity.Authority.generate()
    obj = build_identity_secret(
        name, namespace=namespace, owner=owner, value=_b64(fresh.private_bytes())
    )
    try:
        await client.create(obj)
    except KubeError as e:
        if e.status != 409:
            raise
        # Another reconcile created it meanwhile: use that one.
        again = await read_authority(client, name, namespace)
        if again is None:
            raise
        return again, False
    return fresh, True
