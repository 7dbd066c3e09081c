"""The host-memory tier of the KV cache: which block hashes live in which host slot.

Pure bookkeeping (no tensors): the worker holds the slots' bytes
(``worker/host_kv.py``) and moves blocks when the scheduler's
:class:`KVOffloadOps` say so. A slot is *pending* from the moment a
device-to-host copy into it is queued until the worker reports the copy done;
only then is it *ready*: a lookup finds it, and a ``stored`` event with
``medium="CPU"`` announces it. Ready entries are evicted least recently used
first (a ``removed`` event on ``CPU``); pending ones are never evicted.
See docs/kv_offload.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .block_pool import KVCacheEvent

HOST_MEDIUM = "CPU"
"""The tier name KV events carry for host-memory blocks (vLLM's)."""


@dataclass(eq=False)
class HostBlock:
    slot: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None
    ready: bool = False
    # Set when the tier was cleared while the copy was in flight: the slot is
    # freed when it lands, nothing is published.
    dropped: bool = False


@dataclass
class KVOffloadOps:
    """One step's host-tier copies, for the worker (plain data).

    The worker issues ``stores`` first (device block -> host slot; off the
    critical path: a side stream on CUDA), then, when ``wait_stores`` is set
    (this step overwrites a device block whose store is still in flight),
    orders the step's writes after every pending store, then runs ``loads``
    (host slot -> device block) before the forward pass.
    """

    stores: list[tuple[int, int]] = field(default_factory=list)
    """(device block id, host slot) pairs."""
    loads: list[tuple[int, int]] = field(default_factory=list)
    """(host slot, device block id) pairs."""
    wait_stores: bool = False

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.wait_stores)


class HostTier:
    """Fixed number of host slots keyed by block hash, LRU among ready entries."""

    def __init__(self, num_slots: int, record_events: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))
        # Ready and pending entries by hash, least recently used first.
        self.entries: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.pending: dict[int, HostBlock] = {}
        # Slots this step loads from: never evicted before the step's copies run.
        self.pinned: set[int] = set()
        self.record_events = record_events
        self.events: list[KVCacheEvent] = []
        self.num_stored = 0
        """Blocks whose device-to-host copy landed (cumulative)."""
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        """Slots holding a block or receiving one."""
        return self.num_slots - len(self.free_slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def get(
        self, block_hash: bytes, token_ids: tuple[int, ...], parent_hash: bytes | None
    ) -> HostBlock | None:
        """The ready entry for this hash, only if its tokens and parent also match."""
        entry = self.entries.get(block_hash)
        if (
            entry is None
            or not entry.ready
            or entry.token_ids != token_ids
            or entry.parent_hash != parent_hash
        ):
            return None
        return entry

    def touch(self, block_hash: bytes) -> None:
        """Mutates: mark the entry most recently used."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def pin(self, slot: int) -> None:
        """Mutates: this step loads from ``slot``; keep it until :meth:`unpin_all`."""
        self.pinned.add(slot)

    def unpin_all(self) -> None:
        """Mutates: the step's copies were handed to the worker (which issues
        loads before any later step's stores)."""
        self.pinned.clear()

    def reserve(
        self, block_hash: bytes, token_ids: tuple[int, ...], parent_hash: bytes | None
    ) -> HostBlock | None:
        """Mutates: a pending entry for a block about to be copied in, evicting the
        least recently used ready entry when no slot is free. None when every
        slot is pending (or the hash is already here)."""
        if block_hash in self.entries:
            return None
        if not self.free_slots and not self._evict_one():
            return None
        entry = HostBlock(self.free_slots.pop(), block_hash, token_ids, parent_hash)
        self.entries[block_hash] = entry
        self.pending[entry.slot] = entry
        return entry

    def _evict_one(self) -> bool:
        for block_hash, entry in self.entries.items():
            if entry.ready and entry.slot not in self.pinned:
                del self.entries[block_hash]
                self.free_slots.append(entry.slot)
                self.num_evictions += 1
                if self.record_events:
                    self.events.append(KVCacheEvent("removed", block_hash, medium=HOST_MEDIUM))
                return True
        return False

    def store_done(self, slot: int) -> bytes | None:
        """Mutates: the copy into ``slot`` landed; the entry becomes ready (and is
        announced). Returns its hash (None for a dropped or unknown slot)."""
        entry = self.pending.pop(slot, None)
        if entry is None:
            return None
        if entry.dropped:
            self.free_slots.append(slot)
            return None
        entry.ready = True
        self.num_stored += 1
        if self.record_events:
            self.events.append(
                KVCacheEvent(
                    "stored",
                    entry.block_hash,
                    entry.parent_hash,
                    entry.token_ids,
                    len(entry.token_ids),
                    medium=HOST_MEDIUM,
                )
            )
        return entry.block_hash

    def store_failed(self, slot: int) -> None:
        """Mutates: the copy into ``slot`` never ran (a failed step); forget it."""
        entry = self.pending.pop(slot, None)
        if entry is None:
            return
        if self.entries.get(entry.block_hash) is entry:
            del self.entries[entry.block_hash]
        self.free_slots.append(slot)

    def clear(self) -> None:
        """Mutates: forget every entry (no events: the caller sends one
        ``cleared`` for both tiers). In-flight copies free their slots on landing."""
        for entry in self.entries.values():
            if entry.ready:
                self.free_slots.append(entry.slot)
            else:
                entry.dropped = True
        self.entries.clear()

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
