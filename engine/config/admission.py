"""What one request may cost an engine: output and grammar bounds checked at admission.

Every bound here is checked before a request is admitted and refused with a
400 naming the request field that exceeds it (docs/serving.md, "Request
bounds"; docs/structured_outputs.md, "Bounds"). The gateway checks the output
bounds too, with the same code (``sampling_checks.check_output_bounds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge, Gt, Interval

from .hashing import hash_factors

# OpenAI's own bound on n; also the largest value the engine accepts at all.
DEFAULT_MAX_N = 128
DEFAULT_MAX_REQUEST_OUTPUT_TOKENS = 1 << 20


@dataclass
class AdmissionConfig:
    """Bounds on what one request may ask of the engine."""

    max_n: Annotated[int, Interval(ge=1, le=DEFAULT_MAX_N)] = DEFAULT_MAX_N
    """Most completions one request may ask for (`n`, and `best_of`); a
    larger value is a 400 naming the field. At most 128."""
    max_request_output_tokens: Annotated[int, Ge(1)] = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS
    """Most output tokens one request may ask for: `n` (or `best_of`) times
    `max_tokens`, summed over the prompts of a batched completion; a larger
    product is a 400 naming `max_tokens`. Without `max_tokens` the engine
    counts what the context leaves after the prompt."""
    max_grammar_choices: Annotated[int, Ge(1)] = 1024
    """Most strings in a `choice` constraint (`guided_choice`,
    `structured_outputs.choice`)."""
    max_schema_enum_values: Annotated[int, Ge(1)] = 1024
    """Most `enum` values (and `const`s) in one JSON schema, all its `enum`
    lists together (`response_format`, `guided_json`, tool parameters)."""
    max_schema_bytes: Annotated[int, Ge(1)] = 128 * 1024
    """Longest JSON schema, in bytes of its JSON text."""
    max_grammar_chars: Annotated[int, Ge(1)] = 64 * 1024
    """Longest regex, EBNF or Lark grammar, in characters."""
    grammar_cache_bytes: Annotated[int, Ge(1)] = 512 * 1024 * 1024
    """Memory for compiled grammars (as xgrammar measures them); the least
    recently used are dropped beyond it."""
    max_grammar_memory_bytes: Annotated[int, Ge(1)] = 64 * 1024 * 1024
    """Largest compiled grammar accepted; a constraint that compiles to more is
    a 400 naming its field. At most `grammar_cache_bytes`."""
    grammar_compile_timeout: Annotated[float, Gt(0)] = 10.0
    """Seconds one grammar compile may take; a compile still running then is
    stopped (its worker process is killed) and the request gets a 400 naming
    the constraint field."""
    grammar_compile_workers: Annotated[int, Ge(1)] = 2
    """Processes compiling grammars (started on first use); each compile runs
    in one, off the engine's event loop and its engine thread."""
    max_grammar_compiles_per_caller: Annotated[int, Ge(1)] = 32
    """Grammar compiles one caller (an API key, the client a gateway names, or
    an address) may have waiting or running at once; more are a 429. Waiting
    compiles take free workers by fair share: the caller that used the least
    compile time recently goes first."""

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        if not 1 <= self.max_n <= DEFAULT_MAX_N:
            raise ValueError(f"max_n must be between 1 and {DEFAULT_MAX_N}, got {self.max_n}")
        for name in (
            "max_request_output_tokens",
            "max_grammar_choices",
            "max_schema_enum_values",
            "max_schema_bytes",
            "max_grammar_chars",
            "grammar_cache_bytes",
            "max_grammar_memory_bytes",
            "grammar_compile_workers",
            "max_grammar_compiles_per_caller",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
            )
        if self.max_grammar_memory_bytes > self.grammar_cache_bytes:
            raise ValueError(
                f"max_grammar_memory_bytes ({self.max_grammar_memory_bytes}) must be <= "
                f"grammar_cache_bytes ({self.grammar_cache_bytes})"
            )

    def compute_hash(self) -> str:
        # Admission bounds refuse requests; they never change a computation.
        return hash_factors([])
