"""The built-in tiny model: a Hugging Face directory made from nothing.

``build_tiny_model(DIR)`` trains a byte-level BPE tokenizer on the corpus the
package ships, builds a small causal LM of one of the supported architectures
with seeded random weights, and saves both with ``save_pretrained`` so that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load the directory
offline. Same arguments, same files: the weights are a pure function of the
seed and sizes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from ..contracts.model_source import cache_dir

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# <|endoftext|> is listed because transformers' Qwen tokenizer classes add it
# when it is missing, which would make the tokenizer longer than the model's vocab.
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT]

# ChatML-style template; the prompt starts with the BOS token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TinyModelSpec:
    """Sizes of the tiny model (defaults keep CPU tests at a few seconds)."""

    arch: str = "llama"
    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool | None = None
    sliding_window: int | None = None
    rope_scaling: str | None = None
    rope_theta: float = 10000.0
    initializer_range: float = 0.2
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling not in (None, "llama3", "linear"):
            raise ValueError("rope_scaling must be llama3 or linear")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")


def corpus_text() -> str:
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (any UTF-8 text encodes) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: unannotated
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, ENDOFTEXT],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(spec: TinyModelSpec, vocab_size: int, ids: dict[str, int]) -> Any:
    from transformers import (
        LlamaConfig,
        MistralConfig,
        PretrainedConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=spec.initializer_range,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        rope_theta=spec.rope_theta,
    )
    if spec.rope_scaling == "llama3":
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(64, spec.max_position_embeddings // 8),
        }
    elif spec.rope_scaling == "linear":
        common["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    tie = spec.tie_word_embeddings
    cfg: PretrainedConfig
    if spec.arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=bool(tie), head_dim=spec.head_dim)
    elif spec.arch == "mistral":
        cfg = MistralConfig(
            **common,
            tie_word_embeddings=bool(tie),
            sliding_window=spec.sliding_window,
            head_dim=spec.head_dim,
        )
    elif spec.arch == "qwen2":
        if spec.head_dim is not None:
            raise ValueError("qwen2 derives head_dim from hidden_size / num_attention_heads")
        cfg = Qwen2Config(**common, tie_word_embeddings=True if tie is None else tie)
    else:
        cfg = Qwen3Config(
            **common,
            tie_word_embeddings=True if tie is None else tie,
            head_dim=spec.head_dim or 2 * spec.hidden_size // spec.num_attention_heads,
        )
    if spec.arch in ("llama", "mistral") and spec.head_dim is None:
        cfg.head_dim = spec.hidden_size // spec.num_attention_heads
    return cfg


def build_tiny_model(directory: str, spec: TinyModelSpec | None = None, **overrides: Any) -> str:
    """Write a complete Hugging Face model directory; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec or TinyModelSpec(**overrides)
    os.makedirs(directory, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = hf_config(spec, len(tokenizer), ids)
    dtype = getattr(torch, spec.dtype)
    # Weights are a pure function of the seed: fork the RNG so callers' state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # (as above)
    model = model.to(dtype)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    GenerationConfig(  # type: ignore[no-untyped-call]  # (as above)
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    ).save_pretrained(directory)
    with open(os.path.join(directory, "pdfleet_tiny.json"), "w") as f:
        json.dump(asdict(spec), f, indent=2, sort_keys=True)
    return directory


def default_tiny_model_dir() -> str:
    """Cache location of the built-in tiny model (in pdfleet's one cache directory)."""
    return str(cache_dir() / "tiny-llama")


def ensure_tiny_model(directory: str | None = None, **overrides: Any) -> str:
    """Build the tiny model once into ``directory`` (default: the cache)."""
    directory = directory or default_tiny_model_dir()
    spec = TinyModelSpec(**overrides)
    marker = os.path.join(directory, "pdfleet_tiny.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == asdict(spec):
                return directory
    tmp = f"{directory}.tmp-{os.getpid()}"
    build_tiny_model(tmp, spec)
    if os.path.exists(directory):
        import shutil

        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory
