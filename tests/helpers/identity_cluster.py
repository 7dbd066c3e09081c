"""The real operator against kmock, on a thread of its own, with its identity endpoint.

Tests (and engine processes) call the endpoint over real HTTPS while kopf runs.
kmock runs no authenticator, so the test plays the API server's TokenReview:
``reviews`` maps a ServiceAccount token to the review's ``status``
(:func:`pod_review` builds what a real API server answers for a projected
token of a pod). Pods are objects the test puts into kmock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from helpers.kube_fake import NAMESPACE, PODS, inference_service, running_operator
from pdfleet.engine.contracts import identity_exchange as exchange
from pdfleet.operator.handlers import OperatorConfig
from pdfleet.operator.identity_endpoint import IdentityEndpointConfig
from pdfleet.operator.manifests import (
    IDENTITY_AUTHORITY_KEY,
    IDENTITY_CA_KEY,
    IDENTITY_ENDPOINT_KEY,
    MANAGED_BY,
    engine_service_account_name,
    identity_configmap_name,
)

TOKENREVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
CONFIGMAPS = "v1/configmaps"


def pod_review(
    pod: str,
    uid: str,
    account: str,
    namespace: str = NAMESPACE,
    audiences: tuple[str, ...] = (exchange.AUDIENCE,),
) -> dict[str, Any]:
    """A TokenReview status for a projected token of ``pod``."""
    return {
        "authenticated": True,
        "audiences": list(audiences),
        "user": {
            "username": f"system:serviceaccount:{namespace}:{account}",
            "uid": f"sa-uid-{account}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
            "extra": {
                "authentication.kubernetes.io/pod-name": [pod],
                "authentication.kubernetes.io/pod-uid": [uid],
            },
        },
    }


def engine_pod(name: str, service: str, role: str, uid: str, account: str | None = None) -> dict:
    """An engine pod as the operator's Deployment makes them (the fields the issuer reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": uid,
            "labels": {
                "app.kubernetes.io/managed-by": MANAGED_BY,
                "pdfleet.dev/service": service,
                "pdfleet.dev/role": role,
            },
        },
        "spec": {"serviceAccountName": account or engine_service_account_name(service)},
        "status": {"phase": "Running"},
    }


class IdentityCluster:
    """kopf + kmock + the endpoint on a background event loop (``start``/``stop``)."""

    def __init__(self, specs: dict[str, dict[str, Any]], ttl_seconds: float) -> None:
        self.specs = specs
        self.config = OperatorConfig(
            timer_interval_seconds=1.0,
            rollout_poll_seconds=0.3,
            identity=IdentityEndpointConfig(ttl_seconds=ttl_seconds),
        )
        self.reviews: dict[str, dict[str, Any]] = {}
        self.reviewed: Counter[str] = Counter()  # TokenReviews per ServiceAccount token
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> IdentityCluster:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the operator did not start: {self._error!r}")
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._reviews_open = asyncio.Event()  # cleared: TokenReviews wait (hold_reviews)
        self._reviews_open.set()
        objects = [inference_service(n, s, uid=f"uid-{n}") for n, s in self.specs.items()]
        async with running_operator(objects, self.config) as k:
            self.k = k
            k.api["post", TOKENREVIEWS] << self._review
            await k.wait_for(
                lambda: all(k.get(CONFIGMAPS, identity_configmap_name(n)) for n in self.specs),
                what="identity ConfigMaps",
                timeout=80,
            )
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._thread.is_alive() and hasattr(self, "_stop"):
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _review(self, request: Any) -> dict[str, Any]:
        # kmock stores every created object, and a TokenReview has no name: forget
        # it, or the next review would conflict with it.
        with contextlib.suppress(KeyError):
            del self.k.api.objects[request.resource, None, None]
        spec = (request.data or {}).get("spec") or {}
        token = str(spec.get("token"))
        self.reviewed[token] += 1
        await asyncio.wait_for(self._reviews_open.wait(), 30)
        status = self.reviews.get(token) or {"authenticated": False, "error": "invalid token"}
        if status.get("authenticated") and exchange.AUDIENCE not in (spec.get("audiences") or []):
            status = {"authenticated": False, "error": "token audiences are invalid"}
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}

    # -- the cluster, from the test's thread ----------------------------------------------

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the operator's loop (kmock is not thread-safe)."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def hold_reviews(self, hold: bool) -> None:
        """Make TokenReviews wait (a slow API server) until called with False."""
        self.call(self._reviews_open.clear if hold else self._reviews_open.set)

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]

        def put() -> None:
            self.k.api.objects[resource, meta["namespace"], meta["name"]] = obj

        self.call(put)

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        return self.call(self.k.get, resource, name)

    def delete(self, resource: str, name: str) -> None:
        asyncio.run_coroutine_threadsafe(self.k.delete(resource, name), self.loop).result(30)

    def add_engine_pod(self, name: str, service: str, role: str, sa_token: str, **kw: Any) -> None:
        """A pod, and its projected token as the API server would review it."""
        pod = engine_pod(name, service, role, uid=f"uid-{name}", **kw)
        self.put(PODS, pod)
        self.reviews[sa_token] = pod_review(name, f"uid-{name}", pod["spec"]["serviceAccountName"])

    def published(self, service: str) -> dict[str, str]:
        """The identity ConfigMap's data: authority, ca.crt, endpoint."""
        cm = self.get(CONFIGMAPS, identity_configmap_name(service))
        assert cm is not None
        return dict(cm["data"])

    def engine_env(self, service: str, folder: Path, name: str, sa_token: str) -> dict[str, str]:
        """What the operator's pod template gives an engine (files written to ``folder``)."""
        data = self.published(service)
        ca = folder / f"{name}-ca.crt"
        ca.write_text(data[IDENTITY_CA_KEY])
        token = folder / f"{name}-sa-token"
        token.write_text(sa_token)
        return {
            "PDFLEET_IDENTITY_AUTHORITY": data[IDENTITY_AUTHORITY_KEY],
            exchange.ENDPOINT_ENV: data[IDENTITY_ENDPOINT_KEY],
            exchange.CA_FILE_ENV: str(ca),
            exchange.SA_TOKEN_FILE_ENV: str(token),
            exchange.SERVICE_ENV: service,
        }
