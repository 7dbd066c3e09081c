"""The fleet secret of an InferenceService: one Secret, created once, never patched.

The Secret ``NAME-fleet`` holds 32 random bytes (``security.generate_secret``)
under the key ``fleet-secret``. Every engine and gateway pod of the service
mounts it as a file (``$PDFLEET_FLEET_SECRET_FILE``); the operator reads it
to present the fleet token when it scrapes engine ``/metrics``.

The Secret is immutable: rotating it means deleting it. The operator then
creates a new one (at the next reconcile or status refresh), and the new
fingerprint on the pod templates rolls every pod onto it (docs/security.md).
"""

from __future__ import annotations

import base64
from typing import Any

from ..engine.contracts import security
from .kube import KubeClient, KubeError
from .manifests import FLEET_SECRET_KEY, Owner, build_fleet_secret, fleet_secret_name


class FleetSecretError(ValueError):
    """The service's fleet Secret exists but holds no usable secret."""


def secret_value(obj: dict[str, Any]) -> bytes:
    """The secret a live Secret holds (checked as the engines check it)."""
    name = (obj.get("metadata") or {}).get("name", "?")
    encoded = (obj.get("data") or {}).get(FLEET_SECRET_KEY)
    if not isinstance(encoded, str):
        raise FleetSecretError(f"Secret {name} has no key {FLEET_SECRET_KEY!r}; delete it")
    try:
        text = base64.b64decode(encoded, validate=True).decode()
        secret = security.fleet_secret_from_env({security.FLEET_SECRET_ENV: text})
    except ValueError as e:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise FleetSecretError(f"Secret {name}: {e}; delete it to get a new one") from None
    if secret is None:
        raise FleetSecretError(f"Secret {name}: {FLEET_SECRET_KEY!r} is empty; delete it")
    return secret


def secret_version(secret: bytes) -> str:
    """A fingerprint of the secret that reveals nothing about it."""
    return security.derive_key(secret, "fingerprint").hex()[:16]


async def ensure_fleet_secret(
    client: KubeClient, name: str, namespace: str, *, owner: Owner | None
) -> tuple[bytes, bool]:
    """(the service's fleet secret, whether it was created just now)."""
    secret_name = fleet_secret_name(name)
    live = await client.get("Secret", namespace, secret_name)
    if live is not None:
        return secret_value(live), False
    obj = build_fleet_secret(
        name, namespace=namespace, owner=owner, value=security.generate_secret()
    )
    try:
        await client.create(obj)
    except KubeError as e:
        if e.status != 409:
            raise
        # Another reconcile created it meanwhile: use that one.
        live = await client.get("Secret", namespace, secret_name)
        if live is None:
            raise
        return secret_value(live), False
    return secret_value(obj), True
