"""The headline load figures of each role, from one scrape of its engine pods.

They go into ``status.roles.<role>`` (``running``, ``waiting``,
``kvCacheUsage``, ``prefixHitRate`` and the one-line ``load``), which
``kubectl get pdsvc -o wide`` prints, and are the figures `pdfleet status`
shows per engine (docs/observability.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..engine.contracts import metrics as m
from .scrape import PodSample
from .status import role_figures

RUNNING = m.ENGINE_NUM_REQUESTS_RUNNING.name
WAITING = m.ENGINE_NUM_REQUESTS_WAITING.name
KV_USAGE = m.ENGINE_KV_CACHE_USAGE.name
PREFIX_HITS = m.ENGINE_PREFIX_CACHE_HITS.name
PREFIX_QUERIES = m.ENGINE_PREFIX_CACHE_QUERIES.name


def role_load(samples: Iterable[PodSample]) -> dict[str, dict[str, Any]]:
    """role -> figures over its ready, answering pods: requests summed, KV usage
    averaged, prefix hit rate as hits over lookups since the engines started."""
    by_role: dict[str, list[PodSample]] = {}
    for s in samples:
        if s.error is None and s.ready and s.role in ("prefill", "decode"):
            by_role.setdefault(s.role, []).append(s)
    out = {}
    for role, pods in by_role.items():
        running = int(sum(p.values.get(RUNNING, 0.0) for p in pods))
        waiting = int(sum(p.values.get(WAITING, 0.0) for p in pods))
        kv = sum(p.values.get(KV_USAGE, 0.0) for p in pods) / len(pods)
        queries = sum(p.values.get(PREFIX_QUERIES, 0.0) for p in pods)
        hits = sum(p.values.get(PREFIX_HITS, 0.0) for p in pods)
        hit_rate = hits / queries if queries else None
        out[role] = role_figures(running, waiting, kv, hit_rate)
    return out


def merge_role_load(patch: Any, samples: Iterable[PodSample]) -> None:
    """Add the figures to the status patch's ``roles`` (a refresh's scrape)."""
    roles = patch.setdefault("status", {}).setdefault("roles", {})
    for role, figures in role_load(samples).items():
        roles.setdefault(role, {}).update(figures)
