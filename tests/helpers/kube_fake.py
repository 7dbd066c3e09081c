"""Run the real kopf operator against kmock's in-memory Kubernetes API.

kmock keeps objects as JSON and applies patches as merges; it runs no
controllers (Deployments never get pods or status unless a test writes
them) and does no schema validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import kmock
import kopf

from pdfleet.operator.handlers import OperatorConfig, OperatorState, configure_settings, register

IS_RESOURCE = "pdfleet.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
EVENTS = "v1/events"
PODS = "v1/pods"
SECRETS = "v1/secrets"
NAMESPACE = "ns1"
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
RESOURCES = {
    "InferenceService": IS_RESOURCE,
    "Pod": PODS,
    "Deployment": DEPLOYMENTS,
    "LeaderWorkerSet": LEADER_WORKER_SETS,
}


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, forgetting each request once it is served.

    kmock matches a request by looking it up in every reaction's view of its
    whole request log, so each request cost more than the last and a minute of
    operator timers went quadratic. The tests assert on objects, never on that
    log, so it holds only the requests in flight.
    """

    async def _handle(self, request: Any) -> Any:
        try:
            return await super()._handle(request)
        finally:
            with contextlib.suppress(ValueError):
                self._requests.remove(request)


def inference_service(name: str, spec: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": uid,
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


class FakeCluster:
    """A running operator and the API server it talks to."""

    def __init__(self, api: kmock.KubernetesEmulator, url: str, state: OperatorState) -> None:
        self.api = api
        self.url = url
        self.state = state

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self.api.objects[resource, NAMESPACE, name]
        except KeyError:
            return None
        return None if obj.deleted else dict(obj.raw)

    def names(self, resource: str) -> set[str]:
        return {
            name
            for res, ns, name in self.api.objects
            if str(res) == str(kmock.resource(resource))
            and not self.api.objects[res, ns, name].deleted
        }

    async def patch(self, resource: str, name: str, patch: dict[str, Any]) -> None:
        """Patch through HTTP, so watchers (kopf) see the change."""
        group_version, plural = resource.rsplit("/", 1)
        prefix = "api/v1" if group_version == "v1" else f"apis/{group_version}"
        path = f"{self.url}/{prefix}/namespaces/{NAMESPACE}/{plural}/{name}"
        async with httpx.AsyncClient(timeout=5) as http:
            response = await http.patch(
                path, json=patch, headers={"Content-Type": "application/merge-patch+json"}
            )
            response.raise_for_status()

    async def delete(self, resource: str, name: str) -> None:
        """Delete through HTTP, as ``kubectl delete`` would."""
        group_version, plural = resource.rsplit("/", 1)
        prefix = "api/v1" if group_version == "v1" else f"apis/{group_version}"
        path = f"{self.url}/{prefix}/namespaces/{NAMESPACE}/{plural}/{name}"
        async with httpx.AsyncClient(timeout=5) as http:
            response = await http.delete(path)
            response.raise_for_status()

    async def wait_for(
        self, predicate: Callable[[], Any], *, timeout: float = 60.0, what: str = "condition"
    ) -> Any:
        """Poll ``predicate`` until truthy. The bound is generous: on one loaded core
        kopf's first reconcile alone can take over ten seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.asynccontextmanager
async def running_operator(
    objects: list[dict[str, Any]], config: OperatorConfig | None = None
) -> AsyncIterator[FakeCluster]:
    """kmock with ``objects`` preloaded, and the operator running against it."""
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    async with Emulator() as api, kmock.Server(api) as server:
        api.resources.load_bundled()
        api.resources[IS_RESOURCE] = kmock.ResourceInfo(
            kind="InferenceService",
            namespaced=True,
            verbs={"get", "list", "watch", "patch", "create", "delete"},
            subresources={"status"},
        )
        # The LeaderWorkerSet CRD, as its controller's installation adds it.
        api.resources[LEADER_WORKER_SETS] = kmock.ResourceInfo(
            kind="LeaderWorkerSet",
            namespaced=True,
            verbs={"get", "list", "watch", "patch", "create", "delete"},
            subresources={"status", "scale"},
        )
        for obj in objects:
            meta = obj["metadata"]
            api.objects[RESOURCES[obj["kind"]], meta["namespace"], meta["name"]] = obj
        url = str(server.url).rstrip("/")
        config = config or OperatorConfig()
        config.login = lambda **_: kopf.ConnectionInfo(server=url)
        registry = kopf.OperatorRegistry()
        state = register(registry, config)
        settings = kopf.OperatorSettings()
        configure_settings(settings)
        task = asyncio.create_task(
            kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                # kmock cannot list namespaces, which namespaced mode needs.
                clusterwide=True,
            )
        )
        try:
            yield FakeCluster(api, url, state)
        finally:
            # Cancel rather than set the stop flag: a graceful stop also waits
            # 5 s for every task started meanwhile, kmock's included.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=15)
            if state.identity_endpoint is not None:  # cancelled kopf runs no cleanup
                await state.identity_endpoint.stop()
            if state.kube is not None:
                await state.kube.aclose()


def run(coro: Any, timeout: float = 180.0) -> Any:
    """Run a test coroutine with a hard bound."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout=timeout)

    return asyncio.run(bounded())
