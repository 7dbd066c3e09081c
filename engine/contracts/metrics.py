"""The metrics contract: every metric name pdfleet exports or reads, with its
labels, and the one parser of ``/metrics`` text (see docs/metrics.md).

Engines, the gateway and the operator build their Prometheus series from the
:class:`Metric` constants below, and every consumer of an engine's
``/metrics`` (the gateway's routing, the operator's scrape, the autoscaler's
samples) reads it through :func:`parse_metrics`. A name is written out once,
here, as it appears in the exposition text: counters end in ``_total``, info
series in ``_info``; a histogram's ``_sum``/``_count`` come from
:attr:`Metric.sum` and :attr:`Metric.count`.

Imports nothing beyond the standard library at import time: the operator and
the gateway run without torch, and ``prometheus_client`` is loaded only by the
functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

MetricKind = Literal["counter", "gauge", "histogram", "info"]

# Histogram buckets (seconds), shared by the engine's and the gateway's series
# so a dashboard can put both sides of a request on one scale.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
    15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
)  # fmt: skip


@dataclass(frozen=True)
class Metric:
    """One series family: its exposed name, kind, help text and label names."""

    name: str
    """As exposed: counters end in ``_total``, info series in ``_info``."""
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """Histograms only: the upper bounds in seconds."""

    def __post_init__(self) -> None:
        suffix = {"counter": "_total", "info": "_info"}.get(self.kind)
        if suffix and not self.name.endswith(suffix):
            raise ValueError(f"{self.kind} {self.name!r}: the exposed name must end in {suffix}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name!r}: buckets are given for histograms and only for them")

    @property
    def family(self) -> str:
        """The name prometheus_client is given (it appends ``_total``/``_info``)."""
        for suffix in ("_total", "_info"):
            if self.kind != "gauge" and self.name.endswith(suffix):
                return self.name.removesuffix(suffix)
        return self.name

    @property
    def sum(self) -> str:
        return self.name + "_sum"

    @property
    def count(self) -> str:
        return self.name + "_count"

    def create(self, registry: Any, labels: Iterable[str] | None = None) -> Any:
        """Register this family on a ``prometheus_client`` registry and return it.

        ``labels`` overrides the label names (the cache-config info series
        take theirs from the configuration)."""
        import prometheus_client as prom  # optional dependency: loaded on use

        names = list(self.labels if labels is None else labels)
        if self.kind == "histogram":
            return prom.Histogram(
                self.family, self.help, names, buckets=self.buckets, registry=registry
            )
        if self.kind == "info":  # its labels are the keys of the one info value
            return prom.Info(self.family, self.help, registry=registry)
        cls = prom.Counter if self.kind == "counter" else prom.Gauge
        return cls(self.family, self.help, names, registry=registry)


# Label names. Those a reader of ``/metrics`` selects by (the gateway, the
# autoscaler, ``pdfleet status``) are named here once, for the series that
# writes them and the reader alike.
MODEL_NAME = "model_name"
FINISHED_REASON = "finished_reason"
ROLE = "role"
"""An engine role (``prefill``, ``decode``), or ``gateway``."""
ENGINE = "engine"
"""The gateway's per-engine series: the engine's base URL."""
REASON = "reason"
DECISION = "decision"
BLOCK_SIZE = "block_size"
NUM_GPU_BLOCKS = "num_gpu_blocks"
COMPAT_HASH = "compat_hash"
PREFIX_CACHING_HASH_ALGO = "prefix_caching_hash_algo"
RESUME_IDENTITY = "resume_identity"
CACHE_CONFIG_LABELS = (
    BLOCK_SIZE,
    NUM_GPU_BLOCKS,
    "cache_dtype",
    "enable_prefix_caching",
    COMPAT_HASH,
    PREFIX_CACHING_HASH_ALGO,
    RESUME_IDENTITY,
)
"""Labels of the cache-config info series (both names); the gateway pairs
engines by ``compat_hash``, sizes prompt blocks by ``block_size``, hashes
them with ``prefix_caching_hash_algo`` (docs/kv_events.md) and resumes a
migrated request only on an engine of its first engine's ``resume_identity``
(docs/migration.md)."""

_M = (MODEL_NAME,)

# --- Engine, native names (pdfleet_engine_<name>_<unit>) --------------------
ENGINE_NUM_REQUESTS_RUNNING = Metric(
    "pdfleet_engine_num_requests_running", "gauge", "Requests in the running batch.", _M
)
ENGINE_NUM_REQUESTS_WAITING = Metric(
    "pdfleet_engine_num_requests_waiting",
    "gauge",
    "Requests the last step could not admit for lack of room (incl. waiting for remote KV;"
    " not siblings waiting for an admitted request's prefill).",
    _M,
)
ENGINE_NUM_REQUESTS_WAITING_FOR_SLOT = Metric(
    "pdfleet_engine_num_requests_waiting_for_slot",
    "gauge",
    "Of the requests waiting, those that queue: all when the last step ran out of slots, KV"
    " blocks or adapter slots; else new requests beyond what the next two steps' token budgets"
    " start or beyond the free slots, and a served request's held sequences beyond the free"
    " slots (not those waiting for remote KV).",
    _M,
)
ENGINE_KV_CACHE_USAGE = Metric(
    "pdfleet_engine_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0-1).", _M
)
ENGINE_WAITING_PROMPT_TOKENS = Metric(
    "pdfleet_engine_waiting_prompt_tokens",
    "gauge",
    "Prompt tokens of queued requests not yet computed (uncached backlog).",
    _M,
)
ENGINE_KV_TRANSFER_HELD_REQUESTS = Metric(
    "pdfleet_engine_kv_transfer_held_requests",
    "gauge",
    "Finished prefills whose blocks are held for a decode engine.",
    _M,
)
ENGINE_PREFIX_CACHE_QUERIES = Metric(
    "pdfleet_engine_prefix_cache_queries_total",
    "counter",
    "Prompt tokens looked up in the prefix cache.",
    _M,
)
ENGINE_PREFIX_CACHE_HITS = Metric(
    "pdfleet_engine_prefix_cache_hits_total",
    "counter",
    "Prompt tokens found in the prefix cache.",
    _M,
)
ENGINE_NUM_PREEMPTIONS = Metric(
    "pdfleet_engine_num_preemptions_total",
    "counter",
    "Requests preempted (recomputed later).",
    _M,
)
ENGINE_PROMPT_TOKENS = Metric(
    "pdfleet_engine_prompt_tokens_total", "counter", "Prompt tokens computed.", _M
)
ENGINE_GENERATION_TOKENS = Metric(
    "pdfleet_engine_generation_tokens_total", "counter", "Tokens generated.", _M
)
ENGINE_PREFILL_BUSY_SECONDS = Metric(
    "pdfleet_engine_prefill_busy_seconds_total",
    "counter",
    "Seconds of engine steps that computed prompt tokens.",
    _M,
)
STEP_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
ENGINE_STEP_DURATION = Metric(
    "pdfleet_engine_step_duration_seconds",
    "histogram",
    "Wall time of one engine step (schedule, model run, sampling). The gateway's stall "
    "watchdog learns each engine's longest recent step from it.",
    _M,
    STEP_BUCKETS,
)
ENGINE_STEP_RUNNING = Metric(
    "pdfleet_engine_step_running_seconds",
    "gauge",
    "Age of the engine step in progress at the scrape (0 between steps). Answered by the "
    "HTTP loop while the step runs: the gateway's stall watchdog tells a long step from a "
    "wedged engine by it.",
    _M,
)
ENGINE_STEP_SCHEDULED_TOKENS = Metric(
    "pdfleet_engine_step_scheduled_tokens",
    "gauge",
    "Tokens the engine step in progress scheduled (0 between steps, and until it scheduled).",
    _M,
)
ENGINE_MAX_NUM_BATCHED_TOKENS = Metric(
    "pdfleet_engine_max_num_batched_tokens",
    "gauge",
    "Tokens one engine step may schedule (--max-num-batched-tokens): how much of a "
    "prompt queue one step computes.",
    _M,
)
ENGINE_MAX_NUM_SEQS = Metric(
    "pdfleet_engine_max_num_seqs",
    "gauge",
    "Requests the engine runs at once (--max-num-seqs): with as many running, its "
    "queue waits for a slot.",
    _M,
)
ENGINE_FAILED_STEPS = Metric(
    "pdfleet_engine_failed_steps_total",
    "counter",
    "Engine steps that raised and failed their requests.",
    _M,
)
# LoRA adapters (docs/lora.md), on engines started with --enable-lora.
LORA_NAME = "lora_name"
LORA_IDENTITY = "lora_identity"
LORA_PATH = "lora_path"
LORA_TIER = "tier"
ENGINE_LORA_ADAPTERS = Metric(
    "pdfleet_engine_lora_adapters",
    "gauge",
    "LoRA adapters the engine serves (loaded by --lora-modules or /v1/load_lora_adapter).",
    _M,
)
ENGINE_LORA_ADAPTERS_ON_DEVICE = Metric(
    "pdfleet_engine_lora_adapters_on_device",
    "gauge",
    "LoRA adapters in device slots (at most --max-loras).",
    _M,
)
ENGINE_LORA_LOADS = Metric(
    "pdfleet_engine_lora_loads_total",
    "counter",
    "LoRA adapters read from disk (a load, or a reload after a host-cache eviction).",
    _M,
)
ENGINE_LORA_LOAD_SECONDS = Metric(
    "pdfleet_engine_lora_load_seconds_total",
    "counter",
    "Seconds spent reading LoRA adapters from disk.",
    _M,
)
ENGINE_LORA_EVICTIONS = Metric(
    "pdfleet_engine_lora_evictions_total",
    "counter",
    "LoRA adapters evicted, least recently used first, by tier (device slot or host cache).",
    (*_M, LORA_TIER),
)
ENGINE_LORA_REQUESTS = Metric(
    "pdfleet_engine_lora_requests_total",
    "counter",
    "Requests admitted per LoRA adapter.",
    (*_M, LORA_NAME),
)
ENGINE_LORA_ADAPTER_INFO = Metric(
    # What the gateway routes by: which engine serves which adapter, its
    # prefix-cache identity (engine/contracts/block_hash.py) and directory.
    "pdfleet_engine_lora_adapter_info",
    "gauge",
    "1 per LoRA adapter the engine serves, labelled by its name, identity and directory.",
    (*_M, LORA_NAME, LORA_IDENTITY, LORA_PATH),
)
ENGINE_LORA_ADAPTER_RESIDENT = Metric(
    # What the gateway prefers among the engines that serve an adapter: where
    # its weights are now. One series per adapter in host memory or a device
    # slot, tier = the faster of the two ("device" implies a host copy too,
    # except on an adapter whose host copy was evicted while in a slot).
    "pdfleet_engine_lora_adapter_resident",
    "gauge",
    "1 per LoRA adapter whose weights are resident, by tier: device (a device slot) or host "
    "(host memory only).",
    (*_M, LORA_NAME, LORA_TIER),
)
LORA_MAX = "max_lora"
"""vllm:lora_requests_info's label: the engine's device slots (--max-loras)."""
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", LORA_MAX)
VLLM_LORA_REQUESTS_INFO = Metric(
    # vLLM's: one series whose labels name the adapters of running and waiting
    # requests (comma-separated), set to the time of the last update.
    "vllm:lora_requests_info",
    "gauge",
    "Running stats on lora requests.",
    LORA_INFO_LABELS,
)
# Structured outputs: the grammar cache and the compile workers (docs/structured_outputs.md).
ENGINE_GRAMMAR_CACHE_BYTES = Metric(
    "pdfleet_engine_grammar_cache_bytes",
    "gauge",
    "Bytes of compiled grammars in the cache (bounded by --grammar-cache-bytes).",
    _M,
)
ENGINE_GRAMMAR_COMPILES = Metric(
    "pdfleet_engine_grammar_compiles_total", "counter", "Grammars compiled (cache misses).", _M
)
ENGINE_GRAMMAR_COMPILE_TIMEOUTS = Metric(
    "pdfleet_engine_grammar_compile_timeouts_total",
    "counter",
    "Grammar compiles stopped at --grammar-compile-timeout (their requests got a 400).",
    _M,
)
ENGINE_GRAMMAR_COMPILES_REFUSED = Metric(
    "pdfleet_engine_grammar_compiles_refused_total",
    "counter",
    "Grammar compiles refused for a caller limit (429) or no free worker in time (503).",
    _M,
)
ENGINE_GRAMMAR_COMPILES_RUNNING = Metric(
    "pdfleet_engine_grammar_compiles_running",
    "gauge",
    "Grammar compiles running in the compile workers.",
    _M,
)
ENGINE_GRAMMAR_COMPILES_WAITING = Metric(
    "pdfleet_engine_grammar_compiles_waiting",
    "gauge",
    "Grammar compiles waiting for a compile worker.",
    _M,
)
ENGINE_REQUEST_SUCCESS = Metric(
    "pdfleet_engine_request_success_total",
    "counter",
    "Finished requests by reason.",
    (MODEL_NAME, FINISHED_REASON),
)
ENGINE_TTFT = Metric(
    "pdfleet_engine_time_to_first_token_seconds",
    "histogram",
    "Time to first token.",
    _M,
    TTFT_BUCKETS,
)
ENGINE_ITL = Metric(
    "pdfleet_engine_inter_token_latency_seconds",
    "histogram",
    "Time between output tokens.",
    _M,
    ITL_BUCKETS,
)
ENGINE_E2E = Metric(
    "pdfleet_engine_e2e_request_latency_seconds",
    "histogram",
    "End-to-end request latency.",
    _M,
    E2E_BUCKETS,
)
ENGINE_QUEUE_TIME = Metric(
    "pdfleet_engine_request_queue_time_seconds",
    "histogram",
    "Time from arrival to first scheduling.",
    _M,
    E2E_BUCKETS,
)
ENGINE_CACHE_CONFIG = Metric(
    "pdfleet_engine_cache_config_info", "info", "KV-cache configuration.", CACHE_CONFIG_LABELS
)
# KV transfer (only on engines with a connector).
ENGINE_KV_TRANSFER_BYTES = Metric(
    "pdfleet_engine_kv_transfer_bytes_total", "counter", "KV bytes moved between engines.", _M
)
ENGINE_KV_TRANSFER_BLOCKS_PULLED = Metric(
    "pdfleet_engine_kv_transfer_blocks_pulled_total",
    "counter",
    "KV blocks pulled from prefill engines.",
    _M,
)
ENGINE_KV_TRANSFERS = Metric(
    "pdfleet_engine_kv_transfers_total", "counter", "Completed KV pulls.", _M
)
ENGINE_KV_TRANSFER_FAILURES = Metric(
    "pdfleet_engine_kv_transfer_failures_total", "counter", "Failed KV pulls.", _M
)
ENGINE_KV_TRANSFER_EXPIRED_LEASES = Metric(
    "pdfleet_engine_kv_transfer_expired_leases_total",
    "counter",
    "Held blocks freed because no consumer claimed them.",
    _M,
)
ENGINE_KV_TRANSFER_HANDSHAKES = Metric(
    "pdfleet_engine_kv_transfer_handshakes_total",
    "counter",
    "Handshakes with remote engines.",
    _M,
)
ENGINE_KV_TRANSFER_HANDSHAKE_FAILURES = Metric(
    "pdfleet_engine_kv_transfer_handshake_failures_total", "counter", "Failed handshakes.", _M
)
ENGINE_KV_TRANSFER_UNCONFIRMED = Metric(
    "pdfleet_engine_kv_transfer_unconfirmed_total",
    "counter",
    "Pulls whose lease ended before the producer confirmed them (recomputed).",
    _M,
)
ENGINE_KV_TRANSFER_CONTENT_MISMATCHES = Metric(
    "pdfleet_engine_kv_transfer_content_mismatches_total",
    "counter",
    "Decode legs whose prompt does not hash to the block chain the prefill engine signed "
    "(another prompt's params, or tokenizer/chat-template skew): nothing pulled, recomputed.",
    _M,
)
ENGINE_KV_REMOTE_EVICTIONS = Metric(
    "pdfleet_engine_kv_remote_evictions_total",
    "counter",
    "Cached handshakes with remote engines dropped (size bound or idle TTL).",
    _M,
)
ENGINE_KV_SIDE_CHANNEL_REFUSED = Metric(
    "pdfleet_engine_kv_side_channel_refused_total",
    "counter",
    "Side-channel requests refused (unauthenticated, forged, or naming a lease "
    "the peer may not use).",
    _M,
)
ENGINE_KV_QUARANTINED_BLOCKS = Metric(
    "pdfleet_engine_kv_quarantined_blocks",
    "gauge",
    "Pull-target blocks kept out of the free pool while an abandoned READ may still write them.",
    _M,
)
ENGINE_KV_PULLS_IN_FLIGHT = Metric(
    "pdfleet_engine_kv_pulls_in_flight", "gauge", "KV pulls started and not yet finished.", _M
)
ENGINE_KV_REMOTE_ENGINES = Metric(
    "pdfleet_engine_kv_remote_engines", "gauge", "Remote engines whose handshake is cached.", _M
)
ENGINE_KV_TRANSFER_SECONDS = Metric(
    "pdfleet_engine_kv_transfer_seconds",
    "histogram",
    "Duration of one KV pull.",
    _M,
    ITL_BUCKETS,
)
# KVTransferDegraded: measured pull bandwidth under the configured floor
# (kv_connector_extra_config.min_pull_gbps; see docs/gpu.md).
ENGINE_KV_PULL_BANDWIDTH = Metric(
    "pdfleet_engine_kv_pull_bandwidth_bytes_per_second",
    "gauge",
    "Mean bandwidth of the recent KV pulls large enough to measure (0 before the first).",
    _M,
)
ENGINE_KV_TRANSFER_DEGRADED = Metric(
    "pdfleet_engine_kv_transfer_degraded",
    "gauge",
    "KVTransferDegraded: 1 while the measured KV pull bandwidth is under min_pull_gbps.",
    _M,
)

# --- Engine, vLLM names (the model-server-protocol subset and NIXL) ---------
VLLM_NUM_REQUESTS_RUNNING = Metric(
    "vllm:num_requests_running", "gauge", "Number of requests running.", _M
)
VLLM_NUM_REQUESTS_WAITING = Metric(
    "vllm:num_requests_waiting", "gauge", "Number of requests waiting.", _M
)
VLLM_KV_CACHE_USAGE = Metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage (1 = 100%).", _M)
VLLM_CACHE_CONFIG_INFO = Metric(
    # A gauge set to 1, as vLLM exports it (not an info family).
    "vllm:cache_config_info",
    "gauge",
    "Information of the KV cache configuration.",
    CACHE_CONFIG_LABELS,
)
VLLM_NIXL_NUM_FAILED_TRANSFERS = Metric(
    "vllm:nixl_num_failed_transfers_total", "counter", "Failed KV transfers.", _M
)
VLLM_NIXL_NUM_KV_EXPIRED_REQS = Metric(
    "vllm:nixl_num_kv_expired_reqs_total", "counter", "Requests whose held KV expired.", _M
)
VLLM_NIXL_XFER_TIME = Metric(
    "vllm:nixl_xfer_time_seconds", "histogram", "KV transfer time.", _M, ITL_BUCKETS
)
# Read from vLLM pods, not exported by pdfleet (its native names carry them).
VLLM_PROMPT_TOKENS = Metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.", _M)
VLLM_TTFT = Metric(
    "vllm:time_to_first_token_seconds", "histogram", "Time to first token.", _M, TTFT_BUCKETS
)
VLLM_ITL = Metric(
    "vllm:inter_token_latency_seconds", "histogram", "Inter-token latency.", _M, ITL_BUCKETS
)
VLLM_NIXL_NUM_FAILED_TRANSFERS_UNSUFFIXED = "vllm:nixl_num_failed_transfers"
"""The same counter as exposed by vLLM versions that wrote it without ``_total``."""

VLLM_ALIASES: Mapping[Metric, Metric] = {
    ENGINE_NUM_REQUESTS_RUNNING: VLLM_NUM_REQUESTS_RUNNING,
    ENGINE_NUM_REQUESTS_WAITING: VLLM_NUM_REQUESTS_WAITING,
    ENGINE_KV_CACHE_USAGE: VLLM_KV_CACHE_USAGE,
    ENGINE_CACHE_CONFIG: VLLM_CACHE_CONFIG_INFO,
    ENGINE_KV_TRANSFER_FAILURES: VLLM_NIXL_NUM_FAILED_TRANSFERS,
    ENGINE_KV_TRANSFER_EXPIRED_LEASES: VLLM_NIXL_NUM_KV_EXPIRED_REQS,
    ENGINE_KV_TRANSFER_SECONDS: VLLM_NIXL_XFER_TIME,
    ENGINE_PROMPT_TOKENS: VLLM_PROMPT_TOKENS,
    ENGINE_TTFT: VLLM_TTFT,
    ENGINE_ITL: VLLM_ITL,
}
"""Native series -> the vLLM series a reader falls back to on vLLM pods."""
VLLM_EXPORTED = frozenset(
    {
        ENGINE_NUM_REQUESTS_RUNNING,
        ENGINE_NUM_REQUESTS_WAITING,
        ENGINE_KV_CACHE_USAGE,
        ENGINE_CACHE_CONFIG,
        ENGINE_KV_TRANSFER_FAILURES,
        ENGINE_KV_TRANSFER_EXPIRED_LEASES,
        ENGINE_KV_TRANSFER_SECONDS,
    }
)
"""The native series a pdfleet engine also exports under its vLLM name."""


def names(metric: Metric) -> tuple[str, ...]:
    """The sample names a reader tries for ``metric``: native first, then vLLM's."""
    alias = VLLM_ALIASES.get(metric)
    return (metric.name,) if alias is None else (metric.name, alias.name)


# --- Gateway (pdfleet_gateway_*) ---------------------------------------------
GATEWAY_REQUESTS = Metric(
    "pdfleet_gateway_requests_total",
    "counter",
    "Requests answered, by endpoint and HTTP status.",
    ("endpoint", "status"),
)
GATEWAY_TTFT = Metric(
    "pdfleet_gateway_time_to_first_token_seconds",
    "histogram",
    "Streamed requests: arrival to the first relayed event.",
    ("endpoint",),
    TTFT_BUCKETS,
)
GATEWAY_E2E = Metric(
    "pdfleet_gateway_e2e_request_latency_seconds",
    "histogram",
    "Arrival to the last byte of the response.",
    ("endpoint",),
    E2E_BUCKETS,
)
GATEWAY_DISAGG_DECISIONS = Metric(
    "pdfleet_gateway_disagg_decisions_total",
    "counter",
    "Disaggregation decisions: prefill_decode or decode_only, with the reason.",
    (DECISION, REASON),
)
GATEWAY_RETRIES = Metric(
    "pdfleet_gateway_retries_total",
    "counter",
    "Legs retried on another engine, by role.",
    (ROLE,),
)
GATEWAY_FALLBACKS = Metric(
    "pdfleet_gateway_fallbacks_total",
    "counter",
    "Disaggregated requests served decode-only without a producer's KV "
    "(prefill_failed, no_prefill_engine, no_kv_transfer_params).",
    (REASON,),
)
GATEWAY_UPSTREAM_ERRORS = Metric(
    "pdfleet_gateway_upstream_errors_total",
    "counter",
    "Failed engine calls (connect, timeout, status, stream), by engine.",
    (ENGINE, ROLE, "kind"),
)
GATEWAY_ENGINE_HEALTHY = Metric(
    "pdfleet_gateway_engine_healthy",
    "gauge",
    "1 while an engine receives traffic, 0 while it is ejected or not yet ready.",
    (ENGINE, ROLE),
)
GATEWAY_ENGINE_INFLIGHT = Metric(
    "pdfleet_gateway_engine_inflight_requests",
    "gauge",
    "Requests the gateway has in flight on an engine.",
    (ENGINE, ROLE),
)
GATEWAY_ENGINE_EJECTIONS = Metric(
    "pdfleet_gateway_engine_ejections_total",
    "counter",
    "Times an engine was ejected from routing.",
    (ENGINE, ROLE),
)

GATEWAY_ENGINE_STALLS = Metric(
    "pdfleet_gateway_engine_stalls_total",
    "counter",
    "Times an engine was ejected because its in-flight requests made no "
    "progress for its stall limit while another engine of its role did.",
    (ENGINE, ROLE),
)
GATEWAY_ENGINE_STALL_LIMIT = Metric(
    "pdfleet_gateway_engine_stall_limit_seconds",
    "gauge",
    "Seconds an engine may send nothing with requests in flight before it counts as "
    "stalled: --stall-step-multiple times its longest recent step, at least --stall-timeout.",
    (ENGINE, ROLE),
)
GATEWAY_ENGINE_CAPACITY = Metric(
    "pdfleet_gateway_engine_capacity",
    "gauge",
    "Sequences (a request's n × prompts) the gateway routes to an engine at once, learned "
    "from the engine's queue: "
    "its own count, or requests waiting on it past a quarter of the first-token bound "
    "for their first answer (no series until the engine first queues requests).",
    (ENGINE, ROLE),
)
GATEWAY_QUEUED_REQUESTS = Metric(
    "pdfleet_gateway_queued_requests",
    "gauge",
    "Requests waiting for a slot on a decode engine (every routable one at capacity).",
)
GATEWAY_KV_PAIR_OPEN = Metric(
    "pdfleet_gateway_kv_pair_open",
    "gauge",
    "1 while the KV circuit breaker of a (prefill, decode) engine pair is open "
    "(the pair is not used for disaggregation).",
    ("prefill", "decode"),
)
GATEWAY_HELD_REQUESTS = Metric(
    "pdfleet_gateway_held_requests",
    "gauge",
    "Requests waiting for a routable decode engine (all down, restarting or scaled to zero).",
)
GATEWAY_REJECTED_REQUESTS = Metric(
    "pdfleet_gateway_rejected_requests_total",
    "counter",
    "Requests refused before routing, by reason (body_too_large, body_timeout, "
    "invalid_json, invalid_field, unauthorized; overload: overloaded, queue_full, "
    "queue_timeout).",
    (REASON,),
)
GATEWAY_MIGRATIONS = Metric(
    "pdfleet_gateway_migrations_total",
    "counter",
    "Decode legs resumed on another decode engine after the client had part of the "
    "answer, by reason (drain, died, stalled, refused); exhausted: requests that "
    "failed because they reached --max-migrations.",
    (REASON,),
)
GATEWAY_MIGRATION_REPLAYED_TOKENS = Metric(
    "pdfleet_gateway_migration_replayed_tokens_total",
    "counter",
    "Output tokens already sent to clients that resumed decode legs carried to their new "
    "engine (recomputed there, or found in its prefix cache).",
)
GATEWAY_MIGRATION_RESUME = Metric(
    "pdfleet_gateway_migration_resume_seconds",
    "histogram",
    "From a decode leg's failure to the first event of its resumed leg.",
    (),
    TTFT_BUCKETS,
)

GATEWAY_TENANT_REQUESTS = Metric(
    "pdfleet_gateway_tenant_requests_total",
    "counter",
    "Requests by tenant (an API key, or a tenants-file tenant) and outcome: admitted, "
    "or refused (inflight_limit, rate_limited, queue_full, queue_timeout).",
    ("tenant", "outcome"),
)
GATEWAY_TENANT_TOKENS = Metric(
    "pdfleet_gateway_tenant_tokens_total",
    "counter",
    "Tokens admitted by tenant, counted as scheduled: prompt tokens + n × max_tokens.",
    ("tenant",),
)
GATEWAY_TENANT_INFLIGHT = Metric(
    "pdfleet_gateway_tenant_inflight_requests",
    "gauge",
    "Requests of a tenant admitted and not finished (queued or on an engine).",
    ("tenant",),
)
GATEWAY_TENANT_INFLIGHT_TOKENS = Metric(
    "pdfleet_gateway_tenant_inflight_tokens",
    "gauge",
    "Tokens (prompt + n × max_tokens) of a tenant's admitted, unfinished requests.",
    ("tenant",),
)
GATEWAY_TENANT_QUEUED = Metric(
    "pdfleet_gateway_tenant_queued_requests",
    "gauge",
    "Requests of a tenant waiting for a slot (every routable decode engine at capacity).",
    ("tenant",),
)
GATEWAY_TENANT_QUEUE_SECONDS = Metric(
    "pdfleet_gateway_tenant_queue_seconds",
    "histogram",
    "Seconds a tenant's requests waited for a slot (only requests that waited).",
    ("tenant",),
    TTFT_BUCKETS,
)
BATCH_STATE = "state"
"""pdfleet_gateway_batch_requests' label: ``pending`` or ``BATCH_RUNNING``."""
BATCH_RUNNING = "running"
GATEWAY_BATCH_REQUESTS = Metric(
    "pdfleet_gateway_batch_requests",
    "gauge",
    "Requests of OpenAI Batch API jobs not yet run, by state (pending: waiting for idle "
    "capacity; running). Deferrable demand: the autoscaler does not scale up for it.",
    (BATCH_STATE,),
)

GATEWAY_KV_INDEX_BLOCKS = Metric(
    "pdfleet_gateway_kv_index_blocks",
    "gauge",
    "Block ids in the exact prefix index (built from the engines' KV events).",
)
GATEWAY_KV_INDEX_EVENTS = Metric(
    "pdfleet_gateway_kv_index_events_total",
    "counter",
    "KV events applied to the exact prefix index, by engine and type "
    "(BlockStored, BlockRemoved, AllBlocksCleared).",
    (ENGINE, "type"),
)
GATEWAY_KV_INDEX_REPLAYS = Metric(
    "pdfleet_gateway_kv_index_replays_total",
    "counter",
    "Replays asked of an engine's replay socket after a sequence gap or a late join, by outcome "
    "(ok, partial: the engine no longer buffered the start, failed: no answer in time).",
    (ENGINE, "outcome"),
)
GATEWAY_KV_INDEX_RESETS = Metric(
    "pdfleet_gateway_kv_index_resets_total",
    "counter",
    "Times an engine's entries were dropped from the exact prefix index, by reason "
    "(cleared, restart, gap, removed).",
    (ENGINE, REASON),
)
GATEWAY_KV_INDEX_FRESH = Metric(
    "pdfleet_gateway_kv_index_fresh",
    "gauge",
    "1 while an engine's KV event stream is fresh (routing uses its exact entries), "
    "0 while it is stale or unknown (routing falls back to approximate prefix scoring).",
    (ENGINE,),
)

# --- Operator and autoscaler -------------------------------------------------
OPERATOR_RECONCILES = Metric(
    "pdfleet_operator_reconciles_total",
    "counter",
    "Reconciles of InferenceServices by result.",
    ("result",),
)
OPERATOR_SCALE_CHANGES = Metric(
    "pdfleet_operator_scale_changes_total",
    "counter",
    "Replica changes made by the autoscaler.",
    (ROLE,),
)
OPERATOR_SCRAPE_FAILURES = Metric(
    "pdfleet_operator_scrape_failures_total",
    "counter",
    "Engine /metrics scrapes that failed or timed out.",
)
OPERATOR_FLEET_SECRETS_CREATED = Metric(
    "pdfleet_operator_fleet_secrets_created_total",
    "counter",
    "Fleet Secrets the operator created (first reconcile, or after a rotation).",
)
OPERATOR_IDENTITY_AUTHORITIES_CREATED = Metric(
    "pdfleet_operator_identity_authorities_created_total",
    "counter",
    "Identity authorities (Secrets NAME-identity) the operator created (first reconcile, "
    "or after a rotation).",
)
OPERATOR_IDENTITY_REQUESTS = Metric(
    "pdfleet_operator_identity_requests_total",
    "counter",
    "Requests to the identity endpoint by result: issued, refused (the token or the pod "
    "did not qualify), busy (429), error (503: the API server or the operator not ready).",
    ("result",),
)
OPERATOR_ADAPTER_CHANGES = Metric(
    "pdfleet_operator_adapter_changes_total",
    "counter",
    "LoRA adapter loads and unloads the operator made on running engine pods to follow "
    "spec.adapters, by action (load, unload) and result (ok, error).",
    ("action", "result"),
)
AUTOSCALER_DESIRED_REPLICAS = Metric(
    "pdfleet_autoscaler_desired_replicas",
    "gauge",
    "Replicas of each role the autoscaler wants (mode Advisory: advises, and leaves as they are).",
    (ROLE, "mode"),
)
AUTOSCALER_DECISIONS = Metric(
    "pdfleet_autoscaler_decisions_total",
    "counter",
    "Autoscaling decisions by role, direction (up, down, none), reason code and mode "
    "(Active: carried out; Advisory: reported only).",
    (ROLE, "direction", REASON, "mode"),
)


# --- The one parser ----------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One metric family of an exposition, as it came: its samples in order."""

    name: str
    """The family's name (a counter's without ``_total``, an info's without ``_info``)."""
    kind: str
    """``counter``, ``gauge``, ``histogram``, ``info``, ``summary`` or ``unknown``."""
    documentation: str
    samples: tuple[tuple[str, Mapping[str, str], float], ...]
    """(sample name, labels, value), in the text's order."""


@dataclass(frozen=True)
class Scrape:
    """One ``/metrics`` text, parsed: sample name -> its samples, one per label set."""

    samples: Mapping[str, tuple[tuple[Mapping[str, str], float], ...]]
    """Sample name -> ((labels, value), ...)."""
    families: tuple[Family, ...] = ()
    """The same samples by family, with each family's type and help (what a
    merge of several expositions needs, ``gateway/siblings.py``)."""

    def values(self, *names: str) -> list[float]:
        """The values of the first of ``names`` that is present ([] if none)."""
        for name in names:
            if self.samples.get(name):
                return [value for _, value in self.samples[name]]
        return []

    def total(self, *names: str) -> float | None:
        """Sum over label sets of the first of ``names`` present; None if none is."""
        found = self.values(*names)
        return float(sum(found)) if found else None

    def mean(self, *names: str) -> float | None:
        """Mean over label sets (for ratios, one series per data-parallel rank)."""
        found = self.values(*names)
        return sum(found) / len(found) if found else None

    def labels(self, *names: str) -> Mapping[str, str] | None:
        """The labels of the first sample of the first of ``names`` present."""
        for name in names:
            if self.samples.get(name):
                return self.samples[name][0][0]
        return None

    def totals(self) -> dict[str, float]:
        """Every sample name -> its sum over label sets, histogram buckets and
        ``_created`` timestamps left out."""
        return {
            name: float(sum(value for _, value in series))
            for name, series in self.samples.items()
            if not name.endswith(("_bucket", "_created"))
        }


def parse_metrics(text: str, only: Iterable[str] | None = None) -> Scrape:
    """Parse Prometheus exposition text (``prometheus_client.parser``).

    ``only`` keeps just the sample lines that start with one of those names
    (engines export hundreds of histogram lines a router does not need).
    Raises ``ValueError`` on text that is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if only is not None:
        prefixes = tuple(only)
        text = "\n".join(ln for ln in text.splitlines() if ln.startswith(prefixes)) + "\n"
    samples: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    families: list[Family] = []
    try:
        for family in text_string_to_metric_families(text):
            rows = []
            for s in family.samples:
                labels, value = dict(s.labels), float(s.value)
                samples.setdefault(s.name, []).append((labels, value))
                rows.append((s.name, labels, value))
            families.append(Family(family.name, family.type, family.documentation, tuple(rows)))
    except ValueError as e:
        raise ValueError(f"unreadable Prometheus metrics text: {e}") from None
    return Scrape({name: tuple(series) for name, series in samples.items()}, tuple(families))


# --- Gateway: activation of pools scaled to zero ----------------------------

# Peer pulls (docs/peer-pull.md): the gateway's decisions and its measured costs.
GATEWAY_PEER_PULL_DECISIONS = Metric(
    "pdfleet_gateway_peer_pull_decisions_total",
    "counter",
    "Requests whose prompt prefix another engine held, by what the gateway did: holder "
    "(served there), pull (the holder lent the prefix, another engine pulls it), "
    "recompute; and why (cost: the predicted fastest, explore: no pair measured yet, "
    "lend_refused / lend_failed: a pull was chosen but the holder did not lend, so "
    "recomputed).",
    (DECISION, REASON),
)
PULL, HOLDER, RECOMPUTE = "pull", "holder", "recompute"
"""The ``decision`` values of :data:`GATEWAY_PEER_PULL_DECISIONS` (the gateway's
peer pull writes them, ``pdfleet status`` counts them)."""
PEER_PULL_DECISIONS = (PULL, HOLDER, RECOMPUTE)

GATEWAY_PEER_PULL_CROSSOVER = Metric(
    "pdfleet_gateway_peer_pull_crossover_tokens",
    "gauge",
    "Prefix tokens from which pulling them from `holder` into `puller` is predicted "
    "faster than `puller` recomputing them (measured lend time, pair bandwidth and "
    "prefill rate); +Inf when pulling never wins.",
    ("holder", "puller"),
)
GATEWAY_PEER_PULL_FLEET_CROSSOVER = Metric(
    "pdfleet_gateway_peer_pull_fleet_crossover_tokens",
    "gauge",
    "The crossover of the median measured pair (-1 before any pair is measured, 0 while "
    "peer pulls are off).",
)
GATEWAY_PEER_PULL_BANDWIDTH = Metric(
    "pdfleet_gateway_peer_pull_bandwidth_bytes_per_second",
    "gauge",
    "Measured KV pull bandwidth from `holder` into `puller` (an average over recent "
    "scrapes of the puller's per-producer pull counters).",
    ("holder", "puller"),
)
GATEWAY_PEER_PULL_PREFILL_RATE = Metric(
    "pdfleet_gateway_peer_pull_prefill_tokens_per_second",
    "gauge",
    "An engine's measured prefill rate (prompt tokens per second of prefill forward "
    "time, averaged over recent scrapes).",
    ("url",),
)
GATEWAY_PEER_PULL_LEND_SECONDS = Metric(
    "pdfleet_gateway_peer_pull_lend_seconds",
    "gauge",
    "Average time a holder took to answer a lend request (its lease of cached blocks).",
    ("url",),
)
GATEWAY_LORA_LOADS = Metric(
    "pdfleet_gateway_lora_loads_total",
    "counter",
    "LoRA adapters the gateway loaded on an engine that did not serve them (a request "
    "named one and the engines serving it were busier).",
    (ENGINE,),
)
GATEWAY_LORA_IDENTITY_CONFLICTS = Metric(
    "pdfleet_gateway_lora_identity_conflicts",
    "gauge",
    "Engines that serve a LoRA adapter name with other weights (lora_identity) than the "
    "ones the gateway routes that name to (most engines', ties to the first seen); "
    "requests naming it never go to them.",
    ("lora_name",),
)
GATEWAY_ACTIVATIONS = Metric(
    "pdfleet_gateway_activation_requests_total",
    "counter",
    "Requests that found no routable engine of a role (decode: held until one is ready; "
    "prefill: served decode-only): the activation signal the autoscaler reads to scale "
    "a pool up from zero.",
    (ROLE,),
)


# --- Engine: KV pulls per tensor-parallel shard -------------------------------

KV_SHARD = "rank"
ENGINE_KV_TRANSFER_SHARD_BYTES = Metric(
    "pdfleet_engine_kv_transfer_shard_bytes_total",
    "counter",
    "KV bytes each tensor-parallel rank of a NIXL consumer read into its own shard "
    "(its KV heads' share of every pulled block).",
    (MODEL_NAME, KV_SHARD),
)

# --- Engine: KV pulls per producer (peer pulls' cost model, docs/peer-pull.md) --

KV_PRODUCER = "producer"
ENGINE_KV_PEER_PULLS = Metric(
    "pdfleet_engine_kv_peer_pulls_total",
    "counter",
    "Confirmed KV pulls from each producer (its engine id); at most 256 producers are "
    "named, the rest count under `other`.",
    (MODEL_NAME, KV_PRODUCER),
)
ENGINE_KV_PEER_PULL_BYTES = Metric(
    "pdfleet_engine_kv_peer_pull_bytes_total",
    "counter",
    "KV bytes of the confirmed pulls from each producer.",
    (MODEL_NAME, KV_PRODUCER),
)
ENGINE_KV_PEER_PULL_SECONDS = Metric(
    "pdfleet_engine_kv_peer_pull_seconds_total",
    "counter",
    "Wall seconds of the confirmed pulls from each producer (claim, READ and confirm; "
    "not the handshake).",
    (MODEL_NAME, KV_PRODUCER),
)
ENGINE_KV_BLOCK_BYTES = Metric(
    "pdfleet_engine_kv_block_bytes",
    "gauge",
    "Bytes a KV pull moves per block (every layer, K and V, every shard).",
    _M,
)

# --- Engine: the host KV tier (--kv-offload-bytes, docs/kv_offload.md) --------

ENGINE_KV_OFFLOAD_BLOCKS = Metric(
    "pdfleet_engine_kv_offload_blocks",
    "gauge",
    "Host-tier KV blocks in use (holding a block or receiving one).",
    _M,
)
ENGINE_KV_OFFLOAD_CAPACITY = Metric(
    "pdfleet_engine_kv_offload_capacity_blocks",
    "gauge",
    "Host-tier KV blocks allocated (0 without --kv-offload-bytes).",
    _M,
)
ENGINE_KV_OFFLOAD_HIT_TOKENS = Metric(
    "pdfleet_engine_kv_offload_hit_tokens_total",
    "counter",
    "Prompt tokens loaded back from the host tier instead of recomputed (part of the "
    "prefix-cache hits).",
    _M,
)
ENGINE_KV_OFFLOAD_STORED_BYTES = Metric(
    "pdfleet_engine_kv_offload_stored_bytes_total",
    "counter",
    "Bytes copied from the device KV cache to the host tier.",
    _M,
)
ENGINE_KV_OFFLOAD_LOADED_BYTES = Metric(
    "pdfleet_engine_kv_offload_loaded_bytes_total",
    "counter",
    "Bytes copied from the host tier back to the device KV cache.",
    _M,
)
ENGINE_KV_OFFLOAD_EVICTIONS = Metric(
    "pdfleet_engine_kv_offload_evictions_total",
    "counter",
    "Blocks evicted from the host tier (least recently used first).",
    _M,
)
