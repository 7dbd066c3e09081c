"""The gateway renders a chat request's prompt as the engine does (tools,
documents, tool calls, names, an earlier turn's reasoning, the request's
``chat_template_kwargs``, ``add_generation_prompt``), so its token count and
exact block hashes are the engine's. A prompt it cannot mirror is counted by
estimate, its tools included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdfleet.engine.gateway.prompt import PromptAnalyzer, chain_hashes, estimated_tokens

# A template that reads every input the engine passes it: each message's name,
# tool calls (arguments as objects, through tojson), tool call id, reasoning
# (as reasoning_content and as thinking), the request's tools and documents,
# a chat_template_kwargs variable, loop controls, and the special tokens.
TEMPLATE = """{{ bos_token }}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}
{%- if documents %}{% for d in documents %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}{% endif %}
{%- if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}
{%- for m in messages %}
{%- if loop.index > 50 %}{% break %}{% endif %}
<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}
{% if m.thinking %}<think>{{ m.thinking }}|{{ m.reasoning_content }}</think>{% endif %}
{{- m.content }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.id }} {{ c.function.name }}
{{- c.function.arguments | tojson }}</call>{% endfor %}{% endif %}
{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & tomorrow in a city, ünïcode",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": TOOLS},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?", "name": "ana"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Zürich <x>"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Summarize"}]},
            {"role": "assistant", "content": "Sure", "reasoning": "old name"},
        ],
        "documents": [{"title": "a", "text": "the text of a"}],
        "add_generation_prompt": False,
    },
]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tool-template")
    for f in Path(tiny_model).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def engine_ids(model_dir: str, body: dict[str, Any]) -> list[int]:
    """The ids the engine's chat route templates for ``body``."""
    from transformers import AutoTokenizer

    from pdfleet.engine.entrypoints.openai.protocol import ChatCompletionRequest
    from pdfleet.engine.entrypoints.openai.serving_base import ChatOptions, ServingBase

    tok = AutoTokenizer.from_pretrained(model_dir)
    serving = SimpleNamespace(_need_tokenizer=lambda: tok, options=ChatOptions())
    req = ChatCompletionRequest(model="m", **body)
    _, ids = ServingBase.apply_chat_template(serving, req)  # type: ignore[arg-type]
    return list(ids)


@pytest.mark.parametrize("index", range(len(BODIES)))
def test_the_gateway_counts_and_hashes_a_chat_prompt_as_the_engine_templates_it(model_dir, index):
    body = BODIES[index]
    ids = engine_ids(model_dir, body)
    analyzer = PromptAnalyzer(model_dir, max_blocks=64)
    got = analyzer.analyze(body, True, 4)
    assert got.num_tokens == len(ids)
    assert got.block_hashes == chain_hashes(ids, 4, 64)
    # Without the tools (or documents) the prompt is another one.
    bare = {k: v for k, v in body.items() if k not in ("tools", "documents")}
    if bare != body:
        assert analyzer.analyze(bare, True, 4).num_tokens < got.num_tokens


def test_a_prompt_the_gateway_cannot_mirror_is_estimated_with_its_tools(model_dir):
    analyzer = PromptAnalyzer(model_dir, max_blocks=64)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "tools": TOOLS, "continue_final_message": True}
    got = analyzer.analyze(body, True, 4)
    assert got.num_tokens == estimated_tokens(body)
    assert got.num_tokens > analyzer.analyze({"messages": messages}, True, 4).num_tokens
    # Tool call arguments the engine refuses: estimated too, never raised.
    bad = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{no"}}],
            }
        ]
    }
    assert analyzer.analyze(bad, True, 4).num_tokens == estimated_tokens(bad)
    # Without a tokenizer the estimate counts the tools as well.
    plain = PromptAnalyzer(None, max_blocks=64)
    assert plain.analyze(body, True, 4).num_tokens == estimated_tokens(body)


def test_the_built_in_models_tool_template_is_mirrored(model_dir, tmp_path):
    """SmolLM2's template as pdfleet ships it (``chatml_tools.jinja``, a
    ``chat_template.jinja`` file beside the tokenizer)."""
    import pdfleet.engine.tiny as tiny

    d = tmp_path / "smol"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(Path(tiny.__file__).parent / "chatml_tools.jinja", d / "chat_template.jinja")
    analyzer = PromptAnalyzer(str(d), max_blocks=64)
    for body in BODIES[:2]:
        ids = engine_ids(str(d), body)
        got = analyzer.analyze(body, True, 4)
        assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64))
