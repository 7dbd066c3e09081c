"""LoRA adapters on the base model: PEFT loading, the per-step batch of adapter
slots, the segmented LoRA matmul and the device/host adapter caches.

See docs/lora.md. ``adapter`` reads and checks PEFT directories (no model
code), ``ops`` is the matmul the model's projections call, ``manager`` the
runner's caches.
"""

from .adapter import TARGET_MODULES, LoRAAdapter, LoRAError, LoRARequest, load_adapter

__all__ = ["TARGET_MODULES", "LoRAAdapter", "LoRAError", "LoRARequest", "load_adapter"]
