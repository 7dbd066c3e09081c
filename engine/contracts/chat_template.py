"""What a chat template is given, alike in the engine and the gateway.

The engine renders a chat request's prompt with its template; the gateway
renders the same prompt to count its tokens and hash its blocks. Both read
``--chat-template`` with :func:`load_chat_template` and build each message the
template receives with :func:`template_message`, so the two renderings cannot
drift apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

CHAT_TEMPLATE_FLAG = "--chat-template"


def load_chat_template(value: str | None, flag: str = CHAT_TEMPLATE_FLAG) -> str | None:
    """``--chat-template``'s value as the template's text: a readable file's
    content, else the value itself when it holds Jinja markup (``{{`` or
    ``{%``); a ValueError naming ``flag`` for anything else."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {value!r}: cannot read the file: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{flag} {value!r}: no such file, and not a Jinja template")


def template_message(
    role: str,
    content: str,
    *,
    name: Any = None,
    tool_call_id: Any = None,
    reasoning_content: Any = None,
    reasoning: Any = None,
    tool_calls: Sequence[tuple[Any, Any, str]] = (),
) -> dict[str, Any]:
    """One message as the chat template reads it: its role and text, its name
    and tool call id when given, an earlier turn's reasoning as
    ``reasoning_content`` (``reasoning`` is its other name), and its tool
    calls, each ``(id, function name, arguments as JSON text)``, with their
    arguments as objects. A ValueError naming the call for arguments that are
    not JSON (the request is refused)."""
    out: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        out["name"] = name
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    thought = reasoning_content if reasoning_content is not None else reasoning
    if thought is not None:
        out["reasoning_content"] = thought
    if tool_calls:
        calls = []
        for call_id, function, arguments in tool_calls:
            try:
                args = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ValueError(
                    f"tool call {call_id}: function.arguments is not valid JSON"
                ) from None
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": function, "arguments": args},
                }
            )
        out["tool_calls"] = calls
    return out
