"""Tools work by default on the built-in model: `pdfleet serve` of the prepared
builtin://smollm2-135m-instruct directory, with no tool flag, answers the official
openai client's `tool_choice: "auto"` (what it sends whenever tools are given).

The model is tiny and rarely decides to call a tool, so the test checks the
plumbing: the directory's tools-aware template and its hermes parser are on by
default, a call the model writes is parsed into `tool_calls` (the model is
made to write one with a regex constraint), a tool result goes back through
the template, and `auto` without a constraint is a valid answer either way."""

from __future__ import annotations

import json

import pytest
from helpers.server import ServerProcess, fleet_token

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# What the template asks the model to write for a call (Hermes-style).
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}"\}\}\n'
    r"</tool_call>"
)


@pytest.mark.slow
def test_tool_choice_auto_works_on_the_builtin_model_with_no_flags(smollm2_dir, tmp_path):
    from openai import OpenAI

    server = ServerProcess(
        ["serve", smollm2_dir, "--served-model-name", "smollm2", "--max-model-len", "1024"],
        tmp_path,
        name="smollm2-tools",
    )
    try:
        server.wait_healthy(timeout=400)
        client = OpenAI(
            base_url=server.url + "/v1", api_key=fleet_token(), timeout=120, max_retries=0
        )
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]

        # auto, free: a valid answer, text or a call.
        free = client.chat.completions.create(
            model="smollm2", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=24
        )
        choice = free.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls

        # auto, the model made to write a call: the default hermes parser reads it.
        called = client.chat.completions.create(
            model="smollm2",
            messages=ask,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=48,
            extra_body={"structured_outputs": {"regex": HERMES_CALL}},
        )
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"][0].isupper()

        # The tool's result goes back through the template; the answer is text.
        follow = [
            *ask,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ]
        answer = client.chat.completions.create(
            model="smollm2", messages=follow, tools=TOOLS, temperature=0, max_tokens=24
        )
        assert answer.choices[0].message.content

        # A named tool choice is enforced by the grammar, as on any model.
        named = client.chat.completions.create(
            model="smollm2",
            messages=ask,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=24,
        )
        assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    finally:
        server.stop()
