"""Loading and unloading spec.adapters on running engine pods.

Each refresh compares what every ready engine pod serves (its ``/v1/models``:
adapters are the cards with a ``parent``) with ``spec.adapters``, and calls
the pod's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with the
fleet token for the difference. An adapter is loaded only where its files are
or can be fetched: those the pod started with (its template's annotation),
file:// adapters, pvc:// adapters on a claim the pod mounts, and hf://
adapters where the engine container can download them itself (its cache,
token and endpoint: ``lora_path`` is then the hf:// source, with the
revision). An hf:// adapter is served as wanted when the engine reports the
same source and revision, or when the pod started with exactly it (its init
step fetched it); otherwise it is unloaded and loaded again. Adapters a pod
serves that spec.adapters does not list are unloaded (the list is the whole
truth for a managed service). Only pods made from a template rendered with
spec.adapters are synced: a service without them (adapters in its engine
section, or none) is left as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ..engine.contracts.lora import LoRALoad, load_succeeded, name_taken
from ..engine.contracts.model_card import ModelCard, decode_list
from .manifests import LABEL_ROLE, template_adapters
from .model_source import adapter_claim_volume, hub_access
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


def _started_with(adapter: AdapterSpec, pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` started with exactly ``adapter`` (source and revision)."""
    started = template_adapters(pod)
    return started is not None and any(a == adapter for a in started[1])


def _engine_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    return next((c for c in containers if c.get("name") == "engine"), {})


def loadable(adapter: AdapterSpec, pod: Mapping[str, Any]) -> bool:
    """Whether ``adapter``'s files are inside ``pod``, or its engine can fetch them."""
    if _started_with(adapter, pod) or adapter.source.startswith("file://"):
        return True
    if adapter.source.startswith("hf://"):
        return hub_access(dict(_engine_container(pod)))
    claim = adapter_claim(adapter)
    if claim is None:
        return False
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return any(v.get("name") == adapter_claim_volume(claim) for v in volumes)


def _serves(adapter: AdapterSpec, card: ModelCard, pod: Mapping[str, Any]) -> bool:
    """Whether the adapter card an engine lists is ``adapter`` as spec.adapters says."""
    if adapter.source.startswith("hf://"):
        if card.source is not None:
            return card.source == adapter.source and card.revision == adapter.revision
        # Loaded from the init step's link: the revision is the template's.
        return card.root == adapter_path(adapter) and _started_with(adapter, pod)
    return card.root == adapter_path(adapter)


def load_body(adapter: AdapterSpec, pod: Mapping[str, Any]) -> LoRALoad:
    """The /v1/load_lora_adapter body for ``adapter`` on ``pod``: its directory,
    or for an hf:// adapter the pod did not start with, its source and revision
    (the engine downloads it)."""
    if adapter.source.startswith("hf://") and not _started_with(adapter, pod):
        return LoRALoad(adapter.name, adapter.source, adapter.revision or None)
    return LoRALoad(adapter.name, adapter_path(adapter))


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
            cards = decode_list(response.json())
        except (httpx.HTTPError, ValueError):
            return []  # not answering now: the next refresh tries again
        served = {c.id: c for c in cards if c.is_adapter}
        changes: list[AdapterChange] = []

        async def card_serves(adapter: AdapterSpec) -> bool:
            """Whether the pod's card of ``adapter.name`` is ``adapter``: a
            load answered name_taken (loaded meanwhile, e.g. by the gateway)
            is done only when the adapter under that name is the one wanted."""
            try:
                r = await http.get(f"{base}/v1/models/{adapter.name}")
                card = ModelCard.from_wire(r.json()) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return False
            return card is not None and _serves(adapter, card, pod)

        async def call(action: str, load: LoRALoad, wanted: AdapterSpec | None = None) -> bool:
            adapter = load.lora_name
            try:
                r = await http.post(
                    f"{base}/v1/{action}_lora_adapter",
                    content=load.encode(),
                    headers={"content-type": "application/json"},
                )
                done = load_succeeded(r.status_code) or (
                    wanted is not None
                    and name_taken(r.status_code, r.content)
                    and await card_serves(wanted)
                )
            except httpx.HTTPError as e:
                changes.append(AdapterChange(name, action, adapter, f"{e!r}"))
                return False
            if not done:
                changes.append(AdapterChange(name, action, adapter, r.text.strip()[:500]))
                return False
            changes.append(AdapterChange(name, action, adapter))
            return True

        present = set()
        for adapter, card in served.items():
            spec_adapter = wanted.get(adapter)
            if spec_adapter is None:
                await call("unload", LoRALoad(adapter))
                continue
            # Served from another directory, source or revision: loaded again below.
            moved = not _serves(spec_adapter, card, pod) and loadable(spec_adapter, pod)
            if moved and await call("unload", LoRALoad(adapter)):
                continue
            present.add(adapter)
        for spec_adapter in spec.adapters:
            if spec_adapter.name not in present and loadable(spec_adapter, pod):
                await call("load", load_body(spec_adapter, pod), spec_adapter)
        return changes

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(timeout_seconds)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        done = await asyncio.gather(*(one(http, p) for p in pods if _synced(p)))
    return [change for changes in done for change in changes]
