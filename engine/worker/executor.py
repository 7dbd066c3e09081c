"""What the engine step needs of whatever runs the model.

Two implementations: :class:`~.model_runner.ModelRunner` (the model in this
process) and :class:`~.tp_executor.TPExecutor` (tensor-parallel ranks in child
processes, driven by broadcast steps). ``EngineCore`` holds one as an
``Executor`` and calls nothing else of it, so neither is probed by type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..core.sched_output import ModelRunnerOutput, SchedulerOutput
from ..lora.adapter import LoRARequest
from ..lora.manager import LoRAStats


class Executor(Protocol):
    @property
    def num_blocks(self) -> int:
        """KV-cache blocks per layer the scheduler may hand out (block 0 included)."""
        ...

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier (0: none)."""
        ...

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; raises if the model (or a rank) failed."""
        ...

    def unissued_stores(self, slots: list[int]) -> list[int]:
        """Of a failed step's host-tier store slots, those never started."""
        ...

    def host_kv_bytes(self) -> tuple[int, int]:
        """Bytes copied to and from the host tier since the start (stored, loaded)."""
        ...

    def attach_grammars(self, grammars: Any) -> None:
        """Hand over the grammar compiler that constrained requests' matchers come
        from; raises ``TypeError`` where grammars cannot run."""
        ...

    def read_lora(self, request: LoRARequest) -> Any:
        """Read and check a LoRA adapter (raises LoRAError naming it); what it
        returns has the ``digest`` of the bytes read (``LoRAAdapter.digest``).
        Changes nothing: callable from any thread."""
        ...

    def install_lora(self, read: Any) -> None:
        """Keep what :meth:`read_lora` returned in the caches (the engine thread)."""
        ...

    def remove_lora(self, lora_int_id: int) -> str | None:
        """Drop an unloaded adapter from the caches (kept while requests
        :meth:`pin_loras` names still need it); None, or why a kept copy
        evicted earlier could not be read again for them."""
        ...

    def pin_loras(self, admitted: Callable[[], set[int]]) -> None:
        """The load ids of the adapters of the scheduler's admitted requests
        (waiting, preempted or running), read when an adapter is unloaded."""
        ...

    def lora_stats(self) -> LoRAStats | None:
        """The adapter caches' counters (None: not known here)."""
        ...

    def shutdown(self) -> None:
        """Stop what the executor started (rank processes); idempotent."""
        ...
