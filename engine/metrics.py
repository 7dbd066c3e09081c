"""Prometheus metrics of one engine, built from the metrics contract
(``engine/contracts/metrics.py``, documented in docs/metrics.md).

Each series is a row of a table below that says where its value comes from;
the series that vLLM also names (the model-server-protocol subset and the NIXL
counters) are exported under both names, so existing routers, KEDA recipes and
dashboards work against pdfleet pods unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from .config import EngineConfig
from .contracts import metrics as m
from .kv_transfer.base import KVConnectorStats
from .loop.engine_core import EngineCore
from .loop.llm_engine import LLMEngine

if TYPE_CHECKING:  # xgrammar loads on the first constrained request
    from .sample.grammar import GrammarCompiler


class CompileGateFigures(Protocol):
    """What the exporter reads of the server's grammar compile gate."""

    @property
    def busy(self) -> int:
        """Compiles running."""
        ...

    @property
    def num_refused(self) -> int:
        """Compiles refused so far (cumulative)."""
        ...

    @property
    def waiting(self) -> Sized:
        """Compiles waiting for a worker."""
        ...


# Gauges set after each step: series -> field of the engine's StepStats.
_GAUGES = {
    m.ENGINE_NUM_REQUESTS_RUNNING: "num_running_reqs",
    m.ENGINE_NUM_REQUESTS_WAITING: "num_waiting_reqs",
    m.ENGINE_NUM_REQUESTS_WAITING_FOR_SLOT: "num_waiting_for_slot_reqs",
    m.ENGINE_KV_CACHE_USAGE: "kv_cache_usage",
    m.ENGINE_WAITING_PROMPT_TOKENS: "waiting_prompt_tokens",
    m.ENGINE_KV_TRANSFER_HELD_REQUESTS: "num_held_blocks_reqs",
    m.ENGINE_KV_OFFLOAD_BLOCKS: "host_kv_used_blocks",
    m.ENGINE_KV_OFFLOAD_CAPACITY: "host_kv_num_blocks",
}
# Counters that follow a cumulative StepStats field (incremented by its growth).
_CUMULATIVE = {
    m.ENGINE_PREFIX_CACHE_QUERIES: "prefix_cache_queries",
    m.ENGINE_PREFIX_CACHE_HITS: "prefix_cache_hits",
    m.ENGINE_NUM_PREEMPTIONS: "num_preemptions",
    m.ENGINE_KV_OFFLOAD_HIT_TOKENS: "host_kv_hit_tokens",
    m.ENGINE_KV_OFFLOAD_STORED_BYTES: "host_kv_stored_bytes",
    m.ENGINE_KV_OFFLOAD_LOADED_BYTES: "host_kv_loaded_bytes",
    m.ENGINE_KV_OFFLOAD_EVICTIONS: "host_kv_evicted_blocks",
}
# Counters incremented by a per-step StepStats count, once per engine step.
_PER_STEP = {
    m.ENGINE_PROMPT_TOKENS: "step_prompt_tokens",
    m.ENGINE_GENERATION_TOKENS: "step_generation_tokens",
}
# Histograms observed per finished request, plus the two observed per token.
_LATENCIES = (m.ENGINE_TTFT, m.ENGINE_ITL, m.ENGINE_E2E, m.ENGINE_QUEUE_TIME)
# Engines with a KV connector: counters -> cumulative field of the connector's stats.
_KV_COUNTERS = {
    m.ENGINE_KV_TRANSFER_BYTES: "bytes_transferred",
    m.ENGINE_KV_TRANSFER_BLOCKS_PULLED: "blocks_pulled",
    m.ENGINE_KV_TRANSFERS: "transfers",
    m.ENGINE_KV_TRANSFER_FAILURES: "failed_transfers",
    m.ENGINE_KV_TRANSFER_EXPIRED_LEASES: "expired_leases",
    m.ENGINE_KV_TRANSFER_HANDSHAKES: "handshakes",
    m.ENGINE_KV_TRANSFER_HANDSHAKE_FAILURES: "failed_handshakes",
    m.ENGINE_KV_TRANSFER_UNCONFIRMED: "unconfirmed_transfers",
    m.ENGINE_KV_TRANSFER_CONTENT_MISMATCHES: "content_mismatches",
    m.ENGINE_KV_REMOTE_EVICTIONS: "remote_evictions",
    m.ENGINE_KV_SIDE_CHANNEL_REFUSED: "refused_reads",
}
# Engines with a KV connector: gauges of the connector's state.
_KV_GAUGES = (
    m.ENGINE_KV_QUARANTINED_BLOCKS,
    m.ENGINE_KV_PULLS_IN_FLIGHT,
    m.ENGINE_KV_REMOTE_ENGINES,
    m.ENGINE_KV_PULL_BANDWIDTH,
    m.ENGINE_KV_TRANSFER_DEGRADED,
)


# The grammar compiler's and the compile gate's figures (read at each scrape).
_GRAMMAR = (
    m.ENGINE_GRAMMAR_CACHE_BYTES,
    m.ENGINE_GRAMMAR_COMPILES,
    m.ENGINE_GRAMMAR_COMPILE_TIMEOUTS,
    m.ENGINE_GRAMMAR_COMPILES_REFUSED,
    m.ENGINE_GRAMMAR_COMPILES_RUNNING,
    m.ENGINE_GRAMMAR_COMPILES_WAITING,
)


class EngineMetrics:
    """The engine's series on one registry; :meth:`update` runs after each step."""

    def __init__(
        self,
        config: EngineConfig,
        registry: CollectorRegistry | None = None,
        resume_identity: str | None = None,
    ) -> None:
        """``resume_identity``: the server's (its chat options are factors);
        the engine config's alone when None."""
        self.registry = registry or CollectorRegistry()
        self.labels = {m.MODEL_NAME: config.model_config.name}
        kv = config.kv_transfer_config
        self.has_kv = kv is not None and bool(kv.kv_connector)
        table: list[m.Metric] = [
            *_GAUGES,
            *_CUMULATIVE,
            m.ENGINE_PREFILL_BUSY_SECONDS,
            m.ENGINE_FAILED_STEPS,
            m.ENGINE_STEP_DURATION,
            m.ENGINE_STEP_RUNNING,
            m.ENGINE_STEP_SCHEDULED_TOKENS,
            m.ENGINE_MAX_NUM_BATCHED_TOKENS,
            m.ENGINE_MAX_NUM_SEQS,
            *_PER_STEP,
            *_LATENCIES,
            *_GRAMMAR,
        ]
        if self.has_kv:
            table += [*_KV_COUNTERS, *_KV_GAUGES, m.ENGINE_KV_TRANSFER_SECONDS]
        lora = getattr(config, "lora_config", None)
        self.max_lora = lora.max_loras if lora is not None else 0
        if lora is not None:
            table += [
                m.ENGINE_LORA_ADAPTERS,
                m.ENGINE_LORA_ADAPTERS_ON_DEVICE,
                m.ENGINE_LORA_LOADS,
                m.ENGINE_LORA_LOAD_SECONDS,
            ]
        self._series: dict[m.Metric, tuple[Any, ...]] = {}
        for metric in table:
            # Every series is touched so it is exported (as 0) from the start.
            self._series[metric] = tuple(
                family.labels(**self.labels) for family in self._register(metric)
            )
        self._set(m.ENGINE_MAX_NUM_BATCHED_TOKENS, config.scheduler_config.max_num_batched_tokens)
        self._set(m.ENGINE_MAX_NUM_SEQS, config.scheduler_config.max_num_seqs)
        # Labelled by rank; shard 0 (every engine has it) is exported from the start.
        self.shard_bytes = None
        if self.has_kv:
            self.shard_bytes = m.ENGINE_KV_TRANSFER_SHARD_BYTES.create(self.registry)
            self.shard_bytes.labels(**self.labels, **{m.KV_SHARD: "0"})
        self._last_shard_bytes: list[int] = []
        # Labelled by producer engine id as pulls complete (peer pulls' cost model).
        self.peer_pulls: tuple[Any, ...] = ()
        self._last_peer: dict[tuple[int, str], float] = {}
        if self.has_kv:
            self.peer_pulls = tuple(
                metric.create(self.registry)
                for metric in (
                    m.ENGINE_KV_PEER_PULLS,
                    m.ENGINE_KV_PEER_PULL_BYTES,
                    m.ENGINE_KV_PEER_PULL_SECONDS,
                )
            )
            self._series[m.ENGINE_KV_BLOCK_BYTES] = tuple(
                f.labels(**self.labels) for f in self._register(m.ENGINE_KV_BLOCK_BYTES)
            )
        # Labelled by finish reason as requests finish, so not touched up front.
        self.request_success = m.ENGINE_REQUEST_SUCCESS.create(self.registry)
        cache = config.cache_config
        self.resume_identity = resume_identity or config.resume_identity()
        cache_labels = dict(
            zip(
                m.CACHE_CONFIG_LABELS,
                (
                    str(cache.block_size),
                    str(cache.num_gpu_blocks),
                    config.kv_cache_dtype,
                    str(cache.enable_prefix_caching),
                    config.compat_hash(),
                    cache.prefix_caching_hash_algo,
                    self.resume_identity,
                ),
                strict=True,
            )
        )
        m.ENGINE_CACHE_CONFIG.create(self.registry).info(cache_labels)
        m.VLLM_CACHE_CONFIG_INFO.create(self.registry).labels(**cache_labels).set(1)
        self._last: dict[m.Metric, float] = {}
        self._last_step = 0
        if lora is not None:
            self.lora_evictions = m.ENGINE_LORA_EVICTIONS.create(self.registry)
            for tier in ("device", "host"):
                self.lora_evictions.labels(**self.labels, **{m.LORA_TIER: tier})
            self.lora_requests = m.ENGINE_LORA_REQUESTS.create(self.registry)
            self.lora_info = m.VLLM_LORA_REQUESTS_INFO.create(self.registry)
            self.adapter_info = m.ENGINE_LORA_ADAPTER_INFO.create(self.registry)
            self._adapters: dict[str, tuple[str, str]] = {}
            self.adapter_resident = m.ENGINE_LORA_ADAPTER_RESIDENT.create(self.registry)
            self._resident: dict[str, str] = {}
            self._lora_info_labels: tuple[str, str, str] | None = None
            self._lora_counts: dict[str, float] = {}
            self._update_lora_info((), ())

    def _register(self, metric: m.Metric) -> list[Any]:
        """The native family and, where vLLM names it too, its vLLM twin."""
        families = [metric.create(self.registry)]
        if metric in m.VLLM_EXPORTED:
            families.append(m.VLLM_ALIASES[metric].create(self.registry))
        return families

    def _set(self, metric: m.Metric, value: float) -> None:
        for series in self._series[metric]:
            series.set(value)

    def _grow(self, metric: m.Metric, cumulative: float) -> None:
        """Increment a counter by the growth of the cumulative value it follows."""
        delta = cumulative - self._last.get(metric, 0)
        self._last[metric] = cumulative
        if delta > 0:
            for series in self._series[metric]:
                series.inc(delta)

    def _observe(self, metric: m.Metric, values: list[float]) -> None:
        for series in self._series[metric]:
            for v in values:
                series.observe(v)

    def update(self, engine: LLMEngine) -> None:
        """Called on the engine thread after each step."""
        s = engine.stats
        for metric, field in _GAUGES.items():
            self._set(metric, getattr(s, field))
        for metric, field in _CUMULATIVE.items():
            self._grow(metric, getattr(s, field))
        self._grow(m.ENGINE_PREFILL_BUSY_SECONDS, engine.core.busy_prefill_seconds)
        # Steps whose model run raised (their requests were failed; the engine served on).
        self._grow(m.ENGINE_FAILED_STEPS, engine.core.num_failed_steps)
        if engine.core.num_steps != self._last_step:  # per-step counts, once per step
            self._last_step = engine.core.num_steps
            for metric, field in _PER_STEP.items():
                for series in self._series[metric]:
                    series.inc(getattr(s, field))
            self._observe(m.ENGINE_STEP_DURATION, [s.step_seconds])
        if self.has_kv and engine.connector is not None:
            kv = engine.connector.scheduler.stats_snapshot()
            if kv is not None:
                self._update_kv(kv)
        if self.max_lora:
            self._update_lora(engine)
        it = engine.take_iteration_stats()
        self._observe(m.ENGINE_TTFT, it.time_to_first_token)
        self._observe(m.ENGINE_ITL, it.inter_token_latency)
        for reason, e2e, queue_s, _prompt, _gen in it.finished:
            self.request_success.labels(**self.labels, **{m.FINISHED_REASON: reason}).inc()
            self._observe(m.ENGINE_E2E, [e2e])
            self._observe(m.ENGINE_QUEUE_TIME, [queue_s])

    def update_kv_layout(self, engine: LLMEngine) -> None:
        """Once, before serving (loader thread): the KV bytes a pull moves per
        block. The gateway's peer-pull decision takes an engine without it for one
        that cannot pull, so an engine that has served nothing yet must show it
        too (``update`` runs only after steps)."""
        if self.has_kv and engine.connector is not None:
            kv = engine.connector.scheduler.stats_snapshot()
            if kv is not None and kv.block_bytes is not None:
                self._set(m.ENGINE_KV_BLOCK_BYTES, kv.block_bytes)

    def update_adapters(self, engine: LLMEngine) -> None:
        """Publish the LoRA series alone: at start, so the adapters of
        --lora-modules are in /metrics (where the gateway learns which engine
        serves which adapter) before the first step."""
        if self.max_lora:
            self._update_lora(engine)

    def _update_lora(self, engine: LLMEngine) -> None:
        self._set(m.ENGINE_LORA_ADAPTERS, len(engine.loras))
        stats = engine.core.runner.lora_stats()
        if stats is not None:  # tensor-parallel engines keep them in the ranks
            self._set(m.ENGINE_LORA_ADAPTERS_ON_DEVICE, len(stats.loaded))
            self._grow(m.ENGINE_LORA_LOADS, stats.loads)
            self._grow(m.ENGINE_LORA_LOAD_SECONDS, stats.load_seconds)
            for tier, value in (("device", stats.gpu_evictions), ("host", stats.cpu_evictions)):
                key = f"evictions:{tier}"
                delta = value - self._lora_counts.get(key, 0)
                if delta > 0:
                    self.lora_evictions.labels(**self.labels, **{m.LORA_TIER: tier}).inc(delta)
                self._lora_counts[key] = value
            # Served adapters only (a tensor-parallel rank keeps an unloaded
            # adapter's shards until its cache evicts them).
            loaded = engine.loras
            self._update_resident({n: t for n, t in stats.resident.items() if n in loaded})
        for name, count in engine.lora_requests.items():
            key = f"requests:{name}"
            delta = count - self._lora_counts.get(key, 0)
            if delta > 0:
                self.lora_requests.labels(**self.labels, **{m.LORA_NAME: name}).inc(delta)
            self._lora_counts[key] = count
        s = engine.stats
        self._update_lora_info(s.running_lora_adapters, s.waiting_lora_adapters)
        served = {
            name: (engine.lora_identities.get(name, ""), lora.lora_path)
            for name, lora in list(engine.loras.items())
        }
        if served != self._adapters:
            for name, (identity, path) in self._adapters.items():
                self.adapter_info.remove(self.labels[m.MODEL_NAME], name, identity, path)
            for name, (identity, path) in served.items():
                self.adapter_info.labels(
                    **self.labels,
                    **{m.LORA_NAME: name, m.LORA_IDENTITY: identity, m.LORA_PATH: path},
                ).set(1)
            self._adapters = served

    def _update_resident(self, resident: dict[str, str]) -> None:
        """One series per resident adapter, labelled by its tier; a series whose
        adapter left (or changed tier) is removed."""
        if resident == self._resident:
            return
        model = self.labels[m.MODEL_NAME]
        for name, tier in self._resident.items():
            if resident.get(name) != tier:
                self.adapter_resident.remove(model, name, tier)
        for name, tier in resident.items():
            self.adapter_resident.labels(
                **self.labels, **{m.LORA_NAME: name, m.LORA_TIER: tier}
            ).set(1)
        self._resident = resident

    def _update_lora_info(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        """One series, as vLLM's: the current adapters as labels, the time of the
        update as value; the previous label set is removed when it changes."""
        labels = (",".join(running), ",".join(waiting), str(self.max_lora))
        if labels != self._lora_info_labels:
            if self._lora_info_labels is not None:
                self.lora_info.remove(*self._lora_info_labels)
            self._lora_info_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def update_step(self, core: EngineCore) -> None:
        """The step in progress (event loop, at a scrape: the engine thread may
        be inside a step): its age in seconds and its scheduled tokens, 0 between
        steps."""
        started = core.step_started  # read once: the engine thread clears it
        running = 0.0 if started is None else max(0.0, time.monotonic() - started)
        self._set(m.ENGINE_STEP_RUNNING, running)
        self._set(m.ENGINE_STEP_SCHEDULED_TOKENS, core.step_scheduled_tokens if running else 0)

    def update_grammars(
        self, grammars: GrammarCompiler | None, gate: CompileGateFigures | None
    ) -> None:
        """The grammar cache's and the compile gate's state (event loop, at a
        scrape: they change between engine steps). ``grammars`` may be None
        (no constrained request yet)."""
        if grammars is not None:
            self._set(m.ENGINE_GRAMMAR_CACHE_BYTES, grammars.cache_bytes)
            self._grow(m.ENGINE_GRAMMAR_COMPILES, grammars.num_compiled)
            self._grow(m.ENGINE_GRAMMAR_COMPILE_TIMEOUTS, grammars.pool.num_timeouts)
        if gate is not None:
            self._grow(m.ENGINE_GRAMMAR_COMPILES_REFUSED, gate.num_refused)
            self._set(m.ENGINE_GRAMMAR_COMPILES_RUNNING, gate.busy)
            self._set(m.ENGINE_GRAMMAR_COMPILES_WAITING, len(gate.waiting))

    def _update_kv(self, kv: KVConnectorStats) -> None:
        self._set(m.ENGINE_KV_QUARANTINED_BLOCKS, kv.quarantined_blocks)
        self._set(m.ENGINE_KV_REMOTE_ENGINES, kv.remote_engines)
        self._set(m.ENGINE_KV_PULLS_IN_FLIGHT, kv.pulls_in_flight)
        self._set(m.ENGINE_KV_PULL_BANDWIDTH, kv.pull_bandwidth)
        self._set(m.ENGINE_KV_TRANSFER_DEGRADED, int(kv.degraded))
        for metric, field in _KV_COUNTERS.items():
            self._grow(metric, getattr(kv, field))
        self._observe(m.ENGINE_KV_TRANSFER_SECONDS, list(kv.transfer_seconds))
        if kv.block_bytes is not None:
            self._set(m.ENGINE_KV_BLOCK_BYTES, kv.block_bytes)
        for producer, row in kv.per_producer.items():
            for i, (family, value) in enumerate(zip(self.peer_pulls, row, strict=True)):
                delta = value - self._last_peer.get((i, producer), 0.0)
                self._last_peer[(i, producer)] = value
                if delta > 0:
                    family.labels(**self.labels, **{m.KV_PRODUCER: producer}).inc(delta)
        by_rank = list(kv.shard_bytes)
        last = self._last_shard_bytes + [0] * (len(by_rank) - len(self._last_shard_bytes))
        for rank, (now, before) in enumerate(zip(by_rank, last, strict=True)):
            if now > before and self.shard_bytes is not None:
                self.shard_bytes.labels(**self.labels, **{m.KV_SHARD: str(rank)}).inc(now - before)
        self._last_shard_bytes = by_rank
