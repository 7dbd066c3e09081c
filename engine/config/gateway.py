"""Settings of ``pdfleet gateway``, the OpenAI-compatible front of a P/D fleet.

Lives in the config package (no torch, nothing else of pdfleet) so that the
operator and ``pdfleet up`` can render a gateway's command line from the same
typed fields the gateway parses: :meth:`GatewayConfig.to_cli_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ..contracts.http_limits import DEFAULT_LIMITS
from ..contracts.security import api_keys_from_env, split_keys
from .admission import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_OUTPUT_TOKENS
from .fields import (
    argparse_kwargs,
    attr_docs,
    bounded_seconds,
    default_of,
    flag_name,
    optional_of,
    resolved_fields,
    to_jsonable,
)
from .parser import record_argument

DisaggregationMode = Literal["Always", "Conditional", "Disabled"]
ROLES = ("prefill", "decode", "both")
BATCH_DATABASE_ENV = "PDFLEET_BATCH_DATABASE_URL"
# Never printed nor passed on as flags (the environment carries them).
SECRET_FIELDS = ("api_key", "batch_database_url")
# Engine pod annotations naming the ports of its KV event streams
# (docs/kv_events.md); the operator sets them, Kubernetes discovery reads them.
KV_EVENTS_PORT_ANNOTATION = "pdfleet.dev/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "pdfleet.dev/kv-events-replay-port"


DAY = 86400.0
# The float settings' ranges: (least, most, least excluded). Every one is
# finite (an infinite wait is no bound) and within what a fleet can mean: a
# watchdog or scrape period under its least would spin, a wait over a day is
# a hang. The flags' argparse types and ``__post_init__`` both apply them.
FLOAT_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "discovery_interval": (0.1, 3600.0, False),
    "connect_timeout": (0.01, 3600.0, False),
    "first_token_timeout": (0.01, DAY, False),
    "first_token_base_timeout": (0.01, DAY, False),
    "first_token_per_waiting": (0.0, 3600.0, False),
    "first_token_max_timeout": (0.01, DAY, False),
    "idle_timeout": (0.01, DAY, False),
    "request_timeout": (0.01, DAY, False),
    "scrape_interval": (0.05, 300.0, False),
    "stall_timeout": (0.1, DAY, False),
    "stall_step_multiple": (0.0, 1000.0, False),
    "stall_max_step": (0.1, DAY, False),
    "hold_timeout": (0.0, DAY, False),
    "queue_timeout": (0.0, DAY, False),
    "kv_pair_cooldown": (0.01, DAY, False),
    "header_timeout": (0.01, 3600.0, False),
    "body_timeout": (0.01, DAY, False),
    "kv_index_stale_after": (0.01, DAY, False),
    "kv_host_weight": (0.0, 1.0, False),
    "peer_pull_lend_timeout": (0.01, 3600.0, False),
}


def check_float(flag: str, value: Any, low: float, high: float, open_low: bool = False) -> float:
    """``value`` as a finite float within the bounds; else a ValueError naming ``flag``
    (booleans and strings are refused, not converted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{flag} must be a number, got {value!r}")
    if not math.isfinite(value) or value < low or (open_low and value == low) or value > high:
        bracket = "(" if open_low else "["
        raise ValueError(f"{flag} must be within {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


@dataclass
class GatewayConfig:
    """Gateway settings; one CLI flag per field (``--field-name``)."""

    host: str = "0.0.0.0"  # noqa: S104 (the gateway serves every interface of its pod)
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    workers: int = 1
    """Gateway processes serving the port (SO_REUSEPORT), each on its own core
    with its own view of every engine (health checks, metric scrapes); 1 for
    one process. A gateway pod sets it from its CPU limit."""
    prefill: list[str] = field(default_factory=list)
    """URL of a prefill engine (e.g. http://10.0.0.5:8000); repeat the flag or
    give several values."""
    decode: list[str] = field(default_factory=list)
    """URL of a decode (or aggregated) engine; repeat the flag or give several
    values."""
    engines_file: str | None = None
    """JSON or YAML file listing engines (`engines: [{url, role}]`, role
    prefill, decode or both); re-read whenever it changes, so engines can be
    added and removed at runtime. Combines with --prefill/--decode."""
    discovery: Literal["static", "kubernetes"] = "static"
    """Where engines come from: `static` (--prefill/--decode/--engines-file)
    or `kubernetes` (pods matching --selector in --namespace, role from the
    pod label `pdfleet.dev/role`)."""
    namespace: str | None = None
    """Kubernetes namespace to watch (default: the gateway pod's own, else
    `default`)."""
    selector: str | None = None
    """Kubernetes label selector of the engine pods (e.g.
    `pdfleet.dev/service=llama`); required with --discovery kubernetes."""
    engine_port: int = 8000
    """Engine port for pods without a `pdfleet.dev/port` annotation."""
    discovery_interval: float = 5.0
    """Seconds between two listings of the engine pods (kubernetes discovery)."""
    disaggregation_mode: DisaggregationMode = "Conditional"
    """`Always`: every request runs a prefill leg then a decode leg.
    `Conditional`: prompts under --min-prompt-tokens, or whose uncached part on
    the chosen decode engine is under it, go straight to decode. `Disabled`:
    decode-only (aggregated engines)."""
    min_prompt_tokens: int = 256
    """Conditional mode: the fewest (uncached) prompt tokens worth a prefill leg."""
    tokenizer: str | None = None
    """Model directory whose tokenizer counts prompt tokens and cuts prefix
    blocks; without it a token is approximated as 4 characters."""
    chat_template: str | None = None
    """The engines' `--chat-template` (a readable file's path, or the template
    itself, as the engine takes it): chat prompts are rendered with it instead
    of the --tokenizer directory's templates, so they are counted and hashed
    as the engines compute them. Needs --tokenizer."""
    served_model_name: list[str] = field(default_factory=list)
    """Model name(s) the gateway answers to, as vLLM's flag: `/v1/models` lists
    them (also while no decode engine is up), and a request naming another
    model is refused (404) before any engine is called. Requests are forwarded
    as they are, so the engines must serve the same names (`pdfleet up` and
    the operator give both `spec.model.name`). Default: the engines' names."""
    api_key: list[str] = field(default_factory=list)
    """Accepted `Authorization: Bearer KEY` keys (repeatable; each value split
    on commas; default: $PDFLEET_API_KEY, else the file $PDFLEET_API_KEY_FILE
    names, comma- or newline-separated, else none: no authentication). Prefer
    the environment or the file: a flag is visible in `ps`."""
    ca_bundle: str | None = None
    """PEM file of the CAs that sign the engines' certificates (`https://`
    engine URLs); default: the system's trust store. Certificates are always
    verified."""
    client_cert: str | None = None
    """PEM certificate (chain) the gateway presents to `https://` engines that
    ask for one (mutual TLS); with --client-key unless the file holds the key."""
    client_key: str | None = None
    """PEM private key of --client-cert."""
    connect_timeout: float = 5.0
    """Seconds to open a connection to an engine."""
    first_token_timeout: float | None = None
    """Seconds an engine may take to produce the first token (the whole
    prefill leg; the first event of a stream). Default: sized per engine from
    its scraped queue, --first-token-base-timeout plus
    --first-token-per-waiting for each waiting request, at most
    --first-token-max-timeout."""
    first_token_base_timeout: float = 60.0
    """First-token bound of an engine with an empty queue (when
    --first-token-timeout is not given)."""
    first_token_per_waiting: float = 2.0
    """Seconds added to the first-token bound per request waiting on the engine
    (a waiting request first waits for a running one to finish: on a CPU or a
    loaded engine that is seconds, not milliseconds)."""
    first_token_max_timeout: float = 300.0
    """Largest queue-sized first-token bound."""
    idle_timeout: float = 60.0
    """Seconds allowed between two events of a streamed response."""
    request_timeout: float = 600.0
    """Seconds a non-streamed response may take in total."""
    scrape_interval: float = 1.0
    """Seconds between two health checks and metric scrapes of each engine."""
    stall_timeout: float = 5.0
    """The least time (seconds) an engine with requests in flight may send
    nothing before it counts as stalled: a stopped or wedged process. The
    limit follows the engine: --stall-step-multiple times its longest step
    of the last minutes, when that is longer. A stalled engine is ejected
    from routing while another engine of its role makes progress (a fleet
    that is slow as a whole ejects nothing), never when it is the last
    routable engine of a role (its requests wait instead); it comes back
    after --readmit-after good checks."""
    stall_step_multiple: float = 4.0
    """An engine counts as stalled only after this many times its longest
    recent step (from its `pdfleet_engine_step_duration_seconds` histogram)
    without progress, plus --scrape-interval; 0: --stall-timeout alone."""
    stall_max_step: float | None = None
    """Seconds one engine step may run before the engine counts as stalled
    even though it answers its checks. An engine that reports a step in
    progress (pdfleet engines, `pdfleet_engine_step_running_seconds`) at a
    check within the last interval is busy, not stalled, however long its
    silence, until that step is this old; default max(120, --stall-timeout ×
    --stall-step-multiple)."""
    hold_timeout: float = 10.0
    """Seconds a new request waits for a decode engine while none is routable
    (all down, restarting or scaled to zero) before a 503 with Retry-After."""
    queue_timeout: float = 60.0
    """Seconds a request waits for a slot while every routable decode engine
    is at capacity (learned from the engines' own queues, and from requests
    waiting on an engine past a quarter of its first-token bound for their
    first answer) before a 503 with Retry-After. A request that could not
    get one in time, by the rate at which slots came free, is refused at
    once (429 with Retry-After)."""
    max_queued_requests: int = 1024
    """Requests that may wait for a slot at once; more are refused at once
    (429 with Retry-After); 0: none wait."""
    scale_to_zero: bool = False
    """Decode may be scaled to zero (minReplicas 0): /health stays 200 with no
    decode engine, so load balancers keep sending requests, which the gateway
    holds while its activation signal brings an engine back."""
    kv_pair_failures: int = 3
    """Consecutive failed P/D hand-offs over one (prefill, decode) pair that
    open its circuit breaker: the pair is not used for disaggregation for
    --kv-pair-cooldown seconds."""
    kv_pair_cooldown: float = 30.0
    """Seconds a (prefill, decode) pair stays out of P/D routing once its
    breaker opened."""
    # The client limits default as the engine server's (engine/contracts/http_limits.py).
    max_body_bytes: int = DEFAULT_LIMITS.max_body_bytes
    """Largest request body accepted (413 beyond, refused on Content-Length
    before anything is read)."""
    max_chunk_bytes: int = DEFAULT_LIMITS.max_chunk_bytes
    """Largest chunk a chunked request body may announce or send (413, and
    the connection closes)."""
    header_timeout: float = DEFAULT_LIMITS.header_timeout
    """Seconds a client may take to send a request's headers."""
    body_timeout: float = DEFAULT_LIMITS.body_timeout
    """Seconds a client may take to send a request's body."""
    max_n: int = DEFAULT_MAX_N
    """Most completions one request may ask for (`n`, `best_of`); a larger
    value is a 400 naming the field before any engine is called. Set it as the
    engines' --max-n (the operator and `pdfleet up` do)."""
    max_request_output_tokens: int = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS
    """Most output tokens one request may ask for (`n` × `max_tokens`, over
    every prompt of a batch); a larger product is a 400 naming `max_tokens`.
    Set it as the engines' --max-request-output-tokens (the operator and
    `pdfleet up` do)."""
    tenants_file: str | None = None
    """JSON or YAML file grouping API keys into tenants and setting each one's
    weight, priority band, in-flight, queue and rate limits and cache sharing
    (docs/flow-control.md); its keys are accepted API keys. Without it every
    API key is its own tenant of weight 1."""
    engine_priority: bool = False
    """Send each request's priority band to the engines as `priority` (with the
    fleet token, the only caller engines take it from), so their scheduler
    admits and preempts by it: the engines must run `--scheduling-policy
    priority`. Off: bands order only the gateway's queue."""
    flow_default_max_tokens: int = 256
    """Output tokens a request without `max_tokens` is assumed to ask for when
    its cost (prompt tokens + n × max_tokens) is counted for fair share and
    token limits."""
    data_dir: str | None = None
    """Directory of the gateway's durable state: the OpenAI Batch API's files
    and its SQLite database (`batches.sqlite3`). Without it (and without a
    batch database) /v1/files and /v1/batches answer 404."""
    batch_database_url: str | None = None
    """PostgreSQL URL (`postgresql://user:password@host/db`) of the Batch API's
    store, which several gateway replicas can share, instead of --data-dir.
    Default: $PDFLEET_BATCH_DATABASE_URL, which keeps the password out of the
    process list."""
    batch_concurrency: int = 4
    """Batch requests the gateway runs at once at most (each only while no
    online request waits for a slot)."""
    batch_max_file_bytes: int = 100 * 1024 * 1024
    """Largest file /v1/files takes (413 beyond)."""
    eject_after: int = 3
    """Consecutive failed health checks that eject an engine from routing."""
    readmit_after: int = 2
    """Consecutive good health checks that bring an ejected engine back."""
    max_migrations: int = 3
    """Times one request may move to another decode engine after its decode
    leg failed (the engine died, stalled, drained, or its stream broke),
    resumed from the tokens the client already has (docs/migration.md); then
    it fails with an error event (a stream) or a 502. 0: no migration."""
    retries: int = 1
    """Other engines to try after a failed prefill leg (then decode-only), or
    after a decode engine that refuses the connection."""
    prefix_blocks: int = 64
    """Leading prompt blocks hashed for prefix-aware routing."""
    prefix_table_size: int = 100_000
    """Entries (block hashes) in the prefix-affinity LRU table."""
    kv_events_port: int | None = None
    """Port of the engines' KV event PUB sockets (`kv_events_config.endpoint`)
    on each engine's host, for engines whose discovery entry names no
    `kv_events` endpoint (engines file key, pod annotation
    `pdfleet.dev/kv-events-port`). Engines with a stream are routed from the
    exact prefix index (docs/gateway.md, "Exact prefix routing")."""
    kv_events_replay_port: int | None = None
    """Port of the engines' KV event replay (ROUTER) sockets, likewise."""
    kv_events_topic: str = ""
    """Topic the engines publish KV events under (`kv_events_config.topic`)."""
    kv_events_auth: Literal["fleet", "none"] = "fleet"
    """How to subscribe to the engines' KV events (`kv_events_config.auth`):
    `fleet` (ZeroMQ CURVE with the fleet secret's keys; the default, what
    fleet engines publish with) or `none` (engines that publish to anyone,
    e.g. for vLLM's router too)."""
    kv_index_max_blocks: int = 1_000_000
    """Block ids the exact prefix index holds at most (the least recently
    stored go first); about 150 bytes each."""
    kv_index_stale_after: float = 10.0
    """Seconds without a batch (engines send a heartbeat when idle) after which
    an engine's exact entries stop counting and its prefix score falls back to
    the approximate table."""
    kv_host_weight: float = 0.5
    """Weight of a prompt block an engine holds only in its host-memory tier
    (KV events with `medium: CPU`), relative to a device-tier block (1)."""
    peer_pull: bool = False
    """Peer pulls (docs/peer-pull.md): per request, serve a cached prefix on the
    engine that holds it, or have another engine pull it from the holder over
    the KV connector, or recompute it, whichever the measured costs predict is
    fastest. With a prefill leg (P/D) it decides where the prefill leg runs,
    among the prefill engines, and whether that engine pulls first, from a
    prefill engine or from a decode engine that holds more of the prompt (a
    `kv_both` one), or whether that decode engine serves it alone (Conditional
    mode, fewer uncached tokens than `min_prompt_tokens`). Needs the exact prefix
    index (KV events) and pulling engines whose `kv_role` is
    `kv_both`; engines without a connector are never pulled into."""
    peer_pull_lend_timeout: float = 2.0
    """Seconds a holder has to answer a lend request (it lends from its cache
    ahead of its queue); past them the request is recomputed elsewhere."""
    trust_client_trace_context: bool = False
    """Continue the trace of a client's `traceparent`, sampled flag included
    (tracing on, docs/observability.md). Off: each request starts a new trace,
    which the configured sampler (`OTEL_TRACES_SAMPLER`) decides on, linked to
    the client's span, so a client cannot force spans to be exported."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"
    """Log level of the HTTP server."""

    def __post_init__(self) -> None:  # noqa: C901 (a linear chain of flag checks)
        for name, (low, high, open_low) in FLOAT_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_float(f"--{flag_name(name)}", value, low, high, open_low))
        positive = (
            "connect_timeout",
            "idle_timeout",
            "request_timeout",
            "first_token_base_timeout",
            "first_token_max_timeout",
            "stall_timeout",
            "kv_pair_cooldown",
            "header_timeout",
            "body_timeout",
            "kv_index_stale_after",
        )
        for name in (*positive, "scrape_interval", "discovery_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{flag_name(name)} must be > 0, got {getattr(self, name)}")
        if self.first_token_timeout is not None and self.first_token_timeout <= 0:
            raise ValueError(f"--first-token-timeout must be > 0, got {self.first_token_timeout}")
        if self.first_token_per_waiting < 0 or self.hold_timeout < 0:
            raise ValueError("--first-token-per-waiting and --hold-timeout must be >= 0")
        if min(self.stall_step_multiple, self.queue_timeout, self.max_queued_requests) < 0:
            raise ValueError(
                "--stall-step-multiple, --queue-timeout and --max-queued-requests must be >= 0"
            )
        if not 0.0 <= self.kv_host_weight <= 1.0:
            raise ValueError(f"--kv-host-weight must be within [0, 1], got {self.kv_host_weight}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"--{flag_name(name)} must be a TCP port (1-65535), got {port}")
        if self.chat_template is not None and not self.tokenizer:
            raise ValueError(
                "--chat-template needs --tokenizer (the tokenizer counts the prompts the "
                "template renders)"
            )
        if self.client_key and not self.client_cert:
            raise ValueError("--client-key needs --client-cert (the certificate it belongs to)")
        for name in (
            "eject_after",
            "readmit_after",
            "prefix_blocks",
            "prefix_table_size",
            "kv_index_max_blocks",
            "kv_pair_failures",
            "max_body_bytes",
            "max_request_output_tokens",
            "max_chunk_bytes",
            "flow_default_max_tokens",
            "batch_concurrency",
            "batch_max_file_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_n <= DEFAULT_MAX_N:
            raise ValueError(f"--max-n must be between 1 and {DEFAULT_MAX_N}, got {self.max_n}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.batch_database_url is not None:
            if self.data_dir:
                raise ValueError(
                    "--data-dir and --batch-database-url are two stores for the Batch API: "
                    "give one (the database for several gateway replicas)"
                )
            if not self.batch_database_url.startswith(("postgresql://", "postgres://")):
                raise ValueError(
                    "--batch-database-url must be a PostgreSQL URL (postgresql://...), got "
                    f"one starting {self.batch_database_url.split(':', 1)[0][:20]!r}"
                )
        if self.workers > 1 and self.port == 0:
            raise ValueError("--workers above 1 needs a fixed --port (each worker binds it)")
        if self.retries < 0 or self.min_prompt_tokens < 0:
            raise ValueError("--retries and --min-prompt-tokens must be >= 0")
        if not 0 <= self.max_migrations <= 100:
            raise ValueError(f"--max-migrations must be within [0, 100], got {self.max_migrations}")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        if self.discovery == "kubernetes":
            if not self.selector:
                raise ValueError(
                    "--discovery kubernetes needs --selector (a label selector of the engine pods)"
                )
            if self.prefill or self.decode or self.engines_file:
                raise ValueError(
                    "--discovery kubernetes finds engines itself: drop --prefill, --decode and "
                    "--engines-file"
                )
        elif not (self.prefill or self.decode or self.engines_file):
            raise ValueError("give the engines: --prefill URL / --decode URL or --engines-file")

    # -- CLI -------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        docs = attr_docs(cls)
        group = parser.add_argument_group("Gateway")
        for f, tp in resolved_fields(cls):
            kwargs = argparse_kwargs(f.name, tp, default_of(f), docs.get(f.name, ""))
            if f.name in FLOAT_BOUNDS:
                low, high, open_low = FLOAT_BOUNDS[f.name]
                seconds = f.name not in ("stall_step_multiple", "kv_host_weight")
                unit = {"stall_step_multiple": "a multiple", "kv_host_weight": "a weight"}.get(
                    f.name, "seconds"
                )
                parse = bounded_seconds(low, high, open_low=open_low, unit=unit)
                kwargs["type"] = optional_of(parse) if default_of(f) is None else parse
                kwargs["metavar"] = "SECONDS" if seconds else "N"
            if kwargs.get("nargs") == "+":
                # Repeatable (`--decode A --decode B`) as well as `--decode A B`.
                kwargs.update(action="extend", default=None)
            if f.name in ("api_key", "prefill", "decode"):
                kwargs["metavar"] = "KEY" if f.name == "api_key" else "URL"
            record_argument(
                parser, group.add_argument(f"--{flag_name(f.name)}", dest=f.name, **kwargs)
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> GatewayConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            if values[f.name] is None and f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
        # A flag value is split like the environment's (`--api-key ka,kb`).
        values["api_key"] = [k for v in values["api_key"] for k in split_keys(v)]
        if not values["api_key"]:
            values["api_key"] = keys_from_env()
        if not values["batch_database_url"]:
            values["batch_database_url"] = os.environ.get(BATCH_DATABASE_ENV) or None
        return cls(**values)

    def to_cli_args(self) -> list[str]:
        """Flags that reproduce this configuration (non-default values only;
        API keys are left out: pass them through $PDFLEET_API_KEY)."""
        out: list[str] = []
        for f, _tp in resolved_fields(type(self)):
            value = getattr(self, f.name)
            if f.name in SECRET_FIELDS or to_jsonable(value) == to_jsonable(default_of(f)):
                continue
            flag = f"--{flag_name(f.name)}"
            if isinstance(value, bool):
                out.append(flag if value else f"--no-{flag_name(f.name)}")
            elif isinstance(value, list):
                for item in value:
                    out += [flag, str(item)]
            elif value is None:
                out += [flag, "None"]
            else:
                out += [flag, str(value)]
        return out

    def first_token_bound(self, waiting: float) -> float:
        """Seconds to wait for an engine's first token with ``waiting`` requests
        queued before this one (the fixed --first-token-timeout when given)."""
        if self.first_token_timeout is not None:
            return self.first_token_timeout
        sized = self.first_token_base_timeout + self.first_token_per_waiting * max(0.0, waiting)
        return min(self.first_token_max_timeout, sized)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_jsonable(self)
        data["api_key"] = ["***"] * len(self.api_key)
        if self.batch_database_url:
            data["batch_database_url"] = "***"
        return data

    def __repr__(self) -> str:  # never print keys
        return f"GatewayConfig({json.dumps(self.to_dict(), sort_keys=True)})"


def keys_from_env() -> list[str]:
    """Keys from $PDFLEET_API_KEY, else from the file $PDFLEET_API_KEY_FILE."""
    return api_keys_from_env()
