"""The KV connector interface, split by side (as vLLM's v1 connectors).

* The **scheduler side** decides: how many of a request's prompt tokens can be
  loaded from a remote engine, what to do after blocks are allocated for
  them, what metadata the worker needs each step, and whether a finished
  request's blocks must be held for a consumer.
* The **worker side** moves bytes: it starts loads described by the metadata,
  and reports which sends and receives have finished (or failed).

The defaults do nothing, so an engine without a connector runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..contracts.kv_connector import KVConnectorMetadata, RankCommand, ShardInfo, ShardReadEnded
from ..contracts.kv_params import KVTransferParams
from ..contracts.tp_wire import KVAgentSpec
from ..core.sched_output import SchedulerOutput
from ..request import Request


@dataclass(frozen=True, slots=True)
class KVConnectorStats:
    """What a connector tells the metrics exporter at each step: its cumulative
    counters (monotonic), its gauges now, and the pulls finished since the
    last snapshot (``transfer_seconds``, drained by taking the snapshot)."""

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
    """Side-channel reads refused, by the connector or its server (rate or size)."""
    transfer_seconds: tuple[float, ...] = ()
    """Durations of the pulls finished since the previous snapshot."""
    per_producer: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Confirmed pulls per producer engine id: (pulls, bytes, seconds)."""
    remote_engines: int = 0
    pulls_in_flight: int = 0
    quarantined_blocks: int = 0
    pull_bandwidth: float = 0.0
    """Bytes per second, the mean of the recent measured pulls."""
    degraded: bool = False
    """The pull bandwidth is under the configured floor."""
    block_bytes: int | None = None
    """KV bytes of one block, all layers; None until the caches are registered."""
    shard_bytes: tuple[int, ...] = ()
    """Bytes each tensor-parallel shard pulled (rank order; empty at TP=1 without shards)."""


class KVConnectorScheduler:
    def stats_snapshot(self) -> KVConnectorStats | None:
        """The connector's figures now for the metrics exporter (engine thread,
        after a step); drains the finished pulls' durations. None: no figures."""
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens beyond ``num_computed_tokens`` a remote engine can provide,
        whether they load asynchronously). Called once when a request is first
        considered for scheduling; must not block."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks for the external tokens are allocated: remember what to load."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """Metadata for the worker side for this step (loads to start)."""
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """(hold the blocks until the worker reports the send finished,
        kv_transfer_params to return to the client)."""
        return False, None

    def request_aborted(self, request: Request) -> bool:
        """A request waiting for remote KV was aborted. True when a transfer may still
        write its blocks: the scheduler then quarantines them (held under
        ``QUARANTINE + request_id``, ``core/connector_side.py``) until the worker
        reports that key finished."""
        return False

    def pull_in_flight(self, request: Request) -> bool:
        """Whether a (failed or timed-out) transfer may still write the request's
        blocks; if so the scheduler quarantines them as for an abort."""
        return False

    def unhealthy(self) -> str | None:
        """Why the engine must report itself unhealthy (e.g. a quarantine past its
        bound), or None."""
        return None

    def load_failed(self, request: Request) -> str | None:
        """A remote load failed: an error message to fail the request with, or None
        to recompute the prompt locally."""
        return None

    def accept(self, raw: Mapping[str, Any]) -> KVTransferParams | None:
        """A request's ``kv_transfer_params`` as it arrived, decoded (and, for a
        decode leg, verified): what the request carries from now on. ValueError
        (HTTP 400, nothing queued) for params this engine cannot honour."""
        return None

    def wait_for_leases(self, timeout: float | None = None) -> int:
        """Block until every lease this engine holds for a consumer is claimed or
        expired (bounded); the engine loop keeps stepping meanwhile. Returns the
        leases left."""
        return 0


class KVConnectorWorker:
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], buffer: Any = None) -> None:
        """The per-layer (key, value) cache views and the contiguous buffer behind them."""

    def rank_agents(self) -> KVAgentSpec | None:
        """At TP>1: how each rank process sets up its own shard's transfer agent
        (``nixl_shard.ShardAgent``), or None when the connector needs none."""
        return None

    def register_shards(self, layout: Any, shards: list[ShardInfo]) -> None:
        """At TP>1: the ranks registered their KV shards (rank order)."""

    def shard_commands(self) -> list[RankCommand]:
        """At TP>1: the commands for the ranks' shards, shipped with the next step.
        Drains (mutates)."""
        return []

    def shard_reads_ended(self, rank: int, ended: list[ShardReadEnded]) -> None:
        """At TP>1: a rank's reads that ended during the step."""

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Start the loads in ``metadata`` (non-blocking)."""

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids
        since the last call. Never blocks."""
        return set(), set(), set()

    def shutdown(self) -> None:
        """Release transfer resources (bounded)."""


class KVConnector(NamedTuple):
    """One connector's two sides, as the engine core hands them out: the
    scheduler side to the scheduler, the worker side to the model runner."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
