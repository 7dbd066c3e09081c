"""Admissibility of a request's sampling fields, checked before it is admitted.

Torch-free, so that the gateway runs the same checks before the prefill leg as
the engines run before admission: a body that one engine of a fleet accepts,
every engine accepts (and prefill KV is never pinned for a request that the
decode engine would refuse). The engine checks again with its model's
vocabulary size.

Every bound here keeps a value inside what the sampler can hold (int64 for
tensors, int32 for counts), so no client value can overflow a kernel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Most completions one request may ask for (n, best_of).
MAX_N = 128


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(
    name: str, value: Any, low: int, high: int, what: str | None = None, allow_none: bool = True
) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(
            f"{name} must be {what or f'an integer between {low} and {high}'}, got {value!r}"
        )


def _float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _token_ids(name: str, ids: Any, vocab_size: int | None) -> None:
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    high = (vocab_size - 1) if vocab_size else INT32_MAX
    for t in ids:
        if not _is_int(t) or not 0 <= t <= high:
            where = (
                f"the model's vocabulary (must be < {vocab_size})" if vocab_size else f"0..{high}"
            )
            raise ValueError(f"{name}: token id {t!r} is outside {where}")


def check_prompt_tokens(prompt: Any, vocab_size: int | None) -> None:
    """Token-id prompts (``[1, 2]`` or ``[[1, 2], [3]]``) stay inside the vocabulary."""
    if not isinstance(prompt, list) or not prompt:
        return
    if all(_is_int(t) for t in prompt):
        _token_ids("prompt", prompt, vocab_size)
    elif all(isinstance(p, list) for p in prompt):
        for p in prompt:
            _token_ids("prompt", p, vocab_size)


def _check_best_of(f: Mapping[str, Any], vocab_size: int | None, max_logprobs: int | None) -> None:
    _int("best_of", f["best_of"], 1, MAX_N)
    if _is_int(f["best_of"]) and _is_int(f.get("n")) and f["best_of"] < f["n"]:
        raise ValueError(f"best_of ({f['best_of']}) must be >= n ({f['n']})")


def _check_min_tokens(
    f: Mapping[str, Any], vocab_size: int | None, max_logprobs: int | None
) -> None:
    _int("min_tokens", f["min_tokens"], 0, INT32_MAX)
    limit = f.get("max_completion_tokens")
    if limit is None:
        limit = f.get("max_tokens")
    min_tokens = f["min_tokens"] or 0
    if limit is not None and _is_int(limit) and min_tokens > limit:
        name = (
            "max_completion_tokens" if f.get("max_completion_tokens") is not None else "max_tokens"
        )
        raise ValueError(f"min_tokens ({min_tokens}) must be <= {name} ({limit})")


def _logprob_count(name: str, value: Any, vocab_size: int | None, max_logprobs: int | None) -> None:
    """A logprob count: 0..max_logprobs, or -1 for the whole vocabulary where the
    engine's bound allows that many (``--max-logprobs -1``: no bound)."""
    bound = max_logprobs if max_logprobs is not None and max_logprobs != -1 else None
    if _is_int(value) and value == -1:
        if bound is not None and vocab_size and vocab_size > bound:
            raise ValueError(
                f"{name}: -1 asks for the whole vocabulary ({vocab_size} tokens), more than "
                f"the engine's max_logprobs ({max_logprobs}); ask for at most {max_logprobs} "
                "or serve with --max-logprobs -1"
            )
        return
    high = INT32_MAX if bound is None else bound
    note = "" if bound is None else f" (the engine's max_logprobs is {bound})"
    _int(name, value, 0, high, what=f"-1 or an integer 0..{high}{note}")


def _check_logprobs(f: Mapping[str, Any], vocab_size: int | None, max_logprobs: int | None) -> None:
    logprobs = f["logprobs"]
    if isinstance(logprobs, bool):
        _logprob_count("top_logprobs", f.get("top_logprobs"), vocab_size, max_logprobs)
    else:
        _logprob_count("logprobs", logprobs, vocab_size, max_logprobs)


def _check_prompt_logprobs(
    f: Mapping[str, Any], vocab_size: int | None, max_logprobs: int | None
) -> None:
    _logprob_count("prompt_logprobs", f["prompt_logprobs"], vocab_size, max_logprobs)


_TOKEN_KEY = re.compile(r"-?[0-9]+")


def _check_logit_bias(
    f: Mapping[str, Any], vocab_size: int | None, max_logprobs: int | None
) -> None:
    """Keys are token ids (integers as strings, inside the vocabulary); values
    finite numbers. A bias outside [-100, 100] is clamped to it (vLLM's
    behaviour), never refused. Each key is checked whole (id, then value)
    before the next, so the engine and the gateway name the same first fault."""
    bias = f["logit_bias"]
    if bias is None:
        return
    if not isinstance(bias, Mapping):
        raise ValueError(
            f"logit_bias must be an object mapping token ids to biases, got {type(bias).__name__}"
        )
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(str(key)):
            raise ValueError(f"logit_bias: key {key!r} is not a token id")
        tid = int(str(key))
        if tid < 0 or (vocab_size and tid >= vocab_size):
            where = "must be >= 0" if tid < 0 else f"must be < {vocab_size}"
            raise ValueError(
                f"logit_bias: token id {key!r} is outside the model's vocabulary ({where})"
            )
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"logit_bias: the bias of token {key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(
                f"logit_bias: the bias of token {key} must be a finite number, got {value!r}"
            )


def _ints(name: str, low: int, high: int, what: str | None = None) -> Any:
    return lambda f, vocab_size, max_logprobs: _int(name, f[name], low, high, what)


def _floats(
    name: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Any:
    return lambda f, vocab_size, max_logprobs: _float(name, f[name], low, high, low_open)


_INT64 = "a 64-bit signed integer"
# (field, its check) in the order the fields are checked: the first
# inadmissible one is named. Checks of two fields (best_of and n, min_tokens
# and the limit) sit under the field checked second.
_CHECKS: tuple[tuple[str, Any], ...] = (
    ("n", _ints("n", 1, MAX_N)),
    ("best_of", _check_best_of),
    ("temperature", _floats("temperature", low=0.0)),
    ("top_p", _floats("top_p", low=0.0, high=1.0, low_open=True)),
    (
        "top_k",
        _ints(
            "top_k", -1, INT32_MAX, f"-1 or 0 (disabled) or a positive integer up to {INT32_MAX}"
        ),
    ),
    ("min_p", _floats("min_p", low=0.0, high=1.0)),
    ("presence_penalty", _floats("presence_penalty", low=-2.0, high=2.0)),
    ("frequency_penalty", _floats("frequency_penalty", low=-2.0, high=2.0)),
    ("repetition_penalty", _floats("repetition_penalty", low=0.0, low_open=True)),
    ("seed", _ints("seed", INT64_MIN, INT64_MAX, _INT64)),
    ("priority", _ints("priority", INT64_MIN, INT64_MAX, _INT64)),
    ("max_tokens", _ints("max_tokens", 1, INT32_MAX)),
    ("max_completion_tokens", _ints("max_completion_tokens", 1, INT32_MAX)),
    ("min_tokens", _check_min_tokens),
    ("stop_token_ids", lambda f, v, _: _token_ids("stop_token_ids", f["stop_token_ids"], v)),
    ("logprobs", _check_logprobs),
    ("prompt_logprobs", _check_prompt_logprobs),
    ("logit_bias", _check_logit_bias),
    ("prompt", lambda f, v, _: check_prompt_tokens(f["prompt"], v)),
)
_CHECKED = frozenset(name for name, _ in _CHECKS)
_CHECK_OF: dict[str, Any] = dict(_CHECKS)
_ORDER = {name: i for i, (name, _) in enumerate(_CHECKS)}


def check_sampling(
    fields: Mapping[str, Any],
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    max_n: int = MAX_N,
    max_output_tokens: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first inadmissible sampling field.

    ``fields`` is an OpenAI completion or chat request body (or the sampling
    part of it); unknown fields are ignored. ``vocab_size`` bounds token ids
    when known; ``max_logprobs`` bounds the logprob counts when known.
    ``max_n`` and ``max_output_tokens`` are the server's request bounds
    (``--max-n``, ``--max-request-output-tokens``; :func:`check_output_bounds`).

    Only the fields a body holds are looked at (the gateway runs this on
    every request, and most bodies hold three or four of the checked fields).
    """
    present = _CHECKED.intersection(fields)
    if present:
        # (the checks of the fields it holds, in their order: not a turn per check)
        for name in sorted(present, key=_ORDER.__getitem__):
            _CHECK_OF[name](fields, vocab_size, max_logprobs)
        if max_n < MAX_N or max_output_tokens is not None:
            check_output_bounds(fields, max_n, max_output_tokens)
    if not _STRUCTURED.isdisjoint(fields):
        check_structured(fields)


def num_prompts(prompt: Any) -> int:
    """Prompts in a completions ``prompt`` (a batch is a list of strings or of
    token-id lists; anything else is one prompt)."""
    if isinstance(prompt, list) and prompt and not all(_is_int(p) for p in prompt):
        return len(prompt)
    return 1


def num_sequences(fields: Mapping[str, Any]) -> int:
    """The sequences one prompt of the request runs: ``best_of`` when larger
    than ``n`` (each is generated), else ``n``."""
    n = fields.get("n")
    best_of = fields.get("best_of")
    count = n if isinstance(n, int) and not isinstance(n, bool) else 1
    if isinstance(best_of, int) and not isinstance(best_of, bool):
        return max(count, best_of)
    return count


def check_output_tokens(
    num_seqs: int, max_tokens: list[int], cap: int, name: str = "max_tokens"
) -> None:
    """``ValueError`` naming ``name`` when ``num_seqs`` completions of each
    prompt, ``max_tokens[i]`` tokens long for prompt i, exceed ``cap`` tokens
    in all (what one request may ask the engine to generate)."""
    total = num_seqs * sum(max_tokens)
    if total > cap:
        over = f" over {len(max_tokens)} prompts" if len(max_tokens) > 1 else ""
        raise ValueError(
            f"{name}: n × {name}{over} asks for up to {total} output tokens (n = "
            f"{num_seqs}), more than this server's limit of {cap} per request "
            f"(--max-request-output-tokens); lower n or {name}"
        )


def check_output_bounds(
    fields: Mapping[str, Any], max_n: int, max_output_tokens: int | None
) -> None:
    """The server's bounds on what one request may generate: ``n`` and
    ``best_of`` at most ``max_n``, and ``n × max_tokens`` (summed over a
    batch's prompts) at most ``max_output_tokens`` tokens when the body gives
    ``max_tokens`` (the engine checks again with the value it resolves)."""
    several = "n" in fields or "best_of" in fields
    if several:
        for name in ("n", "best_of"):
            value = fields.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > max_n:
                raise ValueError(
                    f"{name} must be at most {max_n} on this server (--max-n), got {value}"
                )
    if max_output_tokens is None:
        return
    name = (
        "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    )
    limit = fields.get(name)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return
    prompt = fields.get("prompt")
    if not several and type(prompt) is not list and limit <= max_output_tokens:
        return  # one sequence of one prompt, within the cap (every gateway request's check)
    count = num_prompts(prompt)
    check_output_tokens(num_sequences(fields), [limit] * count, max_output_tokens, name)


# vLLM's per-request constraint fields (older ``guided_*`` and newer ``structured_outputs``).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
TOOL_CHOICES = ("none", "auto", "required")
# The fields check_structured looks at (absent all of them, it has nothing to check).
_STRUCTURED = frozenset(
    ("response_format", *GUIDED_FIELDS, "structured_outputs", "tools", "tool_choice")
)


def _check_choice(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value or any(not isinstance(c, str) for c in value):
        raise ValueError(f"{name} must be a non-empty list of strings")


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")


def _check_schema(name: str, value: Any) -> None:
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name}: the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"{name} must be a JSON schema (an object)")


def _known_keys(path: str, obj: Mapping[str, Any], known: tuple[str, ...]) -> None:
    """A key of a nested object that nothing reads is refused by its path, never
    ignored."""
    for key in obj:
        if key not in known:
            raise ValueError(
                f"{path}.{key} is not a field of {path} (its fields: {', '.join(known)})"
            )


def check_structured(fields: Mapping[str, Any]) -> None:  # noqa: C901 (a linear chain of request checks)
    """Shape of the structured-output and tool fields; ``ValueError`` naming the field.

    Whether a schema or grammar compiles is the engine's check (it needs the
    tokenizer); this one is what the gateway can refuse before the prefill leg."""
    f = fields
    constraints: list[str] = []
    rf = f.get("response_format")
    if rf is not None:
        if not isinstance(rf, Mapping):
            raise ValueError("response_format must be an object with a type")
        _known_keys("response_format", rf, ("type", "json_schema"))
        kind = rf.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}"
            )
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, Mapping):
                raise ValueError("response_format.json_schema must be an object with a schema")
            # OpenAI's JSON-schema format object; "strict" is accepted as the
            # grammar enforces the schema strictly anyway.
            _known_keys(
                "response_format.json_schema", js, ("name", "description", "schema", "strict")
            )
            if "schema" not in js:
                raise ValueError("response_format.json_schema.schema is required")
            _check_schema("response_format.json_schema.schema", js["schema"])
        if kind != "text":
            constraints.append("response_format")
    for name in GUIDED_FIELDS:
        value = f.get(name)
        if value is None:
            continue
        constraints.append(name)
        if name == "guided_json":
            _check_schema(name, value)
        elif name == "guided_choice":
            _check_choice(name, value)
        else:
            _check_text(name, value)
    so = f.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise ValueError("structured_outputs must be an object")
        given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: set exactly one of " + ", ".join(STRUCTURED_KEYS))
        (key,) = given
        if key == "json":
            _check_schema("structured_outputs.json", so["json"])
        elif key == "choice":
            _check_choice("structured_outputs.choice", so["choice"])
        elif key != "json_object":
            _check_text(f"structured_outputs.{key}", so[key])
        constraints.append("structured_outputs")
    if len(constraints) > 1:
        raise ValueError(
            f"{constraints[1]}: only one output constraint per request "
            f"(also given: {constraints[0]})"
        )
    names = _check_tools(f.get("tools"))
    choice = f.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}"
            )
        named = None
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        named = choice["function"].get("name")
        if not isinstance(named, str):
            raise ValueError("tool_choice.function.name must be a string")
    else:
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if choice != "none" and names is None:
        raise ValueError("tool_choice: needs tools")
    if named is not None and named not in (names or []):
        raise ValueError(f"tool_choice: no tool named {named!r} in tools")
    if choice not in (None, "none", "auto") and constraints:
        raise ValueError(f"{constraints[0]}: cannot be combined with a forced tool_choice")


def _check_tools(tools: Any) -> list[str] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of function tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        if fn["name"] in names:
            raise ValueError(f"tools[{i}].function.name {fn['name']!r} is used twice")
        names.append(fn["name"])
    return names
