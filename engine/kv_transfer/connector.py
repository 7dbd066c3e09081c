"""The P/D connector: vLLM's NixlConnector protocol over NIXL or ZeroMQ.

Producer (``do_remote_decode``): after the prefill, the request's blocks are
held under a lease with a random, unguessable ``pdfleet_lease_id``, and the
response carries ``kv_transfer_params`` (``contracts/kv_params.py``: vLLM's
``do_remote_prefill``, ``remote_engine_id``, ``remote_host``, ``remote_port``,
``remote_block_ids``, ``remote_request_id``, ``tp_size``, plus ``pdfleet_*``
fields) signed with the fleet secret. A lease binds to the first authenticated consumer that claims
it; only that consumer may read, confirm or release it. Blocks are freed when
the consumer confirms or releases, or when the lease expires. The lease keeps
the block hash chain the producer computed: a claim or read must name the same
chain, hashed by the consumer from its own tokens (signed params alone would
let any holder of the fleet secret pair one prompt's lease with another's chain).

Consumer (``do_remote_prefill``): verifies the signature before anything is
dialled, matches its own prefix cache, then pulls only the missing full
blocks (the trailing partial block and the last prompt token are
recomputed), off the batch, on the connector's transfer thread, within a
deadline. After the bytes have landed it asks the producer to ``confirm``
that the lease was held for the whole transfer; only then are the blocks
used and published to the prefix cache. Otherwise the request recomputes.

Both (``do_remote_prefill`` plus ``pdfleet_produce``, a ``kv_both`` engine): a
prefill leg that first pulls a peer's cached prefix as a consumer does, computes
the tail, then finishes as a producer: every full block before the last prompt
token is leased under its own signed params. A pull that fails or is dropped
leaves the request a plain prefill leg (it computes the whole prompt).

Pull targets stay out of the free pool until the transport is done with
them: an aborted or timed-out READ that may still write them *quarantines*
its blocks until its handle completes (past ``quarantine_timeout_seconds`` the
engine reports itself unhealthy). Remote handshakes are cached with a size
bound and an idle TTL. See docs/kv_transfer.md.
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from .. import tracing
from ..config import EngineConfig
from ..config.kv_transfer import KV_BIND_IP_ENV, KV_IP_ENV, kv_bind_host, kv_host
from ..contracts import kv_params, security
from ..contracts.block_hash import HASH_FUNCTIONS, get_hash_fn, prompt_block_hashes
from ..contracts.kv_connector import (
    HandshakeReply,
    KVConnectorMetadata,
    KVLoad,
    RankCommand,
    ShardInfo,
    ShardReadEnded,
)
from ..contracts.kv_params import CHAIN_ALGO_FIELD, CHAIN_FIELD, KVTransferParams, RefusedParams
from ..contracts.kv_side_channel import (
    CLAIM,
    CONFIRM,
    PROTOCOL_VERSION,
    RELEASE,
    Accepted,
    LeaseEnd,
    LeaseUse,
    Refusal,
)
from ..contracts.tp_wire import KVAgentSpec
from ..core.connector_side import QUARANTINE
from ..core.sched_output import SchedulerOutput
from ..request import Request
from .base import KVConnectorScheduler, KVConnectorStats, KVConnectorWorker
from .identity_client import engine_identity
from .layout import IncompatibleKV, KVLayout, compat_mismatch, tp_layout_mismatch
from .side_channel import (
    IncompatibleHello,
    Peer,
    Refused,
    SideChannelClient,
    SideChannelServer,
)
from .transports import (
    NixlTransport,
    Remote,
    Transport,
    ZmqTransport,
    new_instance_id,
    restrict_ucx_to,
)

logger = logging.getLogger(__name__)

# Failures that no policy may paper over (incompatible engines) carry this prefix.
FATAL = "fatal: "
# Failures because the leased blocks are not this prompt's (the producer refused the
# consumer's chain) carry this one: always recomputed, whatever the failure policy.
CONTENT = "content: "
# The code of a producer's refusal of a claim or read whose chain is not the lease's.
CHAIN_REFUSED = "chain"
# How long signed params stay valid after their lease ends (default).
PARAMS_GRACE_SECONDS = 60.0


def kv_addresses(kv: Any) -> tuple[str, str]:
    """(the address consumers use, the address to bind) of this node's KV traffic.

    ``$PDFLEET_KV_IP`` (the pod IP in Kubernetes, on every pod of a multi-node
    group) wins over ``kv_transfer_config.kv_ip``; ``$PDFLEET_KV_BIND_IP`` binds
    another one (behind NAT). A headless node (``--nnodes > 1``) uses the same
    rule for its ranks' NIXL agents."""
    host = kv_host(kv) or kv.kv_ip
    bind_ip = kv_bind_host(kv) or host
    if bind_ip in ("0.0.0.0", "::", "*", ""):  # noqa: S104 (the address refused here)
        raise ValueError(
            f"the KV side channel binds one address, not {bind_ip!r}: set "
            f"kv_transfer_config.kv_ip (or ${KV_IP_ENV}, or ${KV_BIND_IP_ENV} behind NAT)"
        )
    return host, bind_ip


@dataclass
class Load:
    """One pull on the transfer thread: what the scheduler side asked for, and
    how far it got."""

    job: KVLoad
    started: float = 0.0
    token: Any = None
    remote: Remote | None = None
    parked_since: float = 0.0

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def params(self) -> KVTransferParams:
        return self.job.params

    @property
    def local_ids(self) -> list[int]:
        return self.job.local_ids

    @property
    def remote_ids(self) -> list[int]:
        return self.job.remote_ids

    @property
    def deadline(self) -> float:
        return self.job.deadline

    @property
    def release_only(self) -> bool:
        """Nothing to pull (all blocks local): only tell the producer to free its blocks."""
        return self.job.release_only

    @property
    def lease_id(self) -> str:
        return self.job.params.lease_id or ""


@dataclass
class Lease:
    """Blocks a producer holds for one consumer."""

    request_id: str
    block_ids: list[int]
    expires: float  # monotonic
    consumer: str | None = None  # Peer.identity once claimed
    # The hex chained hash of the last leased block, as this producer computed it from
    # its own tokens: the content it vouches for. A claim or read must name the same
    # chain, recomputed by the consumer from its own tokens. The signed params carry
    # it too, but any holder of the fleet secret can re-sign those; only the producer
    # holds this copy.
    chain: str | None = None


# Producers named in the per-producer pull counters (a bounded label set).
MAX_PEERS_NAMED = 256
# Pulls smaller than this are latency, not bandwidth: they are not measured.
BANDWIDTH_MIN_PULL_BYTES = 4 << 20
BANDWIDTH_WINDOW = 8


class PullBandwidth:
    """Mean bandwidth of the last ``BANDWIDTH_WINDOW`` pulls of at least
    ``min_bytes``, and whether it is under ``floor_bytes_per_second`` (0 = no floor)."""

    def __init__(self, floor_bytes_per_second: float, min_bytes: int) -> None:
        if floor_bytes_per_second < 0 or min_bytes < 0:
            raise ValueError(
                "kv_connector_extra_config.min_pull_gbps and bandwidth_min_pull_bytes "
                "must be non-negative"
            )
        self.floor = floor_bytes_per_second
        self.min_bytes = min_bytes
        self.rates: deque[float] = deque(maxlen=BANDWIDTH_WINDOW)

    def add(self, nbytes: int, seconds: float) -> bool:
        """Counts one finished pull; whether it was large enough to measure. Mutates."""
        if nbytes < max(self.min_bytes, 1) or seconds <= 0:
            return False
        self.rates.append(nbytes / seconds)
        return True

    @property
    def mean(self) -> float:
        return sum(self.rates) / len(self.rates) if self.rates else 0.0

    @property
    def degraded(self) -> bool:
        return self.floor > 0 and bool(self.rates) and self.mean < self.floor


@dataclass
class ConnectorStats:
    """Cumulative counters and current gauges (read by the metrics exporter)."""

    bytes_transferred: int = 0
    blocks_pulled: int = 0
    transfers: int = 0
    failed_transfers: int = 0
    unconfirmed_transfers: int = 0
    content_mismatches: int = 0
    expired_leases: int = 0
    handshakes: int = 0
    failed_handshakes: int = 0
    remote_evictions: int = 0
    refused_reads: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # drained by the exporter
    # Confirmed pulls per producer engine id: [pulls, bytes, seconds] (the gateway's
    # measure of each pair's bandwidth); at most MAX_PEERS_NAMED ids, then "other".
    per_producer: dict[str, list[float]] = field(default_factory=dict)
    pull_bandwidth: float = 0.0  # bytes/s, mean of the recent measured pulls
    degraded: bool = False  # KVTransferDegraded: pull_bandwidth under the floor


# ConnectorStats' fields the snapshot takes unchanged (the others it converts).
_SNAPSHOT_SCALARS = tuple(
    f.name for f in fields(ConnectorStats) if f.name not in ("transfer_seconds", "per_producer")
)


class PDConnector:
    """State shared by the scheduler side and the worker side of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        kv = config.kv_transfer_config
        if kv is None or kv.kv_connector is None:
            raise RuntimeError("broken invariant: kv is not None and kv.kv_connector is not None")
        secret = security.fleet_secret_from_env()
        if secret is None:
            raise ValueError(
                "a KV connector needs the fleet secret: set $PDFLEET_FLEET_SECRET (or "
                "$PDFLEET_FLEET_SECRET_FILE) to the same value on every engine and the gateway "
                "(pdfleet up and the operator do this)"
            )
        self.secret = secret
        self.config = config
        self.kv = kv
        self.engine_id = str(kv.engine_id)
        self.instance_id = new_instance_id()
        self.block_size = config.cache_config.block_size
        self.hash_algo = config.cache_config.prefix_caching_hash_algo
        extra = kv.kv_connector_extra_config
        self.lease_seconds = kv.lease_seconds
        self.handshake_timeout = float(extra.get("handshake_timeout_seconds", 2.0))
        self.transfer_timeout = float(extra.get("transfer_timeout_seconds", 3.0))
        self.quarantine_timeout = float(extra.get("quarantine_timeout_seconds", 30.0))
        self.params_grace = float(extra.get("params_grace_seconds", PARAMS_GRACE_SECONDS))
        self.max_remotes = int(extra.get("max_remote_engines", 64))
        self.remote_idle_seconds = float(extra.get("remote_idle_seconds", 600.0))
        self.bandwidth = PullBandwidth(
            floor_bytes_per_second=float(extra.get("min_pull_gbps", 0.0)) * 1e9,
            min_bytes=int(extra.get("bandwidth_min_pull_bytes", BANDWIDTH_MIN_PULL_BYTES)),
        )
        self.fail_policy = kv.kv_load_failure_policy
        self.num_kv_heads = config.model_config.num_key_value_heads
        self.compat = config.compat_factors()
        self.compat_hash = config.compat_hash()
        self.host, self.bind_ip = kv_addresses(kv)
        self.port = kv.kv_port
        self.stats = ConnectorStats()
        self.lock = threading.Lock()
        # Producer: leases by lease id; request ids whose lease ended (to free).
        self.held: dict[str, Lease] = {}
        self.freed: list[str] = []
        # Consumer: loads handed to the transfer thread whose target blocks the
        # transport may still write (request id -> number of blocks), the aborted
        # or failed ones among them (quarantined), and those whose quarantine ended.
        self.active: dict[str, int] = {}
        self.quarantined: set[str] = set()
        self.unquarantined: list[str] = []
        self.unhealthy: str | None = None
        self.new_loads: queue.Queue[Load] = queue.Queue()
        self.cancel: queue.Queue[str] = queue.Queue()
        self.done: queue.Queue[tuple[str, bool, str]] = queue.Queue()
        self.errors: dict[str, str] = {}
        self.remotes: OrderedDict[tuple[str, str, str, int], tuple[Remote, float]] = OrderedDict()
        self.tp_size = config.parallel_config.tensor_parallel_size
        if kv.kv_connector == "NixlConnector":
            # Before the first agent, here or in a rank process (which inherits it).
            devices = restrict_ucx_to(self.bind_ip)
            logger.info("UCX restricted to UCX_NET_DEVICES=%s", devices)
            self.transport: Transport = NixlTransport(
                self.engine_id,
                self.instance_id,
                list(extra.get("backends", ["UCX"])),
                self.tp_size,
                config.model_config.num_key_value_heads,
            )
        elif self.tp_size > 1:
            raise ValueError(
                f"kv_transfer_config.kv_connector {kv.kv_connector} moves KV from this process's "
                "memory and cannot reach the shards of --tensor-parallel-size "
                f"{self.tp_size}; use NixlConnector (every rank reads its own shard)"
            )
        else:
            self.transport = ZmqTransport()
        self.layout: KVLayout | None = None
        self.server: SideChannelServer | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        # Operator-vouched identities ($PDFLEET_IDENTITY_*), when the fleet has them:
        # from the operator's endpoint (waited for here, before the model loads, and
        # renewed until shutdown) or from a file.
        self.identity, self.identity_renewer = engine_identity(str(kv.kv_role))

    # -- setup --------------------------------------------------------------------

    def register(self, buffer: torch.Tensor) -> None:
        """TP=1: this process's KV buffer."""
        self.layout = KVLayout.of(buffer)
        self.transport.register(buffer, self.layout)
        self._start()

    def register_shards(self, layout: KVLayout, shards: list[ShardInfo]) -> None:
        """TP>1: the rank processes registered their shards with their own agents
        (``nixl_shard.shard_info``, rank order; ``layout``: rank 0's)."""
        if not isinstance(self.transport, NixlTransport):
            raise TypeError("broken invariant: isinstance(self.transport, NixlTransport)")
        self.layout = layout
        self.transport.register_shards(layout, shards)
        self._start()

    @property
    def bytes_per_block(self) -> int:
        """Bytes a pull moves per block (every shard, layer, K and V)."""
        if isinstance(self.transport, NixlTransport):
            return self.transport.bytes_per_block
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        return self.layout.block_bytes * 2 * self.layout.num_layers

    def _start(self) -> None:
        if self.kv.is_kv_producer:
            self.server = SideChannelServer(
                self.bind_ip,
                self.port,
                self.secret,
                self.compat,
                self.compat_hash,
                {
                    "handshake": self._on_handshake,
                    "claim": self._on_claim,
                    "read": self._on_read,
                    "confirm": self._on_confirm,
                    "release": self._on_release,
                },
                self.identity,
            )
        if self.kv.is_kv_consumer:
            self.thread = threading.Thread(
                target=self._transfer_loop, name="kv-transfer", daemon=True
            )
            self.thread.start()
        logger.info(
            "KV connector %s (%s, %d shard(s)) engine %s instance %s, side channel %s:%d "
            "(bound %s), lease %.0fs",
            self.kv.kv_connector,
            self.kv.kv_role,
            self.tp_size,
            self.engine_id,
            self.instance_id,
            self.host,
            self.port,
            self.bind_ip,
            self.lease_seconds,
        )

    def wait_for_leases(self, timeout: float | None = None) -> int:
        """Block until every held lease is claimed or expired (bounded by the lease);
        the engine loop must keep stepping meanwhile. Returns the leases left."""
        bound = self.lease_seconds + 1.0 if timeout is None else timeout
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            with self.lock:
                left = len(self.held)
            if not left:
                return 0
            time.sleep(0.02)
        with self.lock:
            return len(self.held)

    def shutdown(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(5)
        if self.server is not None:
            self.server.close()
        if self.identity_renewer is not None:
            self.identity_renewer.stop()
        self.transport.shutdown()

    # -- producer: side-channel handlers (side-channel thread) -----------------------

    def _on_handshake(
        self, request: dict[str, Any], peer: Peer
    ) -> tuple[dict[str, Any], list[Any]] | None:
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        if not peer.may_consume:
            return self._refused(f"identity: {peer.identity} may not pull KV (not a consumer)")
        # The layout without addresses: a READ needs only the base (NIXL adds it).
        tp_size, shards = self.transport.handshake_shards() or (None, None)
        reply = HandshakeReply(
            PROTOCOL_VERSION,
            self.engine_id,
            self.instance_id,
            self.compat,
            self.compat_hash,
            self.layout.wire(),
            self.transport.name,
            tp_size,
            shards,
        )
        return reply.to_wire(), []

    def _lease_for(self, use: LeaseUse, peer: Peer) -> tuple[Lease | None, str, str | None]:
        """The lease a claim/read names, bound to ``peer`` (caller holds the lock); else
        (None, why, the refusal's code)."""
        if not peer.may_consume:
            return None, f"{peer.identity} may not pull KV (not a consumer)", None
        lease = self.held.get(use.lease_id)
        if lease is None:
            return None, "unknown or ended lease", None
        if lease.expires < time.monotonic():
            return None, "the lease has expired", None
        if lease.consumer is not None and lease.consumer != peer.identity:
            return None, "the lease is bound to another consumer", None
        if not set(use.block_ids) <= set(lease.block_ids):
            return None, "the blocks named are not held under this lease", None
        if lease.chain is not None:
            # Checked before the lease is bound: a consumer with another prompt leaves
            # the lease to its lawful decode leg.
            chain = use.chain
            if chain is None or not hmac.compare_digest(chain.encode(), lease.chain.encode()):
                return (
                    None,
                    "the block hash chain named is not the leased blocks' (another prompt's KV)",
                    CHAIN_REFUSED,
                )
        lease.consumer = peer.identity
        return lease, "", None

    def _refused(self, why: str, code: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        self.stats.refused_reads += 1
        return Refusal(why, code).to_wire(), []

    def _on_claim(
        self, request: dict[str, Any], peer: Peer
    ) -> tuple[dict[str, Any], list[Any]] | None:
        try:
            use = LeaseUse.decode(request)
        except ValueError as e:
            with self.lock:
                return self._refused(f"claim: {e}")
        with self.lock:
            lease, why, code = self._lease_for(use, peer)
            if lease is None:
                return self._refused(why, code)
        return Accepted().to_wire(), []

    def _on_read(
        self, request: dict[str, Any], peer: Peer
    ) -> tuple[dict[str, Any], list[Any]] | None:
        try:
            use = LeaseUse.decode(request)
        except ValueError as e:
            with self.lock:
                return self._refused(f"read: {e}")
        with self.lock:
            lease, why, code = self._lease_for(use, peer)
            if lease is None:
                return self._refused(why, code)
            frames = self.transport.serve_read(list(use.block_ids))
            self.stats.bytes_transferred += sum(len(f) for f in frames)
        return Accepted().to_wire(), frames

    def _on_confirm(
        self, request: dict[str, Any], peer: Peer
    ) -> tuple[dict[str, Any], list[Any]] | None:
        """Was the lease held (its blocks never freed) for the whole transfer? It ends now."""
        try:
            lid = LeaseEnd.decode(request).lease_id
        except ValueError as e:
            with self.lock:
                return self._refused(f"confirm: {e}")
        with self.lock:
            lease = self.held.get(lid)
            if lease is None or lease.consumer != peer.identity:
                return self._refused("the lease ended before the transfer was confirmed")
            del self.held[lid]
            self.freed.append(lease.request_id)
        return Accepted().to_wire(), []

    def _on_release(
        self, request: dict[str, Any], peer: Peer
    ) -> tuple[dict[str, Any], list[Any]] | None:
        try:
            lid = LeaseEnd.decode(request).lease_id
        except ValueError:  # a release is never answered: refused silently, counted
            with self.lock:
                self.stats.refused_reads += 1
            return None
        with self.lock:
            lease = self.held.get(lid)
            if lease is not None and peer.may_consume and lease.consumer in (None, peer.identity):
                del self.held[lid]
                self.freed.append(lease.request_id)
            else:
                self.stats.refused_reads += 1
        return None

    # -- consumer: handshake cache (transfer thread) ----------------------------------

    def _remote_key(self, p: KVTransferParams) -> tuple[str, str, str, int]:
        if p.remote_host is None or p.remote_port is None:  # accept() checked
            raise RuntimeError(
                "broken invariant: p.remote_host is not None and p.remote_port is not None"
            )
        return (str(p.remote_engine_id), p.remote_instance_id or "", p.remote_host, p.remote_port)

    def _drop_remote(self, key: tuple[str, str, str, int], client: SideChannelClient) -> None:
        entry = self.remotes.pop(key, None)
        if entry is None:
            return
        self.transport.forget(entry[0])
        if not any(k[2:] == key[2:] for k in self.remotes):
            client.drop(key[2], key[3])

    def _evict_remotes(self, client: SideChannelClient, busy: set[int]) -> None:
        """Drop idle handshakes and those over the size bound (never one in use)."""
        cutoff = time.monotonic() - self.remote_idle_seconds
        for key, (remote, used) in list(self.remotes.items()):
            over = len(self.remotes) > self.max_remotes
            if not over and used >= cutoff:
                break  # ordered by last use: the rest are newer
            if id(remote) in busy:
                continue
            self._drop_remote(key, client)
            with self.lock:
                self.stats.remote_evictions += 1

    def _handshake(self, client: SideChannelClient, p: KVTransferParams, deadline: float) -> Remote:
        key = self._remote_key(p)
        entry = self.remotes.get(key)
        if entry is not None:
            self.remotes[key] = (entry[0], time.monotonic())
            self.remotes.move_to_end(key)
            return entry[0]
        host, port = key[2], key[3]
        timeout = max(0.05, min(self.handshake_timeout, deadline - time.monotonic()))
        # A new handshake with this address replaces any other instance's there.
        for other in [k for k in self.remotes if k[2:] == key[2:]]:
            self._drop_remote(other, client)
            with self.lock:
                self.stats.remote_evictions += 1
        try:
            raw, _ = client.connect(host, port, timeout)
            try:
                reply = HandshakeReply.from_wire(raw)
            except ValueError as e:
                raise RuntimeError(f"a malformed handshake reply from {host}:{port}: {e}") from None
        except IncompatibleHello as e:
            with self.lock:
                self.stats.failed_handshakes += 1
            why = compat_mismatch(self.compat, e.compat)
            raise IncompatibleKV(why or str(e)) from None
        except Exception:
            with self.lock:
                self.stats.failed_handshakes += 1
            raise
        why = compat_mismatch(self.compat, reply.compat)
        if why is not None:
            raise IncompatibleKV(why)
        wanted = p.remote_instance_id
        if wanted and reply.instance_id != wanted:
            # The producer restarted on the same address: the blocks named are gone.
            raise RuntimeError(
                f"the prefill engine at {host}:{port} restarted (instance "
                f"{reply.instance_id}, params from {wanted})"
            )
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        layout = KVLayout.of_wire(reply.layout)
        shape = self.layout.shape_mismatch(layout)
        if shape is not None:
            raise IncompatibleKV(f"KV layout mismatch with the prefill engine: {shape}")
        if reply.transport != self.transport.name:
            raise IncompatibleKV(
                f"the prefill engine uses the {reply.transport} transport, this engine "
                f"{self.transport.name}: use the same kv_connector on both"
            )
        if self.identity.required:
            # The side channel proved who answers; it must be who signed the params.
            proven = client.peers.get((host, port))
            named = p.producer
            if proven is None or proven.subject != named:
                raise RuntimeError(
                    f"the KV side channel at {host}:{port} is "
                    f"{proven.subject if proven else 'unidentified'}, the params name {named}"
                )
        remote = Remote(reply.engine_id, reply.instance_id, host, port, layout)
        self.transport.connect(remote, reply)
        self.remotes[key] = (remote, time.monotonic())
        with self.lock:
            self.stats.handshakes += 1
        return remote

    def _forget(self, load: Load, client: SideChannelClient) -> None:
        if load.params.remote_host is not None:
            self._drop_remote(self._remote_key(load.params), client)

    # -- consumer: transfer thread --------------------------------------------------

    def _target_done(self, request_id: str) -> None:
        """The transport will not write this request's pull targets any more."""
        with self.lock:
            self.active.pop(request_id, None)
            if request_id in self.quarantined:
                self.quarantined.discard(request_id)
                self.unquarantined.append(request_id)

    def _transfer_loop(self) -> None:
        client = SideChannelClient(
            self.secret, self.engine_id, self.instance_id, self.compat_hash, self.identity
        )
        if isinstance(self.transport, ZmqTransport):
            self.transport.client = client
        inflight: list[Load] = []
        parked: list[Load] = []
        cancelled: set[str] = set()
        next_sweep = 0.0
        while not self._stop.is_set():
            try:
                load = self.new_loads.get(timeout=0.0005 if inflight or parked else 0.05)
                self._drain_cancels(cancelled)
                self._begin(client, load, inflight, cancelled)
            except queue.Empty:
                pass
            self._drain_cancels(cancelled)
            now = time.monotonic()
            still = []
            for load in inflight:
                state = self.transport.check(load.token)
                if state == "PROC":
                    if load.request_id in cancelled or now > load.deadline:
                        # It may still write its targets: report the failure now, keep the
                        # handle (and the blocks) until the transport is done with it.
                        why = "cancelled" if load.request_id in cancelled else "timed out"
                        load.parked_since = now
                        parked.append(load)
                        self._finish(load, False, client, f"the transfer {why}", target_done=False)
                    else:
                        still.append(load)
                    continue
                self.transport.release(load.token)
                if load.request_id in cancelled:
                    self._finish(load, False, client, "cancelled")
                elif state == "DONE":
                    self._confirm(client, load)
                else:
                    self._finish(load, False, client, f"the transfer failed ({state})")
                cancelled.discard(load.request_id)
            inflight = still
            parked = self._check_parked(parked, cancelled, now)
            if now >= next_sweep:
                next_sweep = now + 1.0
                busy = {id(x.remote) for x in inflight + parked}
                self._evict_remotes(client, busy)
        client.close()

    def _drain_cancels(self, cancelled: set[str]) -> None:
        while True:
            try:
                cancelled.add(self.cancel.get_nowait())
            except queue.Empty:
                return

    def _check_parked(self, parked: list[Load], cancelled: set[str], now: float) -> list[Load]:
        still = []
        for load in parked:
            if self.transport.check(load.token) == "PROC":
                still.append(load)
                if now - load.parked_since > self.quarantine_timeout and self.unhealthy is None:
                    self.unhealthy = (
                        f"a KV pull for {load.request_id} has not finished "
                        f"{self.quarantine_timeout:.0f}s after it was abandoned; its blocks "
                        "stay quarantined"
                    )
                    logger.error("%s", self.unhealthy)
                continue
            self.transport.release(load.token)
            cancelled.discard(load.request_id)
            self._target_done(load.request_id)
        if not still and self.unhealthy is not None:
            logger.info("every abandoned KV pull has finished; quarantine over")
            self.unhealthy = None
        return still

    def _begin(
        self, client: SideChannelClient, load: Load, inflight: list[Load], cancelled: set[str]
    ) -> None:
        p = load.params
        if load.release_only:
            self._send_release(client, p)
            return
        if load.request_id in cancelled:
            cancelled.discard(load.request_id)
            self._finish(load, False, client, "cancelled")
            return
        try:
            if time.monotonic() > load.deadline:
                raise TimeoutError("the transfer deadline passed before it started")
            remote = self._handshake(client, p, load.deadline)
            load.remote = remote
            load.started = time.monotonic()
            if isinstance(self.transport, NixlTransport):
                # One-sided READs: the producer checks and binds the lease first.
                client.call(
                    remote.host,
                    remote.port,
                    LeaseUse(
                        CLAIM, load.lease_id, tuple(load.remote_ids), load.job.chain
                    ).to_wire(),
                    max(0.05, load.deadline - time.monotonic()),
                )
            load.token = self.transport.start_read(
                remote,
                load.local_ids,
                load.remote_ids,
                load.lease_id,
                load.deadline,
                chain=load.job.chain,
            )
            if load.token == "DONE" and time.monotonic() > load.deadline:
                self._finish(load, False, client, "the transfer timed out")
                return
            inflight.append(load)
        except Refused as e:
            if e.code == CHAIN_REFUSED:
                # The producer computed other blocks than this prompt's (params re-signed
                # by a fleet-secret holder): nothing was read; recompute.
                with self.lock:
                    self.stats.content_mismatches += 1
                logger.warning(
                    "request %s: the KV offered by prefill engine %s is not this prompt's "
                    "(the producer refused this prompt's block hash chain: %s); nothing "
                    "pulled, recomputing",
                    load.request_id,
                    p.remote_engine_id,
                    e,
                )
                self._finish(load, False, client, CONTENT + str(e))
                return
            logger.warning(
                "KV pull for %s from %s:%s refused: %s",
                load.request_id,
                p.remote_host,
                p.remote_port,
                e,
            )
            self._finish(load, False, client, str(e))
        except Exception as e:
            logger.warning(
                "KV pull for %s from %s:%s failed: %s",
                load.request_id,
                p.remote_host,
                p.remote_port,
                e,
            )
            self._forget(load, client)
            self._finish(
                load, False, client, (FATAL if isinstance(e, IncompatibleKV) else "") + str(e)
            )

    def _confirm(self, client: SideChannelClient, load: Load) -> None:
        """The bytes landed: use them only if the lease was held for all of the transfer."""
        if load.remote is None:
            raise RuntimeError("broken invariant: load.remote is not None")
        try:
            client.call(
                load.remote.host,
                load.remote.port,
                LeaseEnd(CONFIRM, load.lease_id).to_wire(),
                max(0.05, min(self.handshake_timeout, load.deadline - time.monotonic() + 1.0)),
            )
        except Exception as e:
            logger.warning("KV pull for %s not confirmed, recomputing: %s", load.request_id, e)
            with self.lock:
                self.stats.unconfirmed_transfers += 1
            self._finish(load, False, client, f"the transfer was not confirmed ({e})")
            return
        self._finish(load, True, client, "")

    def _send_release(self, client: SideChannelClient, p: KVTransferParams) -> None:
        host, port = p.remote_host, p.remote_port
        if host is None or port is None or (host, port) not in client.sessions:
            return  # never authenticated there: nothing of ours is held
        if p.lease_id is None:
            return  # no lease named: nothing of ours is held
        client.send_nowait(host, port, LeaseEnd(RELEASE, p.lease_id).to_wire())

    def _finish(
        self, load: Load, ok: bool, client: SideChannelClient, why: str, target_done: bool = True
    ) -> None:
        nbytes = len(load.local_ids) * (self.bytes_per_block if self.layout else 0)
        with self.lock:
            if ok:
                self.stats.transfers += 1
                self.stats.blocks_pulled += len(load.local_ids)
                self.stats.bytes_transferred += nbytes
                seconds = time.monotonic() - load.started
                self.stats.transfer_seconds.append(seconds)
                peers = self.stats.per_producer
                producer = str(load.params.remote_engine_id)
                if producer not in peers and len(peers) >= MAX_PEERS_NAMED:
                    producer = "other"
                row = peers.setdefault(producer, [0.0, 0.0, 0.0])
                row[0] += 1
                row[1] += nbytes
                row[2] += seconds
                was_degraded = self.stats.degraded
                if self.bandwidth.add(nbytes, seconds):
                    self.stats.pull_bandwidth = self.bandwidth.mean
                    self.stats.degraded = self.bandwidth.degraded
                if self.stats.degraded and not was_degraded:
                    logger.warning(
                        "KVTransferDegraded: KV pulls run at %.2f GB/s, under min_pull_gbps "
                        "%.2f (UCX on TCP only? see docs/gpu.md)",
                        self.bandwidth.mean / 1e9,
                        self.bandwidth.floor / 1e9,
                    )
            else:
                self.stats.failed_transfers += 1
        tracing.kv_pull(
            load.request_id, load.started, nbytes, len(load.local_ids), load.params, ok, why
        )
        if not ok and not why.startswith(CONTENT):
            # Tell the producer it may free the blocks now (best effort). Not after a
            # content refusal: the lease is another prompt's, whose decode leg may
            # still claim it (else it expires).
            self._send_release(client, load.params)
        if target_done:
            self._target_done(load.request_id)
        self.done.put((load.request_id, ok, why))

    # -- consumer: engine thread ------------------------------------------------------

    def pull_in_flight(self, request_id: str) -> bool:
        """Whether a transfer may still write the request's blocks; if so they are
        quarantined from now on (the scheduler keeps them out of the free pool)."""
        with self.lock:
            if request_id in self.active:
                self.quarantined.add(request_id)
                return True
            return False

    @property
    def num_quarantined_blocks(self) -> int:
        with self.lock:
            return sum(self.active.get(r, 0) for r in self.quarantined)


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(self, connector: PDConnector) -> None:
        self.connector = connector
        self.pending: list[KVLoad] = []

    def stats_snapshot(self) -> KVConnectorStats:
        c = self.connector
        with c.lock:
            stats = c.stats
            seconds, stats.transfer_seconds = stats.transfer_seconds, []
            # The counters and gauges both dataclasses name are copied as they are.
            shared = {name: getattr(stats, name) for name in _SNAPSHOT_SCALARS}
            snapshot = KVConnectorStats(
                **shared,
                transfer_seconds=tuple(seconds),
                per_producer={k: tuple(v) for k, v in stats.per_producer.items()},
                remote_engines=len(c.remotes),
                pulls_in_flight=len(c.active),
            )
        refused = snapshot.refused_reads + (c.server.num_rejected if c.server is not None else 0)
        by_rank = c.transport.rank_bytes if isinstance(c.transport, NixlTransport) else []
        return replace(
            snapshot,
            refused_reads=refused,
            quarantined_blocks=c.num_quarantined_blocks,  # takes the lock itself
            block_bytes=c.bytes_per_block if c.layout is not None else None,
            shard_bytes=tuple(by_rank),
        )

    def _verified(self, raw: Mapping[str, Any]) -> KVTransferParams:
        try:
            return kv_params.verify(self.connector.secret, raw)
        except kv_params.InvalidParams as e:
            message = str(e).replace("kv_transfer_params ", "the params ", 1)
            raise RefusedParams(f"kv_transfer_params: {message}") from None

    def accept(self, raw: Mapping[str, Any]) -> KVTransferParams | None:
        """Decode (and for a decode leg verify) a request's kv_transfer_params before
        it is queued; ValueError (HTTP 400) for unusable ones: nothing is dialled,
        pulled, freed or cached for params that fail here."""
        if raw.get("do_remote_prefill"):
            if not self.connector.kv.is_kv_consumer:
                raise RefusedParams(
                    "kv_transfer_params: this engine is not a KV consumer "
                    f"(kv_role {self.connector.kv.kv_role}) and cannot pull remote KV"
                )
            params = self._verified(raw)
        else:
            params = KVTransferParams.from_wire(raw)
            if params.produce:
                raise RefusedParams(
                    f"kv_transfer_params: {kv_params.PRODUCE_FIELD} goes with a decode leg's "
                    "params (do_remote_prefill); a plain prefill leg asks do_remote_decode"
                )
        self.check(params)
        return params if params.do_remote_prefill or params.do_remote_decode else None

    def check(self, p: KVTransferParams) -> None:
        """ValueError for (verified) params this engine cannot honour."""
        if p.do_remote_prefill:
            if not self.connector.kv.is_kv_consumer:
                raise RefusedParams(
                    "kv_transfer_params: this engine is not a KV consumer "
                    f"(kv_role {self.connector.kv.kv_role}) and cannot pull remote KV"
                )
            for name, value in (
                ("remote_host", p.remote_host),
                ("remote_port", p.remote_port),
                ("remote_block_ids", p.remote_block_ids),
                ("remote_request_id", p.remote_request_id),
                (kv_params.LEASE_FIELD, p.lease_id),
            ):
                if value is None:
                    raise RefusedParams(f"kv_transfer_params: {name} is missing")
            if p.num_blocks:
                # Signed params always name their content; these fields are checked
                # against this engine's own tokens when the request is scheduled.
                if p.block_chain is None or len(p.block_chain) != 64:
                    raise RefusedParams(f"kv_transfer_params: {CHAIN_FIELD} is missing")
                if p.block_hash_algo not in HASH_FUNCTIONS:
                    raise RefusedParams(
                        f"kv_transfer_params: {CHAIN_ALGO_FIELD} must be one of "
                        f"{sorted(HASH_FUNCTIONS)}"
                    )
            why = compat_mismatch(self.connector.compat, p.compat)
            if why is not None:
                raise RefusedParams(f"kv_transfer_params: {why}")
            if p.tp_size is not None:
                # Any TP size maps onto this engine's shards, if it can hold the heads.
                why = tp_layout_mismatch(p.tp_size, self.connector.num_kv_heads)
                if why is not None:
                    raise RefusedParams(f"kv_transfer_params: {why}")
        if p.produces and not self.connector.kv.is_kv_producer:
            raise RefusedParams(
                "kv_transfer_params: this engine is not a KV producer "
                f"(kv_role {self.connector.kv.kv_role})"
            )

    def wait_for_leases(self, timeout: float | None = None) -> int:
        if not self.connector.kv.is_kv_producer:
            return 0
        return self.connector.wait_for_leases(timeout)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if p is None or not p.do_remote_prefill or not self.connector.kv.is_kv_consumer:
            return 0, False
        try:
            # Also for requests that did not come through add_request: the params
            # must still verify (their signature covers their wire form).
            self.check(self._verified(p.to_wire()))
        except ValueError as e:
            logger.warning("request %s: ignoring its kv_transfer_params: %s", request.request_id, e)
            request.kv_transfer_params = p.after_load()
            return 0, False
        bs = self.connector.block_size
        why = self.content_mismatch(request, p)
        if why is not None:
            # Not this prompt's KV (another prompt's params, or the two roles
            # tokenize differently): pull nothing and recompute. The lease is left
            # alone: it may be the lawful decode leg's of another prompt, which may
            # still claim it (else it expires).
            with self.connector.lock:
                self.connector.stats.content_mismatches += 1
            logger.warning(
                "request %s: the KV offered by prefill engine %s is not this prompt's (%s); "
                "nothing pulled, recomputing",
                request.request_id,
                p.remote_engine_id,
                why,
            )
            # A prefill leg that pulls first computes the whole prompt instead, and
            # still leases it for its decode leg.
            request.kv_transfer_params = p.after_load()
            return 0, False
        # Every remote block is verified (content_mismatch): the pulled blocks
        # enter the prefix cache under this engine's own hashes of the same tokens.
        usable = p.num_blocks
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed here: pull nothing.
            usable = 0
        num_external = max(0, usable * bs - num_computed_tokens)
        if num_external == 0 and p.num_blocks:
            # Our own prefix cache covers it: the producer may free its blocks now.
            self.connector.new_loads.put(
                Load(KVLoad(request.request_id, p, [], [], 0.0, release_only=True))
            )
        return num_external, True

    def content_mismatch(self, request: Request, p: KVTransferParams) -> str | None:
        """Why the leased blocks are not this request's prompt, or None when they are.

        The producer signed the chained hash of its last leased block; equal chain
        heads mean equal token ids in every leased block (the chain covers them all).
        This engine hashes its own tokens, with the producer's algorithm."""
        n = p.num_blocks
        if n == 0:
            return None
        bs = self.connector.block_size
        if (request.num_tokens - 1) // bs < n:
            return (
                f"this prompt has {(request.num_tokens - 1) // bs} full blocks before its last "
                f"token, the lease {n}"
            )
        if not hmac.compare_digest(
            self.own_chain(request, p).encode(), str(p.block_chain).encode()
        ):
            return f"the block hash chain of its {n} leased blocks differs"
        return None

    def own_chain(self, request: Request, p: KVTransferParams) -> str:
        """The hex chained hash of this request's first ``p.num_blocks`` blocks (which
        it has: ``content_mismatch`` checked), hashed from this engine's own tokens
        with the producer's algorithm. The claim or read sends it: the producer
        compares it with the chain it computed itself."""
        n = p.num_blocks
        algo = str(p.block_hash_algo)
        if algo == self.connector.hash_algo and len(request.block_hashes) >= n:
            head = request.block_hashes[n - 1]
        else:
            bs = self.connector.block_size
            head = prompt_block_hashes(
                request.all_token_ids,
                bs,
                get_hash_fn(algo),
                n,
                request.sampling_params.cache_salt,
                request.lora_identity,
            )[n - 1]
        return head.hex()

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        p = request.kv_transfer_params
        if p is None or p.remote_block_ids is None:
            raise RuntimeError("broken invariant: p is not None and p.remote_block_ids is not None")
        bs = self.connector.block_size
        first = request.num_computed_tokens // bs
        count = num_external_tokens // bs
        remote_ids = list(p.remote_block_ids[first : first + count])
        budget = self.connector.handshake_timeout + self.connector.transfer_timeout
        local_ids = list(block_ids[first : first + count])
        self.pending.append(
            KVLoad(
                request.request_id,
                p,
                local_ids,
                remote_ids,
                deadline=time.monotonic() + budget,
                chain=self.own_chain(request, p) if p.num_blocks else None,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        if not self.pending:
            return None
        loads, self.pending = self.pending, []
        with self.connector.lock:
            for load in loads:
                self.connector.active[load.request_id] = len(load.local_ids)
        return KVConnectorMetadata(tuple(loads))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        p = request.kv_transfer_params
        if p is None or not p.produces or not self.connector.kv.is_kv_producer:
            return False, None
        # A prefill leg that pulled first (``produce``) leases all its blocks: the
        # pulled ones passed the chain check against its own tokens, the rest were
        # computed here, so the chain below covers both.
        bs = self.connector.block_size
        # Full blocks before the last prompt token: the consumer recomputes that token
        # (it needs its logits), so a block holding it is never pulled.
        full = block_ids[: (request.num_prompt_tokens - 1) // bs]
        lease_id = secrets.token_urlsafe(18)
        with self.connector.lock:
            # One lease per request id: a repeated id never takes over held blocks.
            duplicate = any(
                x.request_id == request.request_id for x in self.connector.held.values()
            )
        if duplicate:
            full = []
        own = self.connector.identity.own
        params = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.connector.engine_id,
            remote_instance_id=self.connector.instance_id,
            remote_host=self.connector.host,
            remote_port=self.connector.port,
            remote_block_ids=tuple(full),
            remote_request_id=request.request_id,
            tp_size=self.connector.config.parallel_config.tensor_parallel_size,
            lease_id=lease_id,
            compat=self.connector.compat,
            compat_hash=self.connector.compat_hash,
            # The content of the lease: every leased block's tokens, through the chain.
            block_chain=request.block_hashes[len(full) - 1].hex() if full else None,
            block_hash_algo=self.connector.hash_algo,
            producer=None if own is None else own.claims.subject,
        )
        # The signature outlives the lease by a margin: a decode leg that arrives after
        # the lease recomputes (the producer refuses the pull) instead of failing;
        # one that arrives later still is refused (400).
        signed = kv_params.sign(
            self.connector.secret,
            params,
            ttl=self.connector.lease_seconds + self.connector.params_grace,
        )
        if not full:
            return False, signed
        with self.connector.lock:
            self.connector.held[lease_id] = Lease(
                request.request_id,
                list(full),
                time.monotonic() + self.connector.lease_seconds,
                chain=params.block_chain,
            )
        return True, signed

    def request_aborted(self, request: Request) -> bool:
        """Drop the request's pending load; True when a transfer may still write its
        blocks (the scheduler then quarantines them)."""
        self.pending = [x for x in self.pending if x.request_id != request.request_id]
        if self.connector.pull_in_flight(request.request_id):
            self.connector.cancel.put(request.request_id)
            return True
        return False

    def pull_in_flight(self, request: Request) -> bool:
        return self.connector.pull_in_flight(request.request_id)

    def load_failed(self, request: Request) -> str | None:
        why = self.connector.errors.pop(request.request_id, "the transfer failed")
        if why.startswith(FATAL):
            return why[len(FATAL) :]
        if why.startswith(CONTENT):
            return None  # not this prompt's KV: recomputing is the only right answer
        if self.connector.fail_policy == "fail":
            return (
                f"pulling the prompt's KV from the prefill engine failed ({why}); "
                "kv_load_failure_policy is fail"
            )
        return None

    def unhealthy(self) -> str | None:
        return self.connector.unhealthy


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, connector: PDConnector) -> None:
        self.connector = connector

    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], buffer: Any = None) -> None:
        if buffer is None:
            raise RuntimeError("the connector needs the contiguous KV buffer")
        self.connector.register(buffer)

    def register_shards(self, layout: KVLayout, shards: list[ShardInfo]) -> None:
        self.connector.register_shards(layout, shards)

    def rank_agents(self) -> KVAgentSpec | None:
        transport = self.connector.transport
        if not isinstance(transport, NixlTransport):
            return None
        # Only a consumer's ranks read, and report the reads that ended.
        return KVAgentSpec(
            transport.agent_name, list(transport.backends), self.connector.kv.is_kv_consumer
        )

    def shard_commands(self) -> list[RankCommand]:
        transport = self.connector.transport
        return transport.drain() if isinstance(transport, NixlTransport) else []

    def shard_reads_ended(self, rank: int, ended: list[ShardReadEnded]) -> None:
        transport = self.connector.transport
        if isinstance(transport, NixlTransport):
            transport.deliver(rank, ended)

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        for load in metadata.loads if metadata is not None else ():
            self.connector.new_loads.put(Load(load))

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        connector = self.connector
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        with connector.lock:
            sending.update(connector.freed)
            connector.freed.clear()
            for lid, lease in list(connector.held.items()):
                if lease.expires < now:
                    del connector.held[lid]
                    sending.add(lease.request_id)
                    connector.stats.expired_leases += 1
                    logger.info("lease of %s expired unclaimed; blocks freed", lease.request_id)
            sending.update(QUARANTINE + rid for rid in connector.unquarantined)
            connector.unquarantined.clear()
        while True:
            try:
                rid, ok, why = connector.done.get_nowait()
            except queue.Empty:
                break
            if ok:
                recving.add(rid)
            else:
                failed.add(rid)
                connector.errors[rid] = why
        while len(connector.errors) > 4096:  # errors of requests aborted meanwhile
            del connector.errors[next(iter(connector.errors))]
        return sending, recving, failed

    def shutdown(self) -> None:
        self.connector.shutdown()


def create_connector(config: EngineConfig) -> tuple[PDConnectorScheduler, PDConnectorWorker]:
    c = PDConnector(config)
    return PDConnectorScheduler(c), PDConnectorWorker(c)
