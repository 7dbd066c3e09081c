"""Prometheus metrics of one engine (docs/serving.md, "Metrics").

Native names follow ``pdfleet_engine_<name>_<unit>``; the vLLM names of the
model-server-protocol subset are exported too, so existing routers, KEDA
recipes and dashboards work against pdfleet pods unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from .buckets import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from .config import EngineConfig
from .llm_engine import LLMEngine


class EngineMetrics:
    def __init__(self, config: EngineConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        model = config.model_config.name
        labels = ["model_name"]
        self.labels = {"model_name": model}
        p = "pdfleet_engine_"
        self.running = Gauge(
            p + "num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self.waiting = Gauge(
            p + "num_requests_waiting",
            "Requests waiting to be scheduled (incl. waiting for remote KV).",
            labels,
            registry=r,
        )
        self.kv_usage = Gauge(
            p + "kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (0-1).",
            labels,
            registry=r,
        )
        self.waiting_prompt_tokens = Gauge(
            p + "waiting_prompt_tokens",
            "Prompt tokens of queued requests not yet computed (uncached backlog).",
            labels,
            registry=r,
        )
        self.prefix_queries = Counter(
            p + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
        )
        self.preemptions = Counter(
            p + "num_preemptions", "Requests preempted (recomputed later).", labels, registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens computed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.prefill_busy = Counter(
            p + "prefill_busy_seconds",
            "Seconds of engine steps that computed prompt tokens.",
            labels,
            registry=r,
        )
        # pdfleet_engine_failed_steps_total: steps whose model run raised (their
        # requests were failed; the engine served on).
        self.failed_steps = Counter(
            p + "failed_steps",
            "Engine steps that raised and failed their requests.",
            labels,
            registry=r,
        )
        self.request_success = Counter(
            p + "request_success",
            "Finished requests by reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        cache = config.cache_config
        cache_labels = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(cache.num_gpu_blocks),
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "compat_hash": config.compat_hash(),
        }
        Info(p + "cache_config", "KV-cache configuration.", registry=r).info(cache_labels)
        # vLLM-compatible subset (model-server protocol).
        self.v_running = Gauge(
            "vllm:num_requests_running", "Number of requests running.", labels, registry=r
        )
        self.v_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting.", labels, registry=r
        )
        self.v_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%).", labels, registry=r
        )
        v_info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            list(cache_labels),
            registry=r,
        )
        v_info.labels(**cache_labels).set(1)
        self.held = Gauge(
            p + "kv_transfer_held_requests",
            "Finished prefills whose blocks are held for a decode engine.",
            labels,
            registry=r,
        )
        self.kv = None
        if config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector:
            self.kv = {
                "bytes_transferred": Counter(
                    p + "kv_transfer_bytes", "KV bytes moved between engines.", labels, registry=r
                ),
                "blocks_pulled": Counter(
                    p + "kv_transfer_blocks_pulled",
                    "KV blocks pulled from prefill engines.",
                    labels,
                    registry=r,
                ),
                "transfers": Counter(p + "kv_transfers", "Completed KV pulls.", labels, registry=r),
                "failed_transfers": Counter(
                    p + "kv_transfer_failures", "Failed KV pulls.", labels, registry=r
                ),
                "expired_leases": Counter(
                    p + "kv_transfer_expired_leases",
                    "Held blocks freed because no consumer claimed them.",
                    labels,
                    registry=r,
                ),
                "handshakes": Counter(
                    p + "kv_transfer_handshakes",
                    "Handshakes with remote engines.",
                    labels,
                    registry=r,
                ),
                "failed_handshakes": Counter(
                    p + "kv_transfer_handshake_failures", "Failed handshakes.", labels, registry=r
                ),
                "unconfirmed_transfers": Counter(
                    p + "kv_transfer_unconfirmed",
                    "Pulls whose lease ended before the producer confirmed them (recomputed).",
                    labels,
                    registry=r,
                ),
                "remote_evictions": Counter(
                    p + "kv_remote_evictions",
                    "Cached handshakes with remote engines dropped (size bound or idle TTL).",
                    labels,
                    registry=r,
                ),
                "refused_reads": Counter(
                    p + "kv_side_channel_refused",
                    "Side-channel requests refused (unauthenticated, forged, or naming a lease "
                    "the peer may not use).",
                    labels,
                    registry=r,
                ),
            }
            self.kv_gauges = {
                "quarantined_blocks": Gauge(
                    p + "kv_quarantined_blocks",
                    "Pull-target blocks kept out of the free pool while an abandoned READ "
                    "may still write them.",
                    labels,
                    registry=r,
                ),
                "pulls_in_flight": Gauge(
                    p + "kv_pulls_in_flight",
                    "KV pulls started and not yet finished.",
                    labels,
                    registry=r,
                ),
                "remote_engines": Gauge(
                    p + "kv_remote_engines",
                    "Remote engines whose handshake is cached.",
                    labels,
                    registry=r,
                ),
            }
            self.kv_seconds = Histogram(
                p + "kv_transfer_seconds",
                "Duration of one KV pull.",
                labels,
                buckets=ITL_BUCKETS,
                registry=r,
            )
            # vLLM's NIXL metric names where they map.
            self.v_kv = {
                "failed_transfers": Counter(
                    "vllm:nixl_num_failed_transfers", "Failed KV transfers.", labels, registry=r
                ),
                "expired_leases": Counter(
                    "vllm:nixl_num_kv_expired_reqs",
                    "Requests whose held KV expired.",
                    labels,
                    registry=r,
                ),
            }
            self.v_kv_seconds = Histogram(
                "vllm:nixl_xfer_time_seconds",
                "KV transfer time.",
                labels,
                buckets=ITL_BUCKETS,
                registry=r,
            )
            self._last_kv: dict[str, int] = {}
        # Touch every labelled series so it is exported (as 0) from the start.
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.waiting_prompt_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefill_busy,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.v_running,
            self.v_waiting,
            self.v_kv_usage,
            *(self.kv.values() if self.kv else ()),
            *(self.kv_gauges.values() if self.kv else ()),
            *(self.v_kv.values() if self.kv else ()),
            *((self.kv_seconds, self.v_kv_seconds) if self.kv else ()),
        ):
            metric.labels(**self.labels)
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_busy = 0.0
        self._last_failed_steps = 0
        self._last_step = 0

    def update(self, engine: LLMEngine) -> None:
        """Called on the engine thread after each step."""
        s = engine.stats
        lab = self.labels
        for gauge, value in (
            (self.running, s.num_running_reqs),
            (self.v_running, s.num_running_reqs),
            (self.waiting, s.num_waiting_reqs),
            (self.v_waiting, s.num_waiting_reqs),
            (self.kv_usage, s.kv_cache_usage),
            (self.v_kv_usage, s.kv_cache_usage),
            (self.waiting_prompt_tokens, s.waiting_prompt_tokens),
            (self.held, s.num_held_blocks_reqs),
        ):
            gauge.labels(**lab).set(value)
        self.prefix_queries.labels(**lab).inc(max(0, s.prefix_cache_queries - self._last_queries))
        self.prefix_hits.labels(**lab).inc(max(0, s.prefix_cache_hits - self._last_hits))
        self.preemptions.labels(**lab).inc(max(0, s.num_preemptions - self._last_preemptions))
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._last_preemptions = s.num_preemptions
        busy = engine.core.busy_prefill_seconds
        self.prefill_busy.labels(**lab).inc(max(0.0, busy - self._last_busy))
        self._last_busy = busy
        failed = engine.core.num_failed_steps
        self.failed_steps.labels(**lab).inc(max(0, failed - self._last_failed_steps))
        self._last_failed_steps = failed
        if engine.core.num_steps != self._last_step:  # per-step counts, once per step
            self._last_step = engine.core.num_steps
            self.prompt_tokens.labels(**lab).inc(s.step_prompt_tokens)
            self.generation_tokens.labels(**lab).inc(s.step_generation_tokens)
        if self.kv is not None and engine.connector is not None:
            self._update_kv(engine.connector[0].c)
        it = engine.take_iteration_stats()
        for v in it.time_to_first_token:
            self.ttft.labels(**lab).observe(v)
        for v in it.inter_token_latency:
            self.itl.labels(**lab).observe(v)
        for reason, e2e, queue_s, _prompt, _gen in it.finished:
            self.request_success.labels(**lab, finished_reason=reason).inc()
            self.e2e.labels(**lab).observe(e2e)
            self.queue_time.labels(**lab).observe(queue_s)

    def _update_kv(self, connector) -> None:
        lab = self.labels
        with connector.lock:
            stats = connector.stats
            seconds, stats.transfer_seconds = stats.transfer_seconds, []
            values = {name: getattr(stats, name) for name in self.kv}
            num_remotes = len(connector.remotes)
            in_flight = len(connector.active)
        if connector.server is not None:
            values["refused_reads"] += connector.server.num_rejected
        self.kv_gauges["quarantined_blocks"].labels(**lab).set(connector.num_quarantined_blocks)
        self.kv_gauges["remote_engines"].labels(**lab).set(num_remotes)
        self.kv_gauges["pulls_in_flight"].labels(**lab).set(in_flight)
        for name, value in values.items():
            delta = value - self._last_kv.get(name, 0)
            if delta > 0:
                self.kv[name].labels(**lab).inc(delta)
                if name in self.v_kv:
                    self.v_kv[name].labels(**lab).inc(delta)
            self._last_kv[name] = value
        for s in seconds:
            self.kv_seconds.labels(**lab).observe(s)
            self.v_kv_seconds.labels(**lab).observe(s)
