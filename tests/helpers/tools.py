"""Tools, a tools-aware chat template and tool-call checks shared by the
structured-output tests (tests/structured/)."""

from __future__ import annotations

import json

# A tools-aware ChatML template (the tiny tokenizer's own has no tools).
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %} [result of {{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def check_call(call, names=("get_weather", "add")):
    assert call.type == "function" and call.id
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    else:
        assert 0 <= args["a"] <= 9


def stream_calls(stream):
    """Reassemble streamed tool_calls deltas; check their OpenAI shape."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, finish
