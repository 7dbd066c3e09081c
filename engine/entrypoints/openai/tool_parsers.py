"""Tool calls out of model text, whole or while it streams (docs/tool_calling.md).

Parsers are chosen by ``--tool-call-parser`` with vLLM's names:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A forced ``tool_choice`` (``required`` or a named function) does not need the
model's format: the grammar makes the model write a JSON array of
``{"name", "parameters"}`` objects (``required``) or the arguments object alone
(named), which :class:`ForcedParser` reads.

Every parser works on the whole text so far and returns prefix-stable results:
a call's name once it is complete, its arguments as the raw JSON text written
so far. Streaming sends the growth between two parses as deltas.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_SEPARATORS = " \t\r\n,;[]"


@dataclass
class ParsedCall:
    name: str | None  # None until its name is complete
    arguments: str  # raw JSON text of the arguments so far
    complete: bool


def value_end(s: str, start: int) -> int | None:
    """Index just past the JSON value that begins at ``s[start]`` (None: not ended yet).

    Only objects, arrays and strings have to be scanned; a bare scalar ends at
    the first separator after it."""
    if start >= len(s):
        return None
    if s[start] not in '{["':
        m = re.compile(r"[^,}\]\s]*").match(s, start)
        end = m.end() if m else start
        return end if end < len(s) else None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(s)):
        c = s[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_call_object(text: str, complete: bool) -> ParsedCall:
    """One ``{"name": ..., "arguments"|"parameters": ...}`` object, possibly partial."""
    name = None
    m = _NAME.search(text)
    if m:
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = m.group(1)
    args = ""
    a = _ARGS.search(text)
    if a:
        end = value_end(text, a.end())
        args = text[a.end() : end] if end is not None else text[a.end() :]
    elif complete:
        args = "{}"
    return ParsedCall(name, args, complete)


def scan_calls(section: str) -> list[ParsedCall]:
    """The call objects in ``section``: complete ones, then at most one partial."""
    calls: list[ParsedCall] = []
    i = 0
    while True:
        while i < len(section) and section[i] in _SEPARATORS:
            i += 1
        if i >= len(section) or section[i] != "{":
            return calls
        end = value_end(section, i)
        if end is None:
            calls.append(parse_call_object(section[i:], complete=False))
            return calls
        calls.append(parse_call_object(section[i:end], complete=True))
        i = end


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    for n in range(min(len(text), max(len(m) for m in markers)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ToolParser:
    """Finds where tool calls begin in free text; subclasses name the markers."""

    name = ""
    markers: tuple[str, ...] = ()

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(content to show, tool-call section or None). While streaming, content
        that may turn out to begin a marker is held back."""
        at = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if at:
            i = min(at)
            return text[:i], self.section(text[i:])
        if final:
            return text, None
        return text[: len(text) - _held_back(text, self.markers)], None

    def section(self, text: str) -> str:
        for m in self.markers:
            text = text.replace(m, " ")
        return text

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
        content, section = self.split(text, final)
        calls = scan_calls(section) if section is not None else []
        if final:
            calls = [c for c in calls if c.complete and c.name]
        return content, calls


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def section(self, text: str) -> str:
        return text.replace("<tool_call>", " ").replace("</tool_call>", " ")


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)


class Llama3JsonParser(ToolParser):
    """A reply that is a JSON object (after optional whitespace) is a tool call."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return "", stripped
        if not stripped and not final:
            return "", None  # nothing but whitespace yet: it may still become a call
        return super().split(text, final)


class ForcedParser(ToolParser):
    """Output written under a forced tool_choice's grammar (see module doc)."""

    def __init__(self, function: str | None) -> None:
        self.function = function

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
        if self.function is not None:
            end = value_end(text, len(text) - len(text.lstrip()))
            call = ParsedCall(self.function, text.strip(), end is not None)
            return "", [call] if call.arguments or not final else []
        calls = scan_calls(text.lstrip().removeprefix("["))
        if final:
            calls = [c for c in calls if c.complete and c.name]
        return "", calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(sorted(PARSERS))}, got {name!r}"
        )
    return PARSERS[name]()


def tool_call_id(parser: str | None) -> str:
    """A fresh call id (Mistral's templates want 9 alphanumerics)."""
    if parser == "mistral":
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))  # noqa: S311 (call ids must be unique, not secret)
    return "call_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=24))  # noqa: S311 (call ids must be unique, not secret)


def forced_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced tool_choice constrains the output to."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object"}
    # Each tool's "#/$defs/..." references must still resolve once its schema is
    # nested in the array: its definitions move to the root.
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        params = dict(t["function"].get("parameters") or {"type": "object"})
        for name, sub in params.pop("$defs", {}).items():
            if defs.get(name, sub) != sub:
                raise ValueError(
                    f"tools: two tools define {name!r} differently in $defs; rename one"
                )
            defs[name] = sub
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
