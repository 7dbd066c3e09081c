"""Grammar-constrained sampling with xgrammar (docs/structured_outputs.md).

A constrained request carries a :class:`StructuredOutputsParams` (JSON schema,
JSON object, regex, choice list or grammar). :class:`GrammarCompiler` turns it
into a compiled grammar once per distinct spec, kept in a bounded LRU cache,
and hands out one matcher per request. Each step the model runner fills a
token bitmask for the constrained rows only (on the host, after the forward
pass is launched, so on CUDA it overlaps the running kernels) and the sampler
masks those rows' logits; free rows in the same batch are untouched.

The matcher state is a function of (spec, output tokens so far): a runner that
receives a request with output tokens already (a preempted request resuming,
or a decode engine taking over from a prefill engine) rebuilds the matcher and
advances it over them, so no grammar state crosses a process boundary.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..sampling_params import StructuredOutputsParams

# Distinct compiled grammars kept per engine (each a few KB to a few MB).
DEFAULT_CACHE_SIZE = 256

# JSON Schema keywords the library accepts but does not enforce: refused, so a
# client never gets output that silently violates its schema.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
        "multipleOf",
    }
)
# Keywords whose values are maps of name -> schema (their keys are names, not keywords).
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")

_LIB_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _lib_message(e: BaseException) -> str:
    """The library's error without its timestamp and C++ source location."""
    return _LIB_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else repr(e)


def check_schema_keywords(schema: Any, path: str = "$") -> None:
    """Raise ``ValueError`` naming the first unsupported keyword in ``schema``."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a JSON schema must be an object or a boolean")
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            raise ValueError(
                f"{path}: the JSON schema keyword {key!r} is not supported by structured outputs"
            )
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{path}.{key}.{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{path}.{key}[{i}]")
        elif key in _SCHEMA_VALUES and isinstance(value, dict | bool):
            check_schema_keywords(value, f"{path}.{key}")


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each length-bounded plain string turned into a pattern.

    The library's rule for ``minLength``/``maxLength`` strings admits raw
    control characters, which JSON forbids inside strings (so the output would
    not parse); its pattern rules do not. The pattern keeps the bounds and
    admits every character that needs no escape."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    if (
        out.get("type") == "string"
        and ("minLength" in out or "maxLength" in out)
        and not {"pattern", "format", "enum", "const"} & out.keys()
    ):
        low = out.pop("minLength", 0)
        high = out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'
    return out


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the results (thread-safe).

    ``vocab_size`` is the model's logits width (it may exceed the tokenizer's
    length); ``stop_token_ids`` are the tokens that may end a finished grammar.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] | list[int],
        max_cached: int = DEFAULT_CACHE_SIZE,
        max_threads: int = 1,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # The library's own cache is off: this one is bounded by entry count and
        # keyed by spec kind too (a regex and a grammar with equal text differ).
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``spec``; ``ValueError`` saying what is wrong."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        try:
            if spec.json is not None:
                try:
                    schema = json.loads(spec.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
                check_schema_keywords(schema)
                # Compact separators and no free whitespace: whitespace is never
                # needed, and a model allowed it can spend max_tokens on it.
                return c.compile_json_schema(
                    json.dumps(bounded_strings_as_patterns(schema)),
                    any_whitespace=False,
                    strict_mode=True,
                )
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(_ebnf_literal(s) for s in spec.choice)
                return c.compile_grammar(f"root ::= {alternatives}")
            if spec.grammar is not None:
                if "::=" in spec.grammar:
                    return c.compile_grammar(spec.grammar)
                return c.compile_lark(spec.grammar)
        except ValueError:
            raise
        except Exception as e:  # the library reports bad specs as RuntimeError
            raise ValueError(f"cannot compile the {spec.kind}: {_lib_message(e)}") from None
        raise ValueError("structured outputs: no constraint given")

    def matcher(self, spec: StructuredOutputsParams, token_ids: Sequence[int] = ()) -> Any:
        """A fresh matcher for ``spec``, advanced over ``token_ids`` (tokens a
        request already produced, here or on another engine)."""
        m = self._xgr.GrammarMatcher(self.compile(spec))
        for t in token_ids:
            if not m.accept_token(t):
                break
        return m

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """Row i of ``bitmask`` = the tokens ``matchers[i]`` allows next."""
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte value, least significant first."""
    table = _BIT_TABLES.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
        _BIT_TABLES[device] = table
    return table


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose bit in ``bitmask`` is 0.

    ``bitmask`` row i belongs to logits row ``rows[i]`` (int32 words, token t
    is bit t % 32 of word t // 32: little-endian bytes, so byte-wise lookups
    give the tokens in order)."""
    batch, vocab = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    table = _bit_table(logits.device)
    # [rows, words * 4] bytes -> [rows, words * 32] bools.
    allowed = table[bitmask.view(torch.uint8).long()].flatten(1)[:, :vocab]
    if len(rows) == batch and rows == list(range(batch)):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are EBNF string escapes too.
    return json.dumps(text, ensure_ascii=True)
