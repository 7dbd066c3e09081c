"""What the scheduler asks of a KV connector: the connector's scheduler side
as the scheduler sees it.

The scheduler depends on this protocol, not on ``engine/kv_transfer/``: the
connector package sits above the core (it reads ``SchedulerOutput`` and the
scheduler's requests), so the core never imports it back.
``kv_transfer/base.py``'s ``KVConnectorScheduler`` (the do-nothing default
every connector extends) satisfies it, and mypy checks that where the engine
hands a connector to the scheduler.
"""

from __future__ import annotations

from typing import Protocol

from ..contracts.kv_connector import KVConnectorMetadata
from ..contracts.kv_params import KVTransferParams
from ..request import Request
from .sched_output import SchedulerOutput

QUARANTINE = "quarantine:"
"""Prefix of a held-block key: ``QUARANTINE + request_id`` holds a request's
pull targets that a transfer may still write, until the connector's worker
side reports that key finished."""


class SchedulerConnector(Protocol):
    """The scheduler's calls into a connector, all on the engine thread and
    none blocking (``kv_transfer/base.py`` documents each)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata | None: ...

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]: ...

    def request_aborted(self, request: Request) -> bool: ...

    def pull_in_flight(self, request: Request) -> bool: ...

    def load_failed(self, request: Request) -> str | None: ...
