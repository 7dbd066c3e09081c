"""The model: a local Hugging Face directory and what is derived from it."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge

from .hashing import hash_factors

logger = logging.getLogger(__name__)

ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

# config.json keys that bound the context length, in the order vLLM reads them.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# What --dtype resolves to.
ResolvedDType = Literal["float32", "float16", "bfloat16"]
_DTYPE_ALIASES: dict[str, ResolvedDType] = {
    "half": "float16",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "fp32": "float32",
}


def _is_gguf_source(path: str) -> bool:
    """A GGUF file, or a directory holding one and no config.json: a model whose
    config and tokenizer the model layer prepares (``models/sources/gguf.py``)."""
    if path.endswith(".gguf") and os.path.isfile(path):
        return True
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return False
    return any(name.endswith(".gguf") for name in os.listdir(path))


def load_hf_config(model: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a local model directory's configuration as a plain dict.

    Uses ``transformers.AutoConfig`` (offline) when transformers is installed,
    so defaults the file leaves out are filled in the same way transformers
    fills them; falls back to reading ``config.json`` (the operator image has
    no transformers). Never reaches a model hub.
    """
    path = os.path.expanduser(model)
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(
            f"model {model!r} is not a local directory; pdfleet loads Hugging Face model "
            "directories and GGUF files from disk (no hub download). Pass the path of a "
            "directory holding config.json and *.safetensors, or of a .gguf file"
        )
    if not os.path.isfile(config_file):
        raise ValueError(f"model directory {model!r} has no config.json")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    try:
        from transformers import AutoConfig
    except ImportError:
        data = dict(raw)
    else:
        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"cannot read the model configuration in {model!r}: {e}") from None
        data = cfg.to_dict()
        # to_dict() may rename or drop keys the file had; keep the file's view too.
        for key, value in raw.items():
            data.setdefault(key, value)
    for key, value in (hf_overrides or {}).items():
        data[key] = value
    return data


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings as one dict: rope_type, rope_theta and scaling fields.

    transformers 5 stores them in ``rope_parameters``; older files use
    ``rope_theta`` plus an optional ``rope_scaling``.
    """
    params: dict[str, Any] = {}
    if isinstance(hf.get("rope_parameters"), dict):
        params.update(hf["rope_parameters"])
    if isinstance(hf.get("rope_scaling"), dict):
        # An explicit rope_scaling (older files, or hf_overrides) wins.
        scaling = dict(hf["rope_scaling"])
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        params.update(scaling)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = hf.get("rope_theta", 10000.0)
    return params


def resolve_dtype(requested: str, hf: dict[str, Any], device: str) -> ResolvedDType:
    """Resolve ``--dtype`` to float32 / float16 / bfloat16.

    ``auto`` takes the checkpoint's dtype; a float32 (or unspecified)
    checkpoint runs in bfloat16 on cuda and in float32 on cpu.
    """
    if requested != "auto":
        try:
            return _DTYPE_ALIASES[requested]
        except KeyError:
            raise ValueError(
                f"dtype {requested!r} is not supported; use auto, float32, float16 or bfloat16"
            ) from None
    name = hf.get("torch_dtype") or hf.get("dtype")
    stored = _DTYPE_ALIASES.get(str(name).replace("torch.", "")) if name else None
    if stored == "float16" or stored == "bfloat16":
        return stored
    return "bfloat16" if device == "cuda" else "float32"


def derived_max_model_len(hf: dict[str, Any]) -> tuple[int, str]:
    """The longest context the model supports, and the key it came from."""
    best: tuple[int, str] | None = None
    for key in _MAX_LEN_KEYS:
        value = hf.get(key)
        if isinstance(value, int) and value > 0 and (best is None or value < best[0]):
            best = (value, key)
    if best is None:
        best = (2048, "default")
    rope = rope_parameters(hf)
    if rope["rope_type"] == "linear":
        best = (int(best[0] * float(rope.get("factor", 1.0))), best[1] + " * rope factor")
    return best


@dataclass
class ModelConfig:
    """The model and how it runs. User settings first, then what is derived
    from the model directory's config.json."""

    model: str = ""
    """Path of a local Hugging Face model directory (config.json, safetensors
    weights, tokenizer) or of a GGUF file (config and tokenizer come from its
    metadata; see docs/models.md)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the model directory."""
    revision: str | None = None
    """Model revision (a commit or tag). Recorded in the P/D compatibility hash so
    that engines serving different weights never exchange KV."""
    served_model_name: str | list[str] | None = None
    """Model name(s) the API serves; the first is reported. Defaults to the
    model path."""
    dtype: ModelDType = "auto"
    """Weight and activation dtype: `auto` (the checkpoint's; float32
    checkpoints run in bfloat16 on cuda, float32 on cpu), `float32`/`float`,
    `float16`/`half`, or `bfloat16`."""
    # The resource's own bound (the engine seeds torch with any int).
    seed: Annotated[int, Ge(0)] = 0
    """Random seed for requests that do not give their own."""
    # -1: the model's own (auto); 0 is refused.
    max_model_len: Annotated[int, Ge(-1)] | None = None
    """Model context length (prompt plus output). Defaults to the model's own
    limit; `auto` (-1) takes the model's limit and shrinks it to what the KV
    cache holds."""
    enforce_eager: bool = False
    """Always run eagerly: no CUDA-graph capture."""
    # -1: no bound; 0 is refused.
    max_logprobs: Annotated[int, Ge(-1)] = 20
    """Maximum number of log probabilities a request may ask for (per token, of
    the output or the prompt); -1: no bound (the whole vocabulary)."""
    disable_sliding_window: bool = False
    """Ignore the model's sliding window (and cap max_model_len to it)."""
    skip_tokenizer_init: bool = False
    """Do not load a tokenizer; requests then pass token ids and get token ids."""
    generation_config: str = "auto"
    """Where default sampling parameters come from: `auto` (the model's
    generation_config.json), `vllm` (none), or a directory holding one."""
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of the default sampling parameters, e.g. {"temperature": 0.5}."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Overrides of the model's config.json values."""
    trust_remote_code: bool = False
    """Run a model directory's own Python code. Not supported by pdfleet."""
    quantization: str | None = None
    """Weight quantization method. Not supported by pdfleet."""

    # -- derived from config.json (set by EngineArgs.create_model_config) ---
    model_dir: str = ""
    """Resolved: the directory holding config.json and the tokenizer (the
    model directory, or for a GGUF file its prepared directory in the cache)."""
    max_model_len_auto: bool = False
    """Resolved: shrink max_model_len to what the KV cache holds."""
    architecture: str = ""
    """Resolved: the model class, e.g. LlamaForCausalLM."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """Resolved: config.json as read (with hf_overrides applied)."""
    num_hidden_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        """The served model name reported by the API."""
        if isinstance(self.served_model_name, list) and self.served_model_name:
            return self.served_model_name[0]
        if isinstance(self.served_model_name, str) and self.served_model_name:
            return self.served_model_name
        return self.model

    @property
    def served_model_names(self) -> list[str]:
        if isinstance(self.served_model_name, list) and self.served_model_name:
            return list(self.served_model_name)
        return [self.name]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model_dir or self.model

    @classmethod
    def from_model_dir(cls, device: str, model_dir: str | None = None, **user: Any) -> ModelConfig:
        """Read the model directory and derive shapes, dtype and max length.

        ``model_dir``: where config.json and the tokenizer are, when not in the
        ``model`` directory itself (a GGUF file's prepared directory)."""
        config = cls(**user)
        path = os.path.expanduser(config.model)
        if model_dir is None and _is_gguf_source(path):
            raise ValueError(
                f"model {config.model!r} is a GGUF file: its config and tokenizer are prepared "
                "from it first (pdfleet serve, LLM and pdfleet config do; from code, use "
                "pdfleet.engine.models.sources.create_engine_config(args))"
            )
        config.model_dir = model_dir or path
        hf = load_hf_config(config.model_dir, config.hf_overrides)
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {arch or '(none in config.json)'!r} is not supported; "
                f"pdfleet runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = rope_parameters(hf)
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope['rope_type']!r} of this model is not supported; "
                f"pdfleet implements {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        config.hf_config = hf
        config.architecture = arch
        config.hidden_size = int(hf["hidden_size"])
        config.num_hidden_layers = int(hf["num_hidden_layers"])
        config.num_attention_heads = int(hf["num_attention_heads"])
        config.num_key_value_heads = int(
            hf.get("num_key_value_heads") or config.num_attention_heads
        )
        config.head_dim = int(
            hf.get("head_dim") or config.hidden_size // config.num_attention_heads
        )
        config.vocab_size = int(hf["vocab_size"])
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        config.dtype = resolve_dtype(config.dtype, hf, device)
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", True) and isinstance(window, int) and window > 0
        if arch.startswith("Qwen"):
            # Qwen2/3 apply the window only above max_window_layers; pdfleet
            # supports the common case where no layer uses it.
            uses_window = uses_window and hf.get("use_sliding_window", False)
            if uses_window:
                raise ValueError(
                    "Qwen sliding-window attention (use_sliding_window=true) is not supported"
                )
        config.sliding_window = (
            window if uses_window and not config.disable_sliding_window else None
        )
        config._resolve_max_model_len(window if uses_window else None)
        if not (config.max_logprobs >= 1 or config.max_logprobs == -1):
            raise ValueError(
                f"max_logprobs must be >= 1 or -1 (no bound), got {config.max_logprobs}"
            )
        return config

    def _resolve_max_model_len(self, window: int | None) -> None:
        derived, key = derived_max_model_len(self.hf_config)
        if self.disable_sliding_window and window:
            derived, key = min(derived, window), "sliding_window"
        requested = self.max_model_len
        if requested is None or requested == -1:
            self.max_model_len_auto = requested == -1
            self.max_model_len = derived
            return
        if requested < 1:
            raise ValueError(f"max_model_len must be positive or auto, got {requested}")
        if requested > derived:
            raise ValueError(
                f"max_model_len ({requested}) is greater than the model's limit ({derived}, "
                f"from {key} in config.json). Lower --max-model-len, or raise the limit with "
                f"--hf-overrides '{{\"{key.split()[0]}\": {requested}}}' if the model supports it."
            )

    def compute_hash(self) -> str:
        return hash_factors(
            {
                "model": self.model,
                "revision": self.revision,
                "dtype": self.dtype,
                "max_model_len": self.max_model_len,
                "sliding_window": self.sliding_window,
                "architecture": self.architecture,
                "hf_config": {k: v for k, v in self.hf_config.items() if not k.startswith("_")},
            }
        )
