"""Loading and unloading spec.adapters on running engine pods.

Each refresh compares what every ready engine pod serves (its ``/v1/models``:
adapters are the cards with a ``parent``) with ``spec.adapters``, and calls
the pod's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with the
fleet token for the difference. An adapter is loaded only where its files are:
those the pod started with (its template's annotation), file:// adapters, and
pvc:// adapters on a claim the pod mounts. An hf:// adapter the pod did not
start with is not there: its template changes (an init step fetches it), and
the new pods start with it. Adapters a pod serves that spec.adapters does not
list are unloaded (the list is the whole truth for a managed service). Only
pods made from a template rendered with spec.adapters are synced: a service
without them (adapters in its engine section, or none) is left as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .manifests import LABEL_ROLE, template_adapters
from .model_source import adapter_claim_volume
from .parallelism import LABEL_GROUP_ROLE, WORKER
from .resource import AdapterSpec, InferenceServiceSpec
from .roles import adapter_claim, adapter_path
from .scrape import metrics_url, pod_ready


@dataclass(frozen=True)
class AdapterChange:
    """One load or unload on one pod; ``error`` when it failed."""

    pod: str
    action: str
    """load or unload."""
    adapter: str
    error: str | None = None


def loadable(adapter: AdapterSpec, pod: Mapping[str, Any]) -> bool:
    """Whether ``adapter``'s files are inside ``pod``."""
    started = template_adapters(pod)
    if started is not None and any(a == adapter for a in started[1]):
        return True
    if adapter.source.startswith("file://"):
        return True
    claim = adapter_claim(adapter)
    if claim is None:
        return False  # hf:// adapters are fetched by the pod's init steps only
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return any(v.get("name") == adapter_claim_volume(claim) for v in volumes)


def _synced(pod: Mapping[str, Any]) -> bool:
    """An engine pod that serves the API and was made from a template rendered
    with spec.adapters (annotated). Pods of a service without spec.adapters
    (whose engine section may load adapters itself) are left alone."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return (
        template_adapters(pod) is not None
        and labels.get(LABEL_ROLE) in ("prefill", "decode")
        and labels.get(LABEL_GROUP_ROLE) != WORKER
        and pod_ready(pod)
        and metrics_url(pod) is not None
    )


async def sync_adapters(
    pods: Sequence[Mapping[str, Any]],
    spec: InferenceServiceSpec,
    *,
    token: str | None,
    timeout_seconds: float = 10.0,
) -> list[AdapterChange]:
    """Make every ready engine pod serve spec.adapters (where their files are);
    returns the loads and unloads it made or tried. Each request is bounded by
    ``timeout_seconds``; a pod that does not answer is left for the next tick."""
    wanted = {a.name: a for a in spec.adapters}

    async def one(http: httpx.AsyncClient, pod: Mapping[str, Any]) -> list[AdapterChange]:
        name = (pod.get("metadata") or {}).get("name", "?")
        base = (metrics_url(pod) or "").removesuffix("/metrics")
        try:
            response = await http.get(f"{base}/v1/models")
            response.raise_for_status()
            cards = response.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return []  # not answering now: the next refresh tries again
        served = {c.get("id"): c.get("root") for c in cards if c.get("parent") is not None}
        changes: list[AdapterChange] = []

        async def call(action: str, adapter: str, body: dict[str, str]) -> bool:
            try:
                r = await http.post(f"{base}/v1/{action}_lora_adapter", json=body)
            except httpx.HTTPError as e:
                changes.append(AdapterChange(name, action, adapter, f"{e!r}"))
                return False
            if r.status_code >= 400:
                changes.append(AdapterChange(name, action, adapter, r.text.strip()[:500]))
                return False
            changes.append(AdapterChange(name, action, adapter))
            return True

        present = set()
        for adapter, root in served.items():
            spec_adapter = wanted.get(adapter)
            if spec_adapter is None:
                await call("unload", adapter, {"lora_name": adapter})
                continue
            # Served from another directory (its source changed): loaded again below.
            moved = root != adapter_path(spec_adapter) and loadable(spec_adapter, pod)
            if moved and await call("unload", adapter, {"lora_name": adapter}):
                continue
            present.add(adapter)
        for adapter in spec.adapters:
            if adapter.name not in present and loadable(adapter, pod):
                body = {"lora_name": adapter.name, "lora_path": adapter_path(adapter)}
                await call("load", adapter.name, body)
        return changes

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(timeout_seconds)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        done = await asyncio.gather(*(one(http, p) for p in pods if _synced(p)))
    return [change for changes in done for change in changes]
