"""Issuing engine identities: who a pod is, decided by the API server, signed by the operator.

An engine pod asks with its projected ServiceAccount token (audience
``pdfleet.dev/identity``) and its own public key (:mod:`.identity_endpoint`
carries the request). The operator

1. has the API server review the token (TokenReview, for that audience only):
   it names the ServiceAccount and, for a projected token, the pod it was
   issued to (name and uid), and fails for a token of a deleted pod;
2. reads that pod: the same uid, labelled as an engine of an
   InferenceService (``pdfleet.dev/service``, ``pdfleet.dev/role``, managed by
   the operator), running as that service's engine ServiceAccount, and of the
   service and role the engine asks for;
3. signs, with that service's authority (:mod:`.identity_authority`), a token
   binding the engine's public key to subject = the pod's name and role = its
   role label (or ``both``, for a pod whose template says its engine lends
   and pulls: ``pdfleet.dev/identity-role``), for ``ttl`` seconds.

A refusal says which check failed; it never issues anything partial.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.contracts import identity_exchange as exchange
from .identity_authority import IdentityAuthorityError, read_authority
from .kube import KubeClient, KubeError
from .manifests import (
    ANNOTATION_IDENTITY_ROLE,
    LABEL_ROLE,
    LABEL_SERVICE,
    MANAGED_BY,
    engine_service_account_name,
)

# What a TokenReview of a projected token says about the pod it was issued to.
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


class IdentityRefused(Exception):
    """No identity for this request: ``status`` is the HTTP status to answer
    (401: the token; 403: the pod; 503: try again later), ``str()`` says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Issued:
    """A token, and whom it was issued to (for the log)."""

    token: str
    namespace: str
    pod: str
    role: str
    service: str


def _one(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return None


async def _reviewed_pod(client: KubeClient, sa_token: str) -> tuple[str, str, str, str]:
    """(namespace, ServiceAccount, pod name, pod uid) the API server vouches the token for."""
    try:
        status = await client.review_token(sa_token, [exchange.AUDIENCE])
    except KubeError as e:
        raise IdentityRefused(503, f"the token could not be reviewed: {e}") from None
    if status.get("authenticated") is not True:
        why = status.get("error") or "not authenticated"
        raise IdentityRefused(401, f"the ServiceAccount token was not accepted: {why}")
    if exchange.AUDIENCE not in (status.get("audiences") or []):
        # An authenticator that ignores audiences would accept any token of the
        # pod's (the API server's own, say): refuse unless the audience is confirmed.
        raise IdentityRefused(401, f"the token is not for the audience {exchange.AUDIENCE}")
    user = status.get("user") or {}
    username = str(user.get("username") or "")
    if not username.startswith(SERVICE_ACCOUNT_PREFIX) or username.count(":") != 3:
        raise IdentityRefused(403, f"{username or 'the token'} is not a ServiceAccount")
    namespace, account = username[len(SERVICE_ACCOUNT_PREFIX) :].split(":")
    extra = user.get("extra") or {}
    pod, uid = _one(extra, EXTRA_POD_NAME), _one(extra, EXTRA_POD_UID)
    if pod is None or uid is None:
        raise IdentityRefused(
            403,
            f"the token of {username} is not bound to a pod: present the pod's projected "
            f"ServiceAccount token (audience {exchange.AUDIENCE})",
        )
    return namespace, account, pod, uid


def _check_pod(
    obj: Mapping[str, Any], namespace: str, account: str, uid: str, want: exchange.IdentityRequest
) -> tuple[str, str]:
    """(service, role) of an engine pod that may have the identity asked for."""
    meta = obj.get("metadata") or {}
    name = f"{namespace}/{meta.get('name')}"
    if meta.get("uid") != uid:
        raise IdentityRefused(
            403, f"pod {name}: the token was issued to an earlier pod of the name"
        )
    labels = meta.get("labels") or {}
    service, role = labels.get(LABEL_SERVICE), labels.get(LABEL_ROLE)
    if (
        labels.get("app.kubernetes.io/managed-by") != MANAGED_BY
        or not isinstance(service, str)
        or role not in exchange.ROLES
    ):
        raise IdentityRefused(403, f"pod {name} is not an engine pod of an InferenceService")
    if service != want.service:
        raise IdentityRefused(
            403, f"pod {name} belongs to InferenceService {service}, not {want.service}"
        )
    # A kv_both engine (peer pulls) lends and pulls: its pod says it may be "both".
    both = (meta.get("annotations") or {}).get(ANNOTATION_IDENTITY_ROLE) == "both"
    if want.role != role and not (want.role == "both" and both):
        raise IdentityRefused(403, f"pod {name} is a {role} engine, not {want.role}")
    expected = engine_service_account_name(service)
    spec = obj.get("spec") or {}
    if account != expected or spec.get("serviceAccountName") != expected:
        raise IdentityRefused(
            403, f"pod {name} runs as ServiceAccount {account}, not the service's {expected}"
        )
    phase = (obj.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        raise IdentityRefused(403, f"pod {name} has ended ({phase})")
    return service, want.role


async def issue_identity(
    client: KubeClient, sa_token: str, want: exchange.IdentityRequest, *, ttl: float
) -> Issued:
    """A token for ``want.public_key``, or :class:`IdentityRefused` naming why not."""
    namespace, account, pod, uid = await _reviewed_pod(client, sa_token)
    try:
        obj = await client.get("Pod", namespace, pod)
    except KubeError as e:
        raise IdentityRefused(503, f"pod {namespace}/{pod} could not be read: {e}") from None
    if obj is None:
        raise IdentityRefused(403, f"pod {namespace}/{pod} does not exist")
    service, role = _check_pod(obj, namespace, account, uid, want)
    try:
        authority = await read_authority(client, service, namespace)
    except KubeError as e:
        raise IdentityRefused(503, f"the identity authority could not be read: {e}") from None
    except IdentityAuthorityError as e:
        raise IdentityRefused(503, str(e)) from None
    if authority is None:
        # Not created yet (or being rotated): the engine retries.
        raise IdentityRefused(
            503,
            f"InferenceService {namespace}/{service} has no identity authority yet "
            "(kvTransfer.identity: Disabled, or not reconciled yet)",
        )
    token = authority.issue(pod, role, service, want.public_key, ttl)
    return Issued(token, namespace, pod, role, service)
