"""Scrape the engine pods' ``/metrics`` directly (no Prometheus needed).

Each pod gives one :class:`PodSample`: its metric values summed over label
sets (one engine per pod, so a gauge's sum is its value; histogram buckets
are dropped, their ``_sum`` and ``_count`` kept). A pod that does not answer
within the timeout gives a sample with ``error`` set and no values.

Engines require the fleet token on ``/metrics`` (docs/security.md): pass it
as ``token``; it is sent as ``Authorization: Bearer TOKEN``. Gateways accept
the same token on ``/metrics``; their KV circuit breakers feed
``KVTransferHealthy``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from ..engine.contracts import metrics as m
from .manifests import LABEL_ROLE
from .parallelism import LABEL_GROUP_ROLE, WORKER

# Counters of failed KV pulls: pdfleet's native name and vLLM's NIXL names.
KV_FAILURE_METRICS = (
    *m.names(m.ENGINE_KV_TRANSFER_FAILURES),
    m.VLLM_NIXL_NUM_FAILED_TRANSFERS_UNSUFFIXED,
)
# Counters of completed (successful) KV pulls.
KV_TRANSFER_METRICS = (m.ENGINE_KV_TRANSFERS.name,)
# A gateway's gauge: 1 per (prefill, decode) pair whose KV circuit breaker is open.
KV_PAIR_OPEN_METRIC = m.GATEWAY_KV_PAIR_OPEN.name
# A decode engine's KVTransferDegraded gauge (pull bandwidth under min_pull_gbps).
KV_DEGRADED_METRIC = m.ENGINE_KV_TRANSFER_DEGRADED.name
KV_BANDWIDTH_METRIC = m.ENGINE_KV_PULL_BANDWIDTH.name


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
    startup_seconds: float | None = None
    """Its creation to its Ready condition (:func:`pod_startup_seconds`)."""


def activation_key(role: str) -> str:
    """The values key of a gateway's activation counter for one role."""
    return f"{m.GATEWAY_ACTIVATIONS.name}:{role}"


# The values key of a gateway's running Batch API requests (its
# ``pdfleet_gateway_batch_requests{state="running"}``).
BATCH_RUNNING_KEY = f"{m.GATEWAY_BATCH_REQUESTS.name}:running"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: sum over label sets}; the
    gateway's activation counter also per role (:func:`activation_key`), as
    the autoscaler reads it by role, and its running batch requests
    (:data:`BATCH_RUNNING_KEY`)."""
    scrape = m.parse_metrics(text)
    values = scrape.totals()
    for labels, value in scrape.samples.get(m.GATEWAY_ACTIVATIONS.name, ()):
        key = activation_key(labels.get(m.ROLE, ""))
        values[key] = values.get(key, 0.0) + value
    for labels, value in scrape.samples.get(m.GATEWAY_BATCH_REQUESTS.name, ()):
        if labels.get(m.BATCH_STATE) == m.BATCH_RUNNING:
            values[BATCH_RUNNING_KEY] = values.get(BATCH_RUNNING_KEY, 0.0) + value
    return values


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


def _ready_condition(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's Ready condition while it is True, else None."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next(
        (c for c in conditions if c.get("type") == "Ready" and c.get("status") == "True"), None
    )


def pod_ready(pod: Mapping[str, Any]) -> bool:
    return _ready_condition(pod) is not None


def _timestamp(text: Any) -> datetime | None:
    """An RFC 3339 time as the API server writes it (``2026-12-02T18:00:00Z``)."""
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def pod_startup_seconds(pod: Mapping[str, Any]) -> float | None:
    """Seconds from the pod's ``creationTimestamp`` to the ``lastTransitionTime``
    of its Ready condition, while that condition is True: the cold start the
    pod took (scheduling, image pull, model load, warm-up). None when the pod
    is not ready or either time is missing or unreadable. The API server
    writes both to the second, so this is whole seconds."""
    ready = _ready_condition(pod)
    if ready is None:
        return None
    created = _timestamp((pod.get("metadata") or {}).get("creationTimestamp"))
    became = _timestamp(ready.get("lastTransitionTime"))
    if created is None or became is None or became < created:
        return None
    return (became - created).total_seconds()


async def scrape_pods(
    pods: Sequence[Mapping[str, Any]],
    *,
    timeout_seconds: float = 2.0,
    clock: Callable[[], float] = time.time,
    token: str | None = None,
    gateways: bool = False,
) -> list[PodSample]:
    """Scrape every engine pod (and gateway pod with ``gateways``)
    concurrently; each request is bounded by the timeout."""

    async def one(http: httpx.AsyncClient, pod: Mapping[str, Any]) -> PodSample:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "?")
        role = (meta.get("labels") or {}).get(LABEL_ROLE, "?")
        sample = functools.partial(
            PodSample, name, role, pod_ready(pod), startup_seconds=pod_startup_seconds(pod)
        )
        url = metrics_url(pod)
        if url is None:
            return sample(clock(), error="no pod IP yet")
        try:
            response = await http.get(url)
            response.raise_for_status()
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError) as e:
            return sample(clock(), error=f"{url}: {e!r}")
        return sample(clock(), values=values)

    def scraped(pod: Mapping[str, Any]) -> bool:
        labels = pod.get("metadata", {}).get("labels") or {}
        if labels.get(LABEL_GROUP_ROLE) == WORKER:
            return False  # ranks only: a group's leader serves its /metrics
        return gateways or labels.get(LABEL_ROLE) != "gateway"

    engine_pods = [p for p in pods if scraped(p)]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds), headers=headers) as http:
        return list(await asyncio.gather(*(one(http, p) for p in engine_pods)))


def _counter(sample: PodSample, names: Sequence[str]) -> float | None:
    found = [sample.values[n] for n in names if n in sample.values]
    return max(found) if found else None


def kv_failures(sample: PodSample) -> float | None:
    return _counter(sample, KV_FAILURE_METRICS)


@dataclass(frozen=True)
class KVVerdict:
    """The ``KVTransferHealthy`` condition's inputs."""

    healthy: bool | None
    """``None`` while no engine reports the counters."""
    reason: str
    message: str


class KVHealth:
    """Failed vs all KV pulls of one service over a sliding window.

    Each scrape adds, per pod, how much its failure and success counters
    grew since the previous scrape (a counter that went down was reset by a
    restart: its new value is the growth). The window keeps the growth of
    pods that went away, so a crashing engine still counts. Unhealthy when
    more than ``max_failure_ratio`` of the window's pulls failed, or while a
    gateway's KV circuit breaker keeps an engine pair out of disaggregation.
    """

    def __init__(self, window_seconds: float = 300.0, max_failure_ratio: float = 0.05) -> None:
        if window_seconds <= 0 or not 0 <= max_failure_ratio < 1:
            raise ValueError("KVHealth: window_seconds > 0 and 0 <= max_failure_ratio < 1")
        self.window_seconds = window_seconds
        self.max_failure_ratio = max_failure_ratio
        self._last: dict[str, tuple[float, float]] = {}
        # (scraped_at, pod, failed, succeeded) growth per scrape, oldest first.
        self._growth: deque[tuple[float, str, float, float]] = deque()

    def update(self, samples: Sequence[PodSample]) -> KVVerdict:
        seen = False
        now = max((s.scraped_at for s in samples), default=None)
        current: dict[str, tuple[float, float]] = {}
        open_pairs = {
            s.pod: s.values[KV_PAIR_OPEN_METRIC]
            for s in samples
            if s.role == "gateway" and s.values.get(KV_PAIR_OPEN_METRIC, 0) > 0
        }
        for sample in samples:
            if sample.role == "gateway":
                continue
            failed = kv_failures(sample)
            if failed is None:
                continue
            seen = True
            ok = _counter(sample, KV_TRANSFER_METRICS) or 0.0
            current[sample.pod] = (failed, ok)
            before = self._last.get(sample.pod)
            if before is not None:
                grew_failed = failed - before[0] if failed >= before[0] else failed
                grew_ok = ok - before[1] if ok >= before[1] else ok
                self._growth.append((sample.scraped_at, sample.pod, grew_failed, grew_ok))
        # A pod that did not answer keeps its last values (it may answer next
        # time); a pod that is gone is forgotten.
        listed = {s.pod for s in samples}
        self._last = {**{p: v for p, v in self._last.items() if p in listed}, **current}
        if now is not None:
            while self._growth and self._growth[0][0] < now - self.window_seconds:
                self._growth.popleft()
        by_pod: dict[str, float] = {}
        for _, pod, grew_failed, _ in self._growth:
            if grew_failed:
                by_pod[pod] = by_pod.get(pod, 0.0) + grew_failed
        failed = sum(by_pod.values())
        total = failed + sum(g[3] for g in self._growth)
        window = f"the last {self.window_seconds:g}s"
        breakers = ""
        if open_pairs:
            breakers = "open KV circuit breakers (engine pairs left out of disaggregation): "
            breakers += ", ".join(f"{pod} {n:g}" for pod, n in sorted(open_pairs.items()))
        if failed > 0 and failed > self.max_failure_ratio * total:
            return KVVerdict(
                False,
                "KVTransferDegraded",
                f"{failed:g} of {total:g} KV pulls failed in {window} "
                f"(more than {self.max_failure_ratio:.0%}): "
                + ", ".join(f"{pod} +{n:g}" for pod, n in sorted(by_pod.items()))
                + (f"; {breakers}" if breakers else ""),
            )
        if breakers:
            return KVVerdict(False, "KVCircuitOpen", breakers)
        slow = {
            s.pod: s.values.get(KV_BANDWIDTH_METRIC, 0.0)
            for s in samples
            if s.role != "gateway" and s.values.get(KV_DEGRADED_METRIC, 0) > 0
        }
        if slow:
            return KVVerdict(
                False,
                "KVPullBandwidthLow",
                "KV pull bandwidth under min_pull_gbps (UCX on TCP only? see docs/gpu.md): "
                + ", ".join(f"{pod} {bw / 1e9:.3g} GB/s" for pod, bw in sorted(slow.items())),
            )
        if not seen and not self._growth:
            return KVVerdict(None, "NoMetrics", "no engine reports KV-transfer counters yet")
        if failed == 0:
            return KVVerdict(
                True, "NoFailedTransfers", f"{total:g} KV pulls in {window}, none failed"
            )
        return KVVerdict(
            True,
            "FewFailedTransfers",
            f"{failed:g} of {total:g} KV pulls failed in {window} "
            f"(at most {self.max_failure_ratio:.0%})",
        )
