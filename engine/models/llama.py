"""The Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm, explicit head_dim).

All four share one decoder; the differences are flags read from config.json.
Parameter names match Hugging Face checkpoints (q/k/v and gate/up are loaded
into merged projections).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..config import ModelConfig
from ..config.model import rope_parameters
from .layers import MLP, Attention, MergedLinear, RMSNorm
from .parallel import VocabParallelEmbedding, lm_logits
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(
        self,
        idx: int,
        m: ModelConfig,
        rotary: nn.Module,
        dtype: torch.dtype,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        hf = m.hf_config
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.self_attn = Attention(
            idx,
            m.hidden_size,
            m.num_attention_heads,
            m.num_key_value_heads,
            m.head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm_eps=eps if qk_norm else None,
            sliding_window=m.sliding_window,
            rotary=rotary,
            dtype=dtype,
        )
        self.mlp = MLP(m.hidden_size, int(hf["intermediate_size"]), dtype)
        self.input_layernorm = RMSNorm(m.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, m: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hf = m.hf_config
        self.config = m
        # Llama/Qwen3 `attention_bias` covers q/k/v and o; Qwen2 always biases q/k/v only.
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        max_model_len = m.max_model_len
        if max_model_len is None:
            raise ValueError(
                "ModelConfig.max_model_len is unresolved; build the config with "
                "EngineArgs.create_engine_config() (or ModelConfig.from_model_dir)"
            )
        max_position = max(int(hf.get("max_position_embeddings", max_model_len)), max_model_len)
        rotary = RotaryEmbedding(m.head_dim, max_position, rope_parameters(hf))
        self.embed_tokens = VocabParallelEmbedding(m.vocab_size, m.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, m, rotary, dtype, qkv_bias, attention_bias, self.qk_norm)
            for i in range(m.num_hidden_layers)
        )
        self.norm = RMSNorm(m.hidden_size, float(hf.get("rms_norm_eps", 1e-6)), dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            # The vocabulary shard of this rank (as the embedding's).
            rows = self.embed_tokens.weight.shape[0]
            self.lm_head = nn.Linear(m.hidden_size, rows, bias=False, dtype=dtype)
        self.rotary = rotary

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after construction on the meta device)."""
        self.rotary.reset_cache()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, backend)
        normed: torch.Tensor
        normed, _ = self.norm(hidden, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_logits(hidden, weight, self.config.vocab_size)

    # -- weights ------------------------------------------------------------------

    # Hugging Face projection -> (this model's merged projection, its shard).
    _merged: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face tensors in by name; returns the names of loaded parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._merged:
                merged, shard = self._merged[parts[-2]]
                module_name = ".".join([*parts[:-2], merged])
                module = self.get_submodule(module_name)
                if not isinstance(module, MergedLinear):  # _merged names only those
                    raise TypeError(f"{module_name} is not a MergedLinear")
                module.load_shard(shard, parts[-1], tensor)
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
