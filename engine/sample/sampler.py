"""Batched sampling: penalties, temperature, min-p, top-k/top-p, seeds, logprobs.

Sampling uses the exponential race (argmax of probs / Exp(1) noise), which is
equivalent to drawing from the categorical distribution and needs no host
sync. A seeded request draws its noise from its own generator, reseeded from
(seed, output index) every step, so its samples do not depend on which other
requests share the batch or on preemptions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")
_MASK64 = (1 << 63) - 1


def step_seed(seed: int, output_index: int) -> int:
    """Mix a request seed and its output index into a 63-bit generator seed.
    A change to what it returns changes every seeded draw: bump
    ``config.engine.SAMPLER_VERSION`` (migrated requests resume only between
    engines that draw alike)."""
    x = seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return x & _MASK64


@dataclass
class SamplingMetadata:
    """One row per request being sampled this step (tensors on the device)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64 (vocab size = off) or None if no row uses it
    top_p: torch.Tensor | None  # [B] float32 or None
    min_p: torch.Tensor | None  # [B] float32 or None
    generators: dict[int, torch.Generator]  # row -> seeded generator for this step
    # Penalties (None when no row uses them).
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, O] int64, padded with vocab_size
    presence_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # min_tokens not reached yet: row -> token ids that must not be sampled.
    banned_token_ids: dict[int, list[int]] | None = None
    # logit_bias: row -> (token ids [k] int64, biases [k] float32) added to its logits.
    logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    max_num_logprobs: int | None = None  # None: no row wants logprobs
    # Grammar-constrained rows and their allowed tokens, [len(rows), ceil(V / 32)]
    # int32 bits (engine/sample/grammar.py); None when no row is constrained.
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Rows asking for logprobs: ids/logprobs [B, 1 + k] (sampled token first), ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    batch, vocab = logits.shape
    # The runner sets the five penalty fields together (or none of them).
    if meta.output_token_ids is None or meta.prompt_token_ids is None:
        raise RuntimeError(
            "broken invariant: meta.output_token_ids is not None and meta.prompt_token_ids is not None"
        )
    if meta.repetition_penalties is None:
        raise RuntimeError("broken invariant: meta.repetition_penalties is not None")
    if meta.frequency_penalties is None or meta.presence_penalties is None:
        raise RuntimeError(
            "broken invariant: meta.frequency_penalties is not None and meta.presence_penalties is not None"
        )
    # Scatter into vocab + 1 columns so the padding id lands in a dropped column.
    out_counts = torch.zeros(batch, vocab + 1, device=logits.device, dtype=logits.dtype)
    out_counts.scatter_add_(
        1,
        meta.output_token_ids,
        torch.ones_like(out_counts[:, :1]).expand(-1, meta.output_token_ids.shape[1]),
    )
    out_counts = out_counts[:, :vocab]
    prompt_seen = torch.zeros(batch, vocab + 1, device=logits.device, dtype=torch.bool)
    prompt_seen.scatter_(1, meta.prompt_token_ids, True)
    seen = prompt_seen[:, :vocab] | (out_counts > 0)
    rep = meta.repetition_penalties[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency_penalties[:, None] * out_counts
    logits = logits - meta.presence_penalties[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # The k-th largest value is at ascending index vocab - k; keep ties with it.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        # Unseeded requests share one generator: deterministic per engine seed and batch order.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.banned_token_ids:
            vocab = logits.shape[-1]
            for row, ids in meta.banned_token_ids.items():
                # Ids outside the vocabulary are refused at admission; never index with one.
                ids = [t for t in ids if 0 <= t < vocab]
                if ids:
                    logits[row, ids] = _NEG_INF
        if meta.logit_bias:
            for row, (bias_ids, bias) in meta.logit_bias.items():
                logits[row].index_add_(0, bias_ids, bias)
        if meta.output_token_ids is not None:
            logits = apply_penalties(logits, meta)
        if meta.grammar_bitmask is not None and meta.grammar_rows:
            from .grammar import apply_bitmask

            apply_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample_random(logits, meta)
            if not meta.all_random:
                sampled = torch.where(meta.temperature < 1e-5, greedy, sampled)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            k = meta.max_num_logprobs or 0
            sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))
            if k:
                top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
                out.logprob_token_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
                out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
            else:
                out.logprob_token_ids = sampled.unsqueeze(1)
                out.logprobs = sampled_lp
            out.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        return out

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.temperature < 1e-5, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            noise[row].exponential_(generator=gen)
        # exponential_ can return exactly 0; 0/0 would be NaN and win the argmax.
        noise.clamp_(min=1e-30)
        return probs.div(noise).argmax(dim=-1)
