"""Engine configuration: typed sub-configs, ``EngineArgs`` and their resolution.

Imports without torch: the operator resolves engine configurations on
machines that have no accelerator and no torch.
"""

from .admission import AdmissionConfig
from .args import UNSUPPORTED, EngineArgs, UsageContext
from .cache import CacheConfig
from .compilation import CompilationConfig
from .device import DeviceConfig
from .engine import EngineConfig, default_capture_sizes
from .fields import (
    ConfigValueError,
    expand_json_human_numbers,
    parse_human_int,
    parse_human_int_or_auto,
)
from .kv_events import KVEventsConfig
from .kv_transfer import KNOWN_CONNECTORS, KVTransferConfig
from .load import LoadConfig
from .lora import LoRAConfig
from .model import SUPPORTED_ARCHITECTURES, ModelConfig
from .observability import ObservabilityConfig
from .parallel import ParallelConfig
from .parser import FlexibleArgumentParser
from .scheduler import SchedulerConfig

__all__ = [
    "KNOWN_CONNECTORS",
    "SUPPORTED_ARCHITECTURES",
    "UNSUPPORTED",
    "AdmissionConfig",
    "CacheConfig",
    "CompilationConfig",
    "ConfigValueError",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "FlexibleArgumentParser",
    "KVEventsConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "UsageContext",
    "default_capture_sizes",
    "expand_json_human_numbers",
    "parse_human_int",
    "parse_human_int_or_auto",
]
