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

import contextlib
import ctypes
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..config.admission import AdmissionConfig
from ..sampling_params import StructuredOutputsParams

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


def _trim_heap() -> None:
    """Give freed heap pages back to the system (glibc keeps them otherwise, so a
    process's RSS would stay at its high-water mark after grammars are evicted)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
            ctypes.CDLL(None).malloc_trim(0)


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


class GrammarTooLarge(ValueError):
    """A constraint over one of the server's bounds (docs/structured_outputs.md)."""


class GrammarTimeout(ValueError):
    """A constraint whose compile ran past ``grammar_compile_timeout``."""


def _count_enum_values(schema: Any) -> int:
    """``enum`` values and ``const``s anywhere in a JSON schema."""
    count = 0
    pending = [schema]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            enum = item.get("enum")
            if isinstance(enum, list):
                count += len(enum)
            if "const" in item:
                count += 1
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def choice_grammar(choice: Sequence[str]) -> str:
    """The EBNF grammar whose strings are exactly ``choice``."""
    return "root ::= " + " | ".join(_ebnf_literal(s) for s in choice)


def check_bounds(spec: StructuredOutputsParams, limits: AdmissionConfig) -> None:
    """``GrammarTooLarge`` when ``spec`` exceeds the server's input bounds; cheap
    (no compile), run before a constraint is compiled or looked up."""
    if spec.choice is not None and len(spec.choice) > limits.max_grammar_choices:
        raise GrammarTooLarge(
            f"the choice list has {len(spec.choice)} strings, more than this server's limit "
            f"of {limits.max_grammar_choices} (--max-grammar-choices)"
        )
    if spec.json is not None:
        size = len(spec.json.encode())
        if size > limits.max_schema_bytes:
            raise GrammarTooLarge(
                f"the JSON schema is {size} bytes, more than this server's limit of "
                f"{limits.max_schema_bytes} (--max-schema-bytes)"
            )
        try:
            num = _count_enum_values(json.loads(spec.json))
        except json.JSONDecodeError:
            return  # the compile says what is wrong with it
        if num > limits.max_schema_enum_values:
            raise GrammarTooLarge(
                f"the JSON schema has {num} enum values, more than this server's limit of "
                f"{limits.max_schema_enum_values} (--max-schema-enum-values)"
            )
    text = spec.regex if spec.regex is not None else spec.grammar
    if spec.choice is not None:
        text = choice_grammar(spec.choice)
    if text is not None and len(text) > limits.max_grammar_chars:
        raise GrammarTooLarge(
            f"the {spec.kind} is {len(text)} characters{' as a grammar' if spec.choice else ''}, "
            f"more than this server's limit of {limits.max_grammar_chars} (--max-grammar-chars)"
        )


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the results (thread-safe).

    ``vocab_size`` is the model's logits width (it may exceed the tokenizer's
    length); ``stop_token_ids`` are the tokens that may end a finished grammar.

    Compiles run in worker processes (``grammar_worker.py``) under
    ``limits.grammar_compile_timeout``; the cache holds at most
    ``limits.grammar_cache_bytes`` of compiled grammars (xgrammar's own
    measure), least recently used dropped first, and refuses one grammar over
    ``limits.max_grammar_memory_bytes``. A request keeps its compiled grammar
    on its spec (``StructuredOutputsParams.compiled``) until it ends, so an
    eviction never makes the engine thread compile.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] | list[int],
        limits: AdmissionConfig | None = None,
    ) -> None:
        import xgrammar as xgr

        from .grammar_worker import CompilePool

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.limits = limits or AdmissionConfig()
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.pool = CompilePool(
            self.info.serialize_json().encode(), self.limits.grammar_compile_workers
        )
        self.pool.warm()
        # Keyed by spec kind too (a regex and a grammar with equal text differ);
        # values are (compiled grammar, its bytes).
        self._cache: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
        self.cache_bytes = 0
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._cache)

    def lookup(self, spec: StructuredOutputsParams) -> Any | None:
        """The cached grammar of ``spec`` (touched as most recently used), or None."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            self._cache.move_to_end(key)
            return hit[0]

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``spec`` (pinned on it, cached); ``ValueError``
        saying what is wrong. Blocks while a worker compiles."""
        if spec.compiled is not None:
            return spec.compiled
        check_bounds(spec, self.limits)
        compiled = self.lookup(spec)
        if compiled is None:
            compiled = self.build(spec)
        object.__setattr__(spec, "compiled", compiled)
        return compiled

    def build(self, spec: StructuredOutputsParams) -> Any:
        """Compile ``spec`` in a worker (no cache lookup) and cache the result."""
        from .grammar_worker import CompiledTooLarge, CompileFailed, CompileTimeout

        kind, text = self._request(spec)
        limits = self.limits
        try:
            data, size = self.pool.compile(
                kind, text, limits.max_grammar_memory_bytes, limits.grammar_compile_timeout
            )
        except CompileTimeout:
            raise GrammarTimeout(
                f"compiling the {spec.kind} took longer than this server's limit of "
                f"{limits.grammar_compile_timeout:g}s (--grammar-compile-timeout); simplify it"
            ) from None
        except CompiledTooLarge as e:
            raise GrammarTooLarge(
                f"the {spec.kind} compiles to {e.size} bytes, more than this server's limit "
                f"of {limits.max_grammar_memory_bytes} (--max-grammar-memory-bytes)"
            ) from None
        except CompileFailed as e:
            raise ValueError(f"cannot compile the {spec.kind}: {e}") from None
        compiled = self._xgr.CompiledGrammar.deserialize_json(data.decode(), self.info)
        del data
        self._insert(spec.key(), compiled, size)
        # Reading the grammar's JSON takes several times its size for a moment.
        _trim_heap()
        return compiled

    def _insert(self, key: tuple[Any, ...], compiled: Any, size: int) -> None:
        with self._lock:
            self.num_compiled += 1
            old = self._cache.pop(key, None)
            if old is not None:
                self.cache_bytes -= old[1]
            while self._cache and self.cache_bytes + size > self.limits.grammar_cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cache_bytes -= dropped
                self.num_evicted += 1
            self._cache[key] = (compiled, size)
            self.cache_bytes += size

    @staticmethod
    def _request(spec: StructuredOutputsParams) -> tuple[str, str]:
        """(worker kind, text) of a spec; schema problems found here are ``ValueError``s."""
        if spec.json is not None:
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            check_schema_keywords(schema)
            return "json_schema", json.dumps(bounded_strings_as_patterns(schema))
        if spec.json_object:
            return "json_object", ""
        if spec.regex is not None:
            return "regex", spec.regex
        if spec.choice is not None:
            return "grammar", choice_grammar(spec.choice)
        if spec.grammar is not None:
            return ("grammar" if "::=" in spec.grammar else "lark"), spec.grammar
        raise ValueError("structured outputs: no constraint given")

    def close(self) -> None:
        """Stop the compile workers (a later compile starts them again)."""
        self.pool.close()

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
