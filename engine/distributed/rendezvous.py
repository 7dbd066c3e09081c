"""Rendezvous of the engine's processes on one TCPStore (bounded waits).

Two groups share the store: the *control* group (gloo; the main process is
its rank 0, tensor-parallel rank r is its rank r + 1) carries the packed step
from the scheduler to the ranks, and the *tensor-parallel* group (NCCL on
CUDA, gloo on CPU; the ranks only) carries the layers' collectives.
"""

from __future__ import annotations

import datetime
import os
from typing import cast

import torch
import torch.distributed as dist

from .parallel_state import TPGroup

RENDEZVOUS_TIMEOUT_ENV = "PDFLEET_TP_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 120.0
# Ranks wait on the control group for the next step for as long as the engine idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# A collective inside one step (the tensor-parallel group) never takes this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def rendezvous_timeout() -> float:
    """Seconds a rendezvous may take ($PDFLEET_TP_RENDEZVOUS_TIMEOUT)."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_RENDEZVOUS_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${RENDEZVOUS_TIMEOUT_ENV} must be seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"${RENDEZVOUS_TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def master_store(host: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """The store the main process serves (port 0: a free one)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def client_store(host: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )


def store_bytes(store: dist.Store, key: str, value: bytes) -> None:
    """Set ``key`` to the bytes ``value`` (a msgpack record of
    ``contracts/tp_wire.py``). torch's stub types the value ``str``; its binding
    takes bytes as they are (a C++ ``std::string``), and ``get`` returns them."""
    store.set(key, cast(str, value))


def control_group(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """The gloo group of the main process (rank 0) and the ranks; not the default group,
    so several engines can live in one process."""
    group = dist.ProcessGroupGloo(dist.PrefixStore("ctl", store), rank, world_size, timeout)
    # A gloo Backend, which torch.distributed collectives accept wherever a group goes.
    return cast(dist.ProcessGroup, group)


def join_tp_group(store: dist.Store, rank: int, size: int, backend: str) -> TPGroup:
    """Init the default group of a rank process as the tensor-parallel group, and check
    that every rank agrees on its size (a mismatch is a clear error, not a hang)."""
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("tp", store),
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    group = TPGroup(rank, size, dist.group.WORLD)
    device = group.device
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(sizes, mine)
    seen = [int(t.item()) for t in sizes]
    if any(s != size for s in seen):
        raise ValueError(
            f"tensor-parallel ranks disagree on the world size ({seen}); start every rank "
            "with the same --tensor-parallel-size"
        )
    return group
