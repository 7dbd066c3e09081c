"""Scrape the engine pods' ``/metrics`` directly (no Prometheus needed).

Each pod gives one :class:`PodSample`: its metric values summed over label
sets (one engine per pod, so a gauge's sum is its value; histogram buckets
are dropped, their ``_sum`` and ``_count`` kept). A pod that does not answer
within the timeout gives a sample with ``error`` set and no values.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdfleet.engine.config import metrics as m

from .manifests import LABEL_ROLE

# Counters of failed KV pulls: pdfleet's native name and vLLM's NIXL names.
KV_FAILURE_METRICS = (
    *m.names(m.ENGINE_KV_TRANSFER_FAILURES),
    m.VLLM_NIXL_NUM_FAILED_TRANSFERS_UNSUFFIXED,
)


@dataclass(frozen=True)
class PodSample:
    """The metrics of one engine pod at one moment."""

    pod: str
    role: str
    ready: bool
    scraped_at: float
    """Unix time of the scrape (seconds)."""
    values: Mapping[str, float] = field(default_factory=dict)
    """Sample name -> value summed over label sets (``*_bucket`` dropped)."""
    error: str | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: sum over label sets}."""
    return m.parse_metrics(text).totals()


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """``http://POD_IP:PORT/metrics`` (the container port named http), or None
    while the pod has no IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{port['containerPort']}/metrics"
    return None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


async def scrape_pods(
    pods: Sequence[Mapping[str, Any]],
    *,
    timeout_seconds: float = 2.0,
    clock: Callable[[], float] = time.time,
) -> list[PodSample]:
    """Scrape every engine pod concurrently; each request is bounded by the timeout."""

    async def one(http: httpx.AsyncClient, pod: Mapping[str, Any]) -> PodSample:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "?")
        role = (meta.get("labels") or {}).get(LABEL_ROLE, "?")
        ready = pod_ready(pod)
        url = metrics_url(pod)
        if url is None:
            return PodSample(name, role, ready, clock(), error="no pod IP yet")
        try:
            response = await http.get(url)
            response.raise_for_status()
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError) as e:
            return PodSample(name, role, ready, clock(), error=f"{url}: {e!r}")
        return PodSample(name, role, ready, clock(), values=values)

    engine_pods = [
        p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(LABEL_ROLE) != "gateway"
    ]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds)) as http:
        return list(await asyncio.gather(*(one(http, p) for p in engine_pods)))


def kv_failures(sample: PodSample) -> float | None:
    found = [sample.values[n] for n in KV_FAILURE_METRICS if n in sample.values]
    return max(found) if found else None


class KVHealth:
    """Tracks the KV-transfer failure counters of one service between scrapes."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def update(self, samples: Sequence[PodSample]) -> tuple[bool | None, str]:
        """(healthy, message): unhealthy when a counter rose since the last
        scrape; ``None`` when no pod reports the counter."""
        rising, seen = [], False
        current: dict[str, float] = {}
        for sample in samples:
            value = kv_failures(sample)
            if value is None:
                continue
            seen = True
            current[sample.pod] = value
            before = self._last.get(sample.pod)
            if before is not None and value > before:
                rising.append(f"{sample.pod} +{value - before:g}")
        self._last = current
        if not seen:
            return None, "no engine reports KV-transfer failure counters yet"
        if rising:
            return False, "failed KV transfers since the last check: " + ", ".join(rising)
        return True, "no failed KV transfers since the last check"
