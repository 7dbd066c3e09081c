"""The runner's adapter caches: ``max_loras`` device slots and ``max_cpu_loras``
host copies, each least-recently-used first out.

An adapter is read from its directory into the host cache when a step first
needs it (or when the engine loads it), copied into a free device slot (or
the least recently used slot no row of the step uses), and stays there until
evicted. The scheduler never puts more than ``max_loras`` adapters in one
step, so a step always finds slots for all of its adapters.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config.lora import LoRAConfig
from ..distributed.parallel_state import get_tp_group
from ..testing_hooks import lora_unreadable
from .adapter import LoRAAdapter, LoRAError, LoRARequest, Slicer, load_adapter
from .ops import LoRABatch, LoRAContext, LoRAShard, make_batch

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    """Counters since the start (read by the metrics)."""

    loads: int = 0
    """Adapters read from disk."""
    load_seconds: float = 0.0
    cpu_evictions: int = 0
    gpu_evictions: int = 0
    slot_loads: int = 0
    """Copies of an adapter into a device slot."""
    loaded: list[str] = field(default_factory=list)
    """Names of the adapters in device slots."""
    cached: list[str] = field(default_factory=list)
    """Names of the adapters in host memory."""
    resident: dict[str, str] = field(default_factory=dict)
    """Served adapters whose weights are resident: name -> "device" (a device
    slot) or "host" (host memory only)."""


class LoRAManager:
    """Owns the LoRA slots of every target projection of ``model``."""

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        num_layers: int,
        shapes: dict[str, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        slicer: Slicer | None = None,
        use_triton: Callable[[], bool] = lambda: False,
        in_use: Callable[[], set[int]] = set,
        admitted: Callable[[], set[int]] = set,
    ) -> None:
        self.config = config
        self.num_layers, self.shapes = num_layers, shapes
        self.dtype, self.device, self.slicer = dtype, device, slicer
        self.rank = config.max_lora_rank
        self.use_triton = use_triton
        # The load ids of the adapters the runner's requests run with: their host
        # copies are never evicted, so a running request never needs its
        # directory again.
        self.in_use = in_use
        # The load ids of the adapters of every request admitted and not
        # finished (waiting, preempted or running): an unloaded adapter's host
        # copy stays (pinned) until the last of them is done. A loaded adapter
        # of a waiting request may be evicted and read again from its directory.
        self.admitted = admitted
        self.retired: set[int] = set()
        """Unloaded adapters kept (pinned in host memory) until their requests
        finish."""
        self.sources: dict[int, tuple[LoRARequest, str]] = {}
        """Every adapter loaded and not removed, by load id: where it was read
        from, and the digest of what was read (a copy read again after an
        eviction must be the same bytes)."""
        self.context = LoRAContext()
        # (layer, HF module name) -> the shard that module's delta goes to.
        self.shards: dict[tuple[int, str], LoRAShard] = {}
        layers = model.get_submodule("layers")
        if not isinstance(layers, nn.ModuleList):
            raise TypeError("broken invariant: isinstance(layers, nn.ModuleList)")
        n = config.max_loras
        for i, layer in enumerate(layers):
            for proj, names in (
                ("self_attn.qkv_proj", {"q": "q_proj", "k": "k_proj", "v": "v_proj"}),
                ("mlp.gate_up_proj", {"gate": "gate_proj", "up": "up_proj"}),
            ):
                module: Any = layer.get_submodule(proj)  # a MergedLinear
                shards = []
                for shard, hf in names.items():
                    off, size = module.shard_offsets[shard]
                    s = LoRAShard(off, size, module.weight.shape[1], n, self.rank, dtype, device)
                    self.shards[(i, hf)] = s
                    shards.append(s)
                module.lora = (shards, self.context)
            for proj, hf in (("self_attn.o_proj", "o_proj"), ("mlp.down_proj", "down_proj")):
                module = layer.get_submodule(proj)  # a RowParallelLinear
                out_f, in_f = module.weight.shape
                s = LoRAShard(0, out_f, in_f, n, self.rank, dtype, device)
                self.shards[(i, hf)] = s
                module.lora = ([s], self.context)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, LRU first
        self.slots: list[int | None] = [None] * n  # lora_int_id per device slot
        self.slot_used: list[float] = [0.0] * n
        self.stats = LoRAStats()

    # -- host cache ----------------------------------------------------------------

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter from disk (raises LoRAError naming it).

        Touches nothing of the manager: safe off the engine thread (a run-time
        load reads there, so the step loop never waits on the disk)."""
        start = time.perf_counter()
        adapter = load_adapter(
            request, self.num_layers, self.shapes, self.rank, self.dtype, self.slicer
        )
        adapter.read_seconds = time.perf_counter() - start
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        """Keep a read adapter in host memory (evicting the least recently used);
        the engine thread only."""
        self.stats.loads += 1
        self.stats.load_seconds += adapter.read_seconds
        self.sources.setdefault(
            adapter.int_id,
            (LoRARequest(adapter.name, adapter.int_id, adapter.path), adapter.digest),
        )
        self.host[adapter.int_id] = adapter
        self.host.move_to_end(adapter.int_id)
        limit = self.config.max_cpu_loras or self.config.max_loras
        if len(self.host) <= limit:
            return
        # The least recently used copies no running request needs, nor the
        # requests of an unloaded adapter. The limit is passed by this one
        # adapter (the scheduler runs at most --max-loras adapters at once, and
        # --max-cpu-loras >= --max-loras) and by unloaded adapters still in use.
        pinned = self.in_use() | self.retired | {adapter.int_id}
        for victim in [i for i in self.host if i not in pinned][: len(self.host) - limit]:
            del self.host[victim]
            self.stats.cpu_evictions += 1

    def remove(self, int_id: int) -> str | None:
        """Forget an adapter (unloaded): host copy and device slot, at once when
        no admitted request uses it, else once the last of them has finished.
        A copy evicted from host memory that such requests still need is read
        again now, while its directory is surely there: the caller may delete
        it right after the unload. Returns why such a copy could not be read
        (its requests then fail when they run), else None."""
        if int_id in self.in_use() | self.admitted():
            self.retired.add(int_id)
            if int_id not in self.host and int_id in self.sources:
                try:
                    self._get(self.sources[int_id][0])
                except LoRAError as e:
                    logger.warning("unloaded LoRA adapter still in use is unreadable: %s", e)
                    return str(e)
            return None
        self._drop(int_id)
        return None

    def _drop(self, int_id: int) -> None:
        self.retired.discard(int_id)
        self.sources.pop(int_id, None)
        self.host.pop(int_id, None)
        for slot, held in enumerate(self.slots):
            if held == int_id:
                self._fill(slot, None)

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            if lora_unreadable(get_tp_group().rank, request.lora_name):
                raise LoRAError(f"LoRA adapter {request.lora_name!r}: unreadable (test hook)")
            adapter = self.read(request)
            loaded = self.sources.get(request.lora_int_id)
            if loaded is not None and adapter.digest != loaded[1]:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r}: its files at {request.lora_path!r} "
                    "changed since it was loaded; load it again"
                )
            self.add(adapter)
        else:
            self.host.move_to_end(request.lora_int_id)
        return adapter

    # -- device slots --------------------------------------------------------------

    def _fill(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for key, shard in self.shards.items():
            pair = adapter.weights.get(key) if adapter is not None else None
            if pair is None:
                shard.set_slot(slot, None, None)
            else:
                shard.set_slot(slot, pair[0].to(self.device), pair[1].to(self.device))
        self.slots[slot] = adapter.int_id if adapter is not None else None

    def activate(
        self, requests: list[LoRARequest], failed: dict[int, str] | None = None
    ) -> dict[int, int]:
        """Device slots for a step's adapters: {lora_int_id: slot}. With
        ``failed``, an adapter that cannot be read (LoRAError) gets no slot and
        its message lands in ``failed`` by load id; without it, that raises."""
        wanted = {r.lora_int_id: r for r in requests}
        if self.retired:
            running = self.in_use() | self.admitted()
            for int_id in [i for i in self.retired if i not in running]:
                self._drop(int_id)
        if len(wanted) > len(self.slots):
            raise RuntimeError(
                f"a step holds {len(wanted)} LoRA adapters, more than --max-loras {len(self.slots)}"
            )
        now = time.monotonic()
        out: dict[int, int] = {}
        for slot, held in enumerate(self.slots):
            if held in wanted:
                out[held] = slot
        for int_id, request in wanted.items():
            if int_id in out:
                continue
            try:
                adapter = self._get(request)
            except LoRAError as e:
                if failed is None:
                    raise
                failed[int_id] = str(e)
                continue
            free = [s for s, held in enumerate(self.slots) if held is None]
            if free:
                slot = free[0]
            else:
                # The least recently used slot no adapter of this step holds.
                slot = min(
                    (s for s, held in enumerate(self.slots) if held not in wanted),
                    key=lambda s: self.slot_used[s],
                )
                self.stats.gpu_evictions += 1
            self._fill(slot, adapter)
            self.stats.slot_loads += 1
            out[int_id] = slot
        for int_id, slot in out.items():
            self.slot_used[slot] = now
            if int_id in self.host:
                self.host.move_to_end(int_id)
        return out

    def begin_step(self, segments: list[tuple[int, int, int]], num_tokens: int) -> LoRABatch | None:
        """Set the step's batch on every projection (None: base rows only)."""
        batch = make_batch(
            segments, num_tokens, self.rank, self.dtype, self.device, self.use_triton()
        )
        self.context.batch = batch
        return batch

    def end_step(self) -> None:
        self.context.batch = None

    def snapshot(self) -> LoRAStats:
        # By load id: a slot's adapter may have left the host cache since.
        names = {i: r.lora_name for i, (r, _) in self.sources.items()}
        self.stats.loaded = [names.get(i, str(i)) for i in self.slots if i is not None]
        self.stats.cached = [names.get(i, str(i)) for i in self.host]
        # An unloaded adapter kept for its requests (retired) is served no more:
        # not resident as far as routing goes (its name may be loaded again).
        resident = {names[i]: "host" for i in self.host if i in names and i not in self.retired}
        for i in self.slots:
            if i is not None and i in names and i not in self.retired:
                resident[names[i]] = "device"
        self.stats.resident = resident
        return self.stats
