"""Per-request sampling parameters (vLLM's names and semantics)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

from .contracts.sampling_checks import INT32_MAX, INT64_MAX, INT64_MIN, MAX_N

_GREEDY_EPS = 1e-5


def json_schema_text(schema: str | dict[str, Any]) -> str:
    """A JSON schema as text: a dict's text is its cache key (key order kept: it is
    the order of the properties in the output)."""
    return schema if isinstance(schema, str) else _json.dumps(schema)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``structured_outputs`` fields); exactly one is set.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any
    JSON object; ``regex``; ``choice``: the output is one of these strings;
    ``grammar``: EBNF (GBNF, with ``::=``) or Lark. See docs/structured_outputs.md.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    compiled: Any = field(default=None, compare=False, repr=False)
    """The compiled grammar, once the engine compiled (or found) it: a request
    holds its grammar until it ends, whatever the grammar cache drops."""

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            # A schema given as a dict (Python callers): keep its text.
            object.__setattr__(self, "json", json_schema_text(self.json))
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list | tuple) or not choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        num_set = sum(
            x is not None for x in (self.json, self.regex, self.choice, self.grammar)
        ) + bool(self.json_object)
        if num_set != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, regex, choice, "
                f"grammar (got {num_set})"
            )

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "JSON schema"
        if self.json_object:
            return "JSON object grammar"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice list"
        return "grammar"

    def key(self) -> tuple[Any, ...]:
        """The cache key: equal keys compile to the same grammar."""
        return (self.kind, self.json, self.regex, self.choice, self.grammar)


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature=0`` is greedy. ``top_k=-1`` (or 0) and ``top_p=1`` disable
    those filters. ``seed`` makes a request's samples reproducible whatever
    else shares its batches. Penalties: ``repetition_penalty`` divides the
    logits of tokens seen in the prompt or output (multiplies negative ones),
    ``presence_penalty`` / ``frequency_penalty`` subtract per occurrence in
    the output. ``stop`` strings are trimmed from the returned text;
    ``stop_token_ids`` end the request like EOS.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Grammar-constrained output (None: free).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before sampling: (token id, bias)
    # pairs (a mapping is accepted and kept as pairs, which msgpack carries to
    # the workers unchanged). Biases are clamped to [-100, 100] as OpenAI's.
    logit_bias: list[tuple[int, float]] | None = None
    # A prefix-cache namespace: the request's block hashes start from a digest of
    # it (engine/core/block_hash.py), so it shares KV only with the same salt.
    cache_salt: str | None = None
    # A migrated request (docs/migration.md): the output tokens another engine
    # already sent to the client. The request starts as if it had sampled them
    # (a preempted request resumed): they are computed with the prompt, count
    # against max_tokens and min_tokens, feed penalties, advance the grammar
    # matcher and the detokenizer (stop strings), and a seeded request draws
    # its next token from (seed, len(resumed_token_ids)). They are not sent again.
    resumed_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.resumed_token_ids = list(self.resumed_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            pairs = (
                self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            )
            try:
                bias = [(int(t), max(-100.0, min(100.0, float(b)))) for t, b in pairs]
            except (TypeError, ValueError):
                raise ValueError(
                    "logit_bias must map token ids to numbers between -100 and 100"
                ) from None
            self.logit_bias = bias or None
        self.verify()

    def verify(self, max_logprobs: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer between 1 and {MAX_N}, got {self.n!r}")
        _number("temperature", self.temperature, low=0.0)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or not -1 <= self.top_k <= INT32_MAX
        ):
            raise ValueError(
                f"top_k must be -1 (disabled) or a positive integer up to {INT32_MAX}, "
                f"got {self.top_k!r}"
            )
        _number("min_p", self.min_p, low=0.0, high=1.0)
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, high=None)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or not 1 <= self.max_tokens <= INT32_MAX
        ):
            raise ValueError(
                f"max_tokens must be an integer between 1 and {INT32_MAX}, got {self.max_tokens!r}"
            )
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= INT32_MAX
        ):
            raise ValueError(
                f"min_tokens must be an integer between 0 and {INT32_MAX}, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT32_MAX:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
            if max_logprobs is not None and value > max_logprobs:
                raise ValueError(
                    f"{name} ({value}) exceeds the engine's max_logprobs ({max_logprobs})"
                )
        for tid, b in self.logit_bias or ():
            if not 0 <= tid <= INT32_MAX or b != b:
                raise ValueError(f"logit_bias: token id {tid} is not a valid token id")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32_MAX
            for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be token ids (integers 0..{INT32_MAX}), "
                f"got {self.stop_token_ids!r}"
            )
        if self.resumed_token_ids:
            if self.n != 1:
                raise ValueError("migration.output_token_ids: a resumed request has n = 1")
            if self.max_tokens is not None and len(self.resumed_token_ids) >= self.max_tokens:
                raise ValueError(
                    f"migration.output_token_ids: {len(self.resumed_token_ids)} tokens already sent "
                    "leave none "
                    f"of max_tokens ({self.max_tokens})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
