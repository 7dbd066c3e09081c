"""A small async Kubernetes API client for the operator's children.

kopf watches the InferenceServices; this client creates and patches what
they own. Objects are applied with server-side apply (field manager
``pdfleet-operator``), which creates, updates and forgets removed fields in
one idempotent request. Every request has a bounded timeout.
"""

from __future__ import annotations

import json
import ssl
import tempfile
from collections.abc import Sequence
from typing import Any

import httpx

FIELD_MANAGER = "pdfleet-operator"
# kind -> (API path prefix, plural) for the kinds the operator touches.
KINDS = {
    "ConfigMap": ("api/v1", "configmaps"),
    "Service": ("api/v1", "services"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "Secret": ("api/v1", "secrets"),
    "Pod": ("api/v1", "pods"),
    "Event": ("api/v1", "events"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),
    # Multi-node engine roles (docs/parallelism-k8s.md); used only when enabled.
    "LeaderWorkerSet": ("apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
}


class KubeError(RuntimeError):
    """An API request failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    path = f"/{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeClient:
    """Async requests against one API server (``server`` URL + credentials)."""

    def __init__(
        self,
        server: str,
        *,
        headers: dict[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
        timeout_seconds: float = 10.0,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=server.rstrip("/"),
            headers=headers or {},
            verify=verify,
            timeout=httpx.Timeout(timeout_seconds),
        )

    @classmethod
    def from_connection_info(cls, info: Any, *, timeout_seconds: float = 10.0) -> KubeClient:
        """Build from the ``kopf.ConnectionInfo`` kopf logged in with."""
        context: ssl.SSLContext | bool = True
        if info.insecure:
            context = False
        else:
            context = ssl.create_default_context(
                cafile=info.ca_path,
                cadata=info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data,
            )
            cert = _materialize(info.certificate_path, info.certificate_data)
            key = _materialize(info.private_key_path, info.private_key_data)
            if cert is not None:
                context.load_cert_chain(cert, key)
        return cls(
            info.server,
            headers=info.as_http_headers(),
            verify=context,
            timeout_seconds=timeout_seconds,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise KubeError(0, f"{method} {path}: {e!r}") from None

    @staticmethod
    def _check(response: httpx.Response) -> dict[str, Any]:
        if response.is_success:
            return response.json() if response.content else {}
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise KubeError(
            response.status_code,
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {message}",
        )

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        response = await self._request("GET", object_path(kind, namespace, name))
        if response.status_code == 404:
            return None
        return self._check(response)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of a kind whose labels include ``labels``."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        response = await self._request(
            "GET", object_path(kind, namespace), params={"labelSelector": selector}
        )
        items = self._check(response).get("items", [])
        # Filter here too: the selector is a request, and some servers ignore it.
        return [
            item
            for item in items
            if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (create or update; idempotent)."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        response = await self._request(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response.status_code == 404:
            # An API server without server-side apply of absent objects: create it.
            response = await self._request(
                "POST",
                object_path(obj["kind"], meta["namespace"]),
                params={"fieldManager": FIELD_MANAGER},
                json=obj,
            )
            if response.status_code == 409:
                # Created meanwhile (by a concurrent handler): apply over it.
                response = await self._request(
                    "PATCH",
                    path,
                    params={"fieldManager": FIELD_MANAGER, "force": "true"},
                    content=json.dumps(obj),
                    headers={"Content-Type": "application/apply-patch+yaml"},
                )
        return self._check(response)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj``; :class:`KubeError` with status 409 when it exists."""
        meta = obj["metadata"]
        response = await self._request(
            "POST",
            object_path(obj["kind"], meta["namespace"]),
            params={"fieldManager": FIELD_MANAGER},
            json=obj,
        )
        return self._check(response)

    async def review_token(self, token: str, audiences: Sequence[str]) -> dict[str, Any]:
        """A TokenReview of ``token`` for ``audiences``: the API server's
        ``status`` (``authenticated``, ``user``, ``audiences``, ``error``)."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": list(audiences)},
        }
        response = await self._request(
            "POST", "/apis/authentication.k8s.io/v1/tokenreviews", json=review
        )
        return self._check(response).get("status") or {}

    async def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of one object."""
        response = await self._request(
            "PATCH",
            object_path(kind, namespace, name),
            params={"fieldManager": FIELD_MANAGER},
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return self._check(response)


def _materialize(path: Any, data: str | bytes | None) -> str | None:
    """A file path for PEM data (ssl loads client certificates from files only)."""
    if path is not None:
        return str(path)
    if data is None:
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as f:
        f.write(data.encode() if isinstance(data, str) else data)
        return f.name
