"""``EngineArgs``: the flat argument surface, its CLI flags and default resolution.

Each field is declared once, with its type; its help text is the docstring of
the sub-config field it feeds (``source``) or its own. Flags are derived from
the fields: bool -> ``--x/--no-x``, Literal -> choices, Optional -> accepts
``None``, list -> several values, nested config or dict -> JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import platform
from dataclasses import dataclass, field
from typing import Any, Literal

from .admission import AdmissionConfig
from .cache import DEFAULT_BLOCK_SIZE, CacheConfig, CacheDType, PrefixCachingHashAlgo
from .compilation import CompilationConfig
from .device import AttentionBackend, Device, DeviceConfig, detect_device, query_device
from .engine import EngineConfig, PerformanceMode
from .fields import (
    ConfigValueError,
    FieldBounds,
    argparse_kwargs,
    attr_docs,
    coerce,
    default_of,
    field_bounds,
    flag_name,
    resolved_fields,
    to_jsonable,
)
from .kv_events import KVEventsConfig
from .kv_transfer import KVTransferConfig
from .load import LoadConfig, LoadFormat
from .lora import LoRAConfig, parse_lora_modules
from .model import ModelConfig, ModelDType
from .observability import ObservabilityConfig
from .parallel import ParallelConfig
from .parser import record_argument
from .scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
    SchedulerPolicy,
)

logger = logging.getLogger(__name__)

UsageContext = Literal["llm", "server"]
GiB = 1 << 30


def _from(cls: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """A field fed into ``cls.name``: same default unless given, same help."""
    if default is dataclasses.MISSING:
        source = {f.name: f for f in dataclasses.fields(cls)}[name]
        default = default_of(source)
    meta = {"source": (cls, name)}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return field(default=default, metadata=meta)


def _own(group: str, default: Any = None, factory: Any = None) -> Any:
    meta = {"group": group}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# Flags kept so that vLLM command lines give a clear error instead of an
# unknown-argument failure: (field, value that means "not used", what it is).
UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("trust_remote_code", False, "running a model directory's own code"),
    ("quantization", None, "weight quantization"),
    ("pipeline_parallel_size", 1, "pipeline parallelism"),
    ("data_parallel_size", 1, "in-engine data parallelism (scale with more engine replicas)"),
    ("max_num_partial_prefills", 1, "concurrent partial prefills"),
    ("max_long_partial_prefills", 1, "concurrent partial prefills"),
    ("speculative_config", None, "speculative decoding"),
    ("cpu_offload_gb", 0.0, "CPU weight offloading"),
    ("enable_expert_parallel", False, "expert parallelism (MoE models)"),
    ("limit_mm_per_prompt", {}, "multimodal inputs"),
    ("async_scheduling", None, "asynchronous scheduling"),
    ("enable_sleep_mode", False, "sleep mode"),
    ("lora_dtype", "auto", "a LoRA dtype other than the model's (auto)"),
    ("fully_sharded_loras", False, "fully sharded LoRA (both matrices split over ranks)"),
    ("default_mm_loras", None, "multimodal default LoRA adapters"),
)


@dataclass
class EngineArgs:
    """Arguments of a pdfleet engine (vLLM's names and defaults)."""

    # ModelConfig
    model: str = _from(ModelConfig, "model")
    tokenizer: str | None = _from(ModelConfig, "tokenizer")
    revision: str | None = _from(ModelConfig, "revision")
    served_model_name: list[str] | None = _from(ModelConfig, "served_model_name")
    dtype: ModelDType = _from(ModelConfig, "dtype")
    seed: int = _from(ModelConfig, "seed")
    max_model_len: int | None = _from(ModelConfig, "max_model_len")
    enforce_eager: bool = _from(ModelConfig, "enforce_eager")
    max_logprobs: int = _from(ModelConfig, "max_logprobs")
    disable_sliding_window: bool = _from(ModelConfig, "disable_sliding_window")
    skip_tokenizer_init: bool = _from(ModelConfig, "skip_tokenizer_init")
    generation_config: str = _from(ModelConfig, "generation_config")
    override_generation_config: dict[str, Any] = _from(ModelConfig, "override_generation_config")
    hf_overrides: dict[str, Any] = _from(ModelConfig, "hf_overrides")
    trust_remote_code: bool = _from(ModelConfig, "trust_remote_code")
    quantization: str | None = _from(ModelConfig, "quantization")
    # LoadConfig
    load_format: LoadFormat = _from(LoadConfig, "load_format")
    use_tqdm_on_load: bool = _from(LoadConfig, "use_tqdm_on_load")
    # DeviceConfig
    device: Device = _from(DeviceConfig, "device")
    attention_backend: AttentionBackend | None = _from(DeviceConfig, "attention_backend")
    # ParallelConfig
    tensor_parallel_size: int = _from(ParallelConfig, "tensor_parallel_size")
    pipeline_parallel_size: int = _from(ParallelConfig, "pipeline_parallel_size")
    data_parallel_size: int = _from(ParallelConfig, "data_parallel_size")
    nnodes: int = _from(ParallelConfig, "nnodes")
    node_rank: int = _from(ParallelConfig, "node_rank")
    master_addr: str = _from(ParallelConfig, "master_addr")
    master_port: int = _from(ParallelConfig, "master_port")
    headless: bool = _from(ParallelConfig, "headless")
    # CacheConfig
    block_size: int | None = _from(CacheConfig, "block_size", None)
    gpu_memory_utilization: float = _from(CacheConfig, "gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = _from(CacheConfig, "kv_cache_memory_bytes")
    kv_offload_bytes: int | None = _from(CacheConfig, "kv_offload_bytes")
    kv_cache_dtype: CacheDType = _from(CacheConfig, "cache_dtype")
    num_gpu_blocks_override: int | None = _from(CacheConfig, "num_gpu_blocks_override")
    enable_prefix_caching: bool | None = _from(CacheConfig, "enable_prefix_caching", None)
    prefix_caching_hash_algo: PrefixCachingHashAlgo = _from(CacheConfig, "prefix_caching_hash_algo")
    # SchedulerConfig
    max_num_batched_tokens: int | None = _from(SchedulerConfig, "max_num_batched_tokens", None)
    max_num_seqs: int | None = _from(SchedulerConfig, "max_num_seqs", None)
    enable_chunked_prefill: bool | None = _from(SchedulerConfig, "enable_chunked_prefill", None)
    long_prefill_token_threshold: int = _from(SchedulerConfig, "long_prefill_token_threshold")
    max_num_partial_prefills: int = _from(SchedulerConfig, "max_num_partial_prefills")
    max_long_partial_prefills: int = _from(SchedulerConfig, "max_long_partial_prefills")
    scheduling_policy: SchedulerPolicy = _from(SchedulerConfig, "policy")
    max_request_share: float = _from(SchedulerConfig, "max_request_share")
    # AdmissionConfig
    max_n: int = _from(AdmissionConfig, "max_n")
    max_request_output_tokens: int = _from(AdmissionConfig, "max_request_output_tokens")
    max_grammar_choices: int = _from(AdmissionConfig, "max_grammar_choices")
    max_schema_enum_values: int = _from(AdmissionConfig, "max_schema_enum_values")
    max_schema_bytes: int = _from(AdmissionConfig, "max_schema_bytes")
    max_grammar_chars: int = _from(AdmissionConfig, "max_grammar_chars")
    grammar_cache_bytes: int = _from(AdmissionConfig, "grammar_cache_bytes")
    max_grammar_memory_bytes: int = _from(AdmissionConfig, "max_grammar_memory_bytes")
    grammar_compile_timeout: float = _from(AdmissionConfig, "grammar_compile_timeout")
    grammar_compile_workers: int = _from(AdmissionConfig, "grammar_compile_workers")
    max_grammar_compiles_per_caller: int = _from(AdmissionConfig, "max_grammar_compiles_per_caller")
    # CompilationConfig
    cudagraph_capture_sizes: list[int] | None = _from(CompilationConfig, "cudagraph_capture_sizes")
    max_cudagraph_capture_size: int | None = _from(CompilationConfig, "max_cudagraph_capture_size")
    # ObservabilityConfig
    otlp_traces_endpoint: str | None = _from(ObservabilityConfig, "otlp_traces_endpoint")
    trust_client_trace_context: bool = _from(ObservabilityConfig, "trust_client_trace_context")
    # LoRAConfig
    enable_lora: bool = _own("LoRAConfig", False)
    """Serve LoRA adapters (PEFT directories) on top of the base model: a request
    names one by `model`. See --lora-modules and /v1/load_lora_adapter."""
    max_loras: int | None = _from(LoRAConfig, "max_loras", None)
    max_lora_rank: int | None = _from(LoRAConfig, "max_lora_rank", None)
    max_cpu_loras: int | None = _from(LoRAConfig, "max_cpu_loras", None)
    lora_modules: list[str] | None = _own("LoRAConfig")
    """Adapters to load at start, as name=path (a PEFT directory with
    adapter_config.json and adapter_model.safetensors); needs --enable-lora."""
    # EngineConfig (nested configs as JSON)
    compilation_config: CompilationConfig = _own("EngineConfig", factory=CompilationConfig)
    """CUDA-graph configuration as JSON, e.g. {"cudagraph_capture_sizes": [1, 2, 4, 8]}.
    Its sizes and --cudagraph-capture-sizes / --max-cudagraph-capture-size are
    mutually exclusive."""
    kv_transfer_config: KVTransferConfig | None = _own("EngineConfig")
    """KV transfer for disaggregated prefill/decode, as JSON, e.g.
    {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}. Fields:
    kv_connector, engine_id, kv_role, kv_ip, kv_port, kv_connector_extra_config,
    kv_load_failure_policy."""
    kv_events_config: KVEventsConfig | None = _own("EngineConfig")
    """KV-cache event publishing as JSON, e.g. {"enable_kv_cache_events": true}."""
    performance_mode: PerformanceMode = _own("EngineConfig", "balanced")
    """`balanced`, `interactivity`, or `throughput` (doubles the default
    max_num_batched_tokens and max_num_seqs)."""
    disable_log_stats: bool = _own("EngineConfig", False)
    """Do not log periodic engine statistics."""
    shutdown_timeout: int = _own("EngineConfig", 0)
    """Seconds to let in-flight requests finish after SIGTERM (0: abort them)."""
    # Accepted for compatibility with vLLM command lines; rejected when used.
    speculative_config: dict[str, Any] | None = _own("Unsupported")
    """Speculative decoding configuration. Not supported by pdfleet."""
    cpu_offload_gb: float = _own("Unsupported", 0.0)
    """GiB of weights to offload to CPU memory. Not supported by pdfleet."""
    enable_expert_parallel: bool = _own("Unsupported", False)
    """Expert parallelism for MoE models. Not supported by pdfleet."""
    limit_mm_per_prompt: dict[str, int] = _own("Unsupported", factory=dict)
    """Multimodal items per prompt. Not supported by pdfleet."""
    async_scheduling: bool | None = _own("Unsupported")
    """Overlap scheduling with execution. Not supported by pdfleet."""
    enable_sleep_mode: bool = _own("Unsupported", False)
    """Sleep mode (release device memory while idle). Not supported by pdfleet."""
    lora_dtype: str = _own("Unsupported", "auto")
    """LoRA weights' dtype; "auto" (the model's) is what pdfleet does, any other
    value is not supported."""
    fully_sharded_loras: bool = _own("Unsupported", False)
    """Shard both LoRA matrices over tensor-parallel ranks. Not supported by pdfleet."""
    default_mm_loras: dict[str, str] | None = _own("Unsupported")
    """LoRA adapters per multimodal input. Not supported by pdfleet."""

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if isinstance(self.compilation_config, dict):
            self.compilation_config = coerce(
                CompilationConfig, self.compilation_config, "compilation_config"
            )
        if isinstance(self.kv_transfer_config, dict):
            self.kv_transfer_config = coerce(
                KVTransferConfig, self.kv_transfer_config, "kv_transfer_config"
            )
        if isinstance(self.kv_events_config, dict):
            self.kv_events_config = coerce(
                KVEventsConfig, self.kv_events_config, "kv_events_config"
            )

    # -- CLI -----------------------------------------------------------------

    @classmethod
    def bounds(cls) -> dict[str, FieldBounds]:
        """Field name -> its constant bound, as the sub-configuration field it
        feeds states it (a field of its own: its own annotation)."""
        own = field_bounds(cls)
        out: dict[str, FieldBounds] = {}
        for f in dataclasses.fields(cls):
            source = f.metadata.get("source")
            bound = field_bounds(source[0]).get(source[1]) if source else own.get(f.name)
            if bound:
                out[f.name] = bound
        return out

    @staticmethod
    def field_help(f: dataclasses.Field[Any]) -> str:
        source = f.metadata.get("source")
        if source is not None:
            return attr_docs(source[0]).get(source[1], "")
        return attr_docs(EngineArgs).get(f.name, "")

    @staticmethod
    def field_group(f: dataclasses.Field[Any]) -> str:
        source = f.metadata.get("source")
        return (
            source[0].__name__ if source is not None else str(f.metadata.get("group", "EngineArgs"))
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """Add one flag per field, grouped by the sub-config it feeds."""
        groups: dict[str, Any] = {}
        short = {
            "tensor_parallel_size": "-tp",
            "pipeline_parallel_size": "-pp",
            "data_parallel_size": "-dp",
            "quantization": "-q",
        }
        for f, tp in resolved_fields(cls):
            group_name = cls.field_group(f)
            if group_name not in groups:
                groups[group_name] = parser.add_argument_group(group_name)
            kwargs = argparse_kwargs(f.name, tp, default_of(f), cls.field_help(f))
            if f.name == "model" and positional_model:
                groups[group_name].add_argument(
                    "model_tag",
                    nargs="?",
                    metavar="MODEL",
                    help="Model directory (same as --model).",
                )
            names = [f"--{flag_name(f.name)}"]
            if f.name in short:
                names.append(short[f.name])
            record_argument(parser, groups[group_name].add_argument(*names, dest=f.name, **kwargs))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        model_tag = getattr(args, "model_tag", None)
        if model_tag:
            if values.get("model") and values["model"] != model_tag:
                raise ValueError(
                    f"the model is given twice ({model_tag!r} and --model {values['model']!r})"
                )
            values["model"] = model_tag
        return cls(**values)

    def to_cli_args(self) -> list[str]:
        """The flags that reproduce these arguments (only non-default values)."""
        out: list[str] = []
        for f, _tp in resolved_fields(type(self)):
            value = getattr(self, f.name)
            default = default_of(f)
            if to_jsonable(value) == to_jsonable(default):
                continue
            flag = f"--{flag_name(f.name)}"
            if isinstance(value, bool):
                out.append(flag if value else f"--no-{flag_name(f.name)}")
            elif value is None:
                out += [flag, "None"]
            elif dataclasses.is_dataclass(value) or isinstance(value, dict):
                out += [flag, json.dumps(to_jsonable(value), sort_keys=True)]
            elif isinstance(value, list):
                out += [flag, *map(str, value)]
            elif f.name == "max_model_len" and value == -1:
                out += [flag, "auto"]
            else:
                out += [flag, str(value)]
        return out

    # -- resolution ----------------------------------------------------------

    def validate_types(self) -> None:
        """Check each value against its declared type (Python callers)."""
        for f, tp in resolved_fields(type(self)):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                continue
            try:
                coerce(tp, value, f.name)
            except ConfigValueError as e:
                raise ValueError(f"--{flag_name(f.name)}: {e}") from None

    def check_supported(self) -> None:
        for name, unused, what in UNSUPPORTED:
            value = getattr(self, name)
            if value != unused:
                raise ValueError(
                    f"--{flag_name(name)}={value!r}: {what} is not supported by pdfleet; "
                    f"remove --{flag_name(name)}"
                )

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRA limits, or None without --enable-lora (then no LoRA flag may be set)."""
        given = {
            name: getattr(self, name)
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules")
            if getattr(self, name) is not None
        }
        if not self.enable_lora:
            if given:
                flags = ", ".join(f"--{flag_name(n)}" for n in given)
                raise ValueError(f"{flags} {'need' if len(given) > 1 else 'needs'} --enable-lora")
            return None
        base_names = list(self.served_model_name or [self.model])
        lora_modules = parse_lora_modules(given.pop("lora_modules", None), base_names)
        return LoRAConfig(**given, lora_modules=lora_modules)

    def create_model_config(self, device: str, model_dir: str | None = None) -> ModelConfig:
        if not self.model:
            raise ValueError("no model given: pass a local model directory (MODEL or --model)")
        return ModelConfig.from_model_dir(
            device,
            model_dir,
            model=self.model,
            tokenizer=self.tokenizer,
            revision=self.revision,
            served_model_name=self.served_model_name,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs,
            disable_sliding_window=self.disable_sliding_window,
            skip_tokenizer_init=self.skip_tokenizer_init,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            hf_overrides=self.hf_overrides,
            trust_remote_code=self.trust_remote_code,
            quantization=self.quantization,
        )

    @staticmethod
    def get_batch_defaults(
        world_size: int, device: str, device_memory: int, device_name: str
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Default (max_num_batched_tokens, max_num_seqs) per usage context."""
        if device == "cpu":
            return (
                {"llm": 4096 * world_size, "server": 2048 * world_size},
                {"llm": 256 * world_size, "server": 128 * world_size},
            )
        if device_memory >= 70 * GiB and "a100" not in device_name.lower():
            # H100/H200-class devices take larger batches.
            return {"llm": 16384, "server": 8192}, {"llm": 1024, "server": 1024}
        return {"llm": 8192, "server": 2048}, {"llm": 256, "server": 256}

    def _set_default_chunked_prefill_and_prefix_caching(self) -> None:
        # Every architecture pdfleet runs is a causal decoder: both are on by default.
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = True
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        if platform.machine().lower().startswith("riscv"):
            logger.info("Chunked prefill and prefix caching are not supported on RISC-V CPUs")
            self.enable_chunked_prefill = False
            self.enable_prefix_caching = False

    def _set_default_batch_limits(
        self,
        usage_context: UsageContext | None,
        model_config: ModelConfig,
        device: str,
        device_memory: int,
        device_name: str,
    ) -> None:
        world_size = self.pipeline_parallel_size * self.tensor_parallel_size
        default_tokens, default_seqs = self.get_batch_defaults(
            world_size, device, device_memory, device_name
        )
        orig_tokens, orig_seqs = self.max_num_batched_tokens, self.max_num_seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_tokens.get(
                usage_context or "", DEFAULT_MAX_NUM_BATCHED_TOKENS
            )
        if self.max_num_seqs is None:
            self.max_num_seqs = default_seqs.get(usage_context or "", DEFAULT_MAX_NUM_SEQS)
        if self.performance_mode == "throughput":
            if orig_tokens is None:
                self.max_num_batched_tokens *= 2
            if orig_seqs is None:
                self.max_num_seqs *= 2
        max_len = model_config.max_model_len
        if max_len is None:
            raise RuntimeError("broken invariant: max_len is not None")
        if orig_tokens is None:
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit one step.
                self.max_num_batched_tokens = max(max_len, self.max_num_batched_tokens)
            self.max_num_batched_tokens = min(
                self.max_num_seqs * max_len, self.max_num_batched_tokens
            )
        if orig_seqs is None:
            self.max_num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)

    def create_engine_config(
        self,
        usage_context: UsageContext | None = None,
        device: Device | None = None,
        device_memory_bytes: int | None = None,
        device_name: str | None = None,
        model_dir: str | None = None,
    ) -> EngineConfig:
        """Resolve the arguments into a checked :class:`EngineConfig`.

        ``device`` overrides ``self.device`` and may name a device that is not
        present; ``device_memory_bytes`` / ``device_name`` describe it when it
        cannot be queried (they select the batch-size defaults). ``model_dir``:
        where the model's config.json and tokenizer are when that is not the
        ``model`` path itself (a GGUF file's directory, prepared by the model
        layer: ``models.sources.gguf.resolve_model_dir``).
        """
        args = copy.deepcopy(self)
        args.__post_init__()
        args.validate_types()
        args.check_supported()
        if usage_context not in (None, "llm", "server"):
            raise ValueError(f"usage_context must be llm or server, got {usage_context!r}")
        # Flag-only checks first: no device query or model config for a bad flag.
        lora_config = args.create_lora_config()
        target = device or args.device
        if target == "auto":
            target = detect_device()
        device_config = DeviceConfig(device=target, attention_backend=args.attention_backend)
        memory, name = query_device(target, device_memory_bytes, device_name)

        model_config = args.create_model_config(target, model_dir)
        args._set_default_chunked_prefill_and_prefix_caching()
        cache_config = CacheConfig(
            block_size=args.block_size or DEFAULT_BLOCK_SIZE,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_offload_bytes=args.kv_offload_bytes,
            cache_dtype=args.kv_cache_dtype,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            enable_prefix_caching=bool(args.enable_prefix_caching),
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            sliding_window=model_config.sliding_window,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            headless=args.headless,
        )
        if cache_config.kv_offload_bytes is not None and parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "--kv-offload-bytes with --tensor-parallel-size > 1 is not supported yet (each "
                "rank would need its own host tier); drop --kv-offload-bytes or run TP=1 engines"
            )
        parallel_config.check_model(
            model_config.num_attention_heads,
            model_config.num_key_value_heads,
            int(model_config.hf_config.get("intermediate_size", 0)),
        )
        args._set_default_batch_limits(usage_context, model_config, target, memory, name)
        # Resolved above: the model's length and the batch limits are set now.
        if model_config.max_model_len is None:
            raise RuntimeError("broken invariant: model_config.max_model_len is not None")
        if args.max_num_batched_tokens is None or args.max_num_seqs is None:
            raise RuntimeError(
                "broken invariant: args.max_num_batched_tokens is not None and args.max_num_seqs is not None"
            )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=bool(args.enable_chunked_prefill),
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            policy=args.scheduling_policy,
            max_request_share=args.max_request_share,
        )
        admission_config = AdmissionConfig(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(AdmissionConfig)}
        )
        compilation_config = copy.deepcopy(args.compilation_config)
        if args.cudagraph_capture_sizes is not None:
            if compilation_config.cudagraph_capture_sizes is not None:
                raise ValueError(
                    "--cudagraph-capture-sizes and compilation_config.cudagraph_capture_sizes "
                    "are mutually exclusive"
                )
            compilation_config.cudagraph_capture_sizes = list(args.cudagraph_capture_sizes)
        if args.max_cudagraph_capture_size is not None:
            if compilation_config.max_cudagraph_capture_size is not None:
                raise ValueError(
                    "--max-cudagraph-capture-size and compilation_config."
                    "max_cudagraph_capture_size are mutually exclusive"
                )
            compilation_config.max_cudagraph_capture_size = args.max_cudagraph_capture_size
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            scheduler_config=scheduler_config,
            admission_config=admission_config,
            device_config=device_config,
            load_config=LoadConfig(
                load_format=args.load_format, use_tqdm_on_load=args.use_tqdm_on_load
            ),
            observability_config=ObservabilityConfig(
                log_stats=not args.disable_log_stats,
                otlp_traces_endpoint=args.otlp_traces_endpoint,
                trust_client_trace_context=args.trust_client_trace_context,
            ),
            compilation_config=compilation_config,
            kv_transfer_config=copy.deepcopy(args.kv_transfer_config),
            kv_events_config=copy.deepcopy(args.kv_events_config),
            performance_mode=args.performance_mode,
            shutdown_timeout=args.shutdown_timeout,
            lora_config=lora_config,
        )
