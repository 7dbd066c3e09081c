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
    messages = [{"role": "user", "content": "hi " * 40}, {"role": "assistant", "content": "Hel"}]
    # A reserved template argument: the engine refuses it, the gateway estimates.
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": {"max_length": 5}}
    bad_call = {
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{no"}}],
            }
        ],
        "tools": TOOLS,
    }
    for analyzer in (PromptAnalyzer(model_dir, max_blocks=64), PromptAnalyzer(None, max_blocks=64)):
        for b in (body, bad_call):
            got = analyzer.analyze(b, True, 4)
            bare = analyzer.analyze({k: v for k, v in b.items() if k != "tools"}, True, 4)
            assert got.num_tokens > bare.num_tokens  # the tools are counted
            # ... and hashed: a repeated request's blocks cover what it is
            # counted, so routing finds all but a block of it cached.
            assert 0 <= got.num_tokens - 4 * len(got.block_hashes) < 4
            assert got.exact_hashes is None


def test_booleans_as_the_engine_reads_them(model_dir):
    analyzer = PromptAnalyzer(model_dir, max_blocks=64)
    base = {
        "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    }
    for extra in (
        {"add_generation_prompt": 0},
        {"add_generation_prompt": "false"},
        {"add_generation_prompt": "yes"},
        {"continue_final_message": "false"},
        {"add_special_tokens": 1},
    ):
        body = {**base, **extra}
        ids = engine_ids(model_dir, body)
        assert analyzer.analyze(body, True, 4).num_tokens == len(ids), extra


def test_arguments_left_out_of_a_tool_call_are_the_engines_empty_object(model_dir):
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "get_weather"}}],
            },
        ],
        "tools": TOOLS,
    }
    ids = engine_ids(model_dir, body)
    got = PromptAnalyzer(model_dir, max_blocks=64).analyze(body, True, 4)
    assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64))


def test_client_input_nested_past_what_json_encodes_never_raises(model_dir):
    deep: dict = {}
    node = deep
    for _ in range(3000):
        node["x"] = {}
        node = node["x"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    messages = [{"role": "user", "content": "hi"}]
    call = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
    call["tool_calls"][0]["function"]["arguments"] = "[" * 5000 + "]" * 5000
    for analyzer in (PromptAnalyzer(model_dir, max_blocks=64), PromptAnalyzer(None, max_blocks=64)):
        analyzer.analyze({"messages": messages, "tools": tools}, True, 4)
        analyzer.analyze({"messages": [*messages, call]}, True, 4)
    assert estimated_tokens({"messages": messages, "tools": tools}) is not None


def _variant(model_dir: str, out: Path, **files: str) -> str:
    """``model_dir``'s tokenizer with other template files (path: text; a
    ``tokenizer_config.json`` given as text replaces the config)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return str(out)


def test_templates_are_loaded_and_chosen_as_the_engines_tokenizer_does(model_dir, tmp_path):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tooled = "<tools>{{ tools | tojson }}</tools>" + plain
    marked = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
        "{% endif %}{{ eos_token }}{% endfor %}"
    )
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    named = {
        **config,
        "chat_template": [
            {"name": "default", "template": plain},
            {"name": "tool_use", "template": tooled},
        ],
    }
    dirs = [
        # A named list in the config: tool_use for a request with tools.
        _variant(model_dir, tmp_path / "a", **{"tokenizer_config.json": json.dumps(named)}),
        # chat_template.jinja and additional_chat_templates/tool_use.jinja.
        _variant(
            model_dir,
            tmp_path / "b",
            **{"chat_template.jinja": plain, "additional_chat_templates/tool_use.jinja": tooled},
        ),
        # {% generation %} blocks; bos and eos from special_tokens_map.json.
        _variant(
            model_dir,
            tmp_path / "c",
            **{
                "chat_template.jinja": marked,
                "special_tokens_map.json": json.dumps({"bos_token": "<pad>", "eos_token": "<s>"}),
            },
        ),
    ]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sun"}]
    for d in dirs:
        analyzer = PromptAnalyzer(d, max_blocks=64)
        for body in ({"messages": messages}, {"messages": messages, "tools": TOOLS}):
            ids = engine_ids(d, body)
            got = analyzer.analyze(body, True, 4)
            assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64)), d


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


# -- the engines' --chat-template, given to the gateway too ------------------------

# Another template than the model's: what the engines render with --chat-template.
GIVEN = """{%- if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}
{%- for m in messages %}{{ m.role | upper }}: {{ m.content }}
{%- if m.tool_calls %}{% for c in m.tool_calls %} -> {{ c.function.arguments | tojson }}
{%- endfor %}{% endif %}{% if m.reasoning_content %} ({{ m.reasoning_content }}){% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}ASSISTANT:{% endif %}"""


def engine_text_and_ids(
    model_dir: str, body: dict[str, Any], chat_template: str | None
) -> tuple[str, list[int]]:
    """What the engine's chat route renders for ``body`` when it runs with
    ``--chat-template`` ``chat_template``."""
    from transformers import AutoTokenizer

    from pdfleet.engine.contracts.chat_template import load_chat_template
    from pdfleet.engine.entrypoints.openai.protocol import ChatCompletionRequest
    from pdfleet.engine.entrypoints.openai.serving_base import ChatOptions, ServingBase

    tok = AutoTokenizer.from_pretrained(model_dir)
    options = ChatOptions(chat_template=load_chat_template(chat_template))
    serving = SimpleNamespace(_need_tokenizer=lambda: tok, options=options)
    req = ChatCompletionRequest(model="m", **body)
    text, ids = ServingBase.apply_chat_template(serving, req)  # type: ignore[arg-type]
    return text, list(ids)


def test_a_given_chat_template_is_rendered_as_the_engines_chat_template_flag_renders(
    model_dir, tmp_path
):
    """The gateway's --chat-template (the text, or a file's path) replaces the
    model's templates as the engine's does: the model's one template, and its
    named ones (``tool_use`` for a request with tools included)."""
    from pdfleet.engine.gateway.prompt import Tokenizer, template_inputs, template_messages

    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    named = {
        **config,
        "chat_template": [
            {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "<tools>{{ tools | tojson }}</tools>"},
        ],
    }
    dirs = [
        model_dir,  # the model's one template (TEMPLATE, in its config)
        _variant(model_dir, tmp_path / "named", **{"tokenizer_config.json": json.dumps(named)}),
        _variant(model_dir, tmp_path / "none"),  # no template of its own
    ]
    (tmp_path / "given.jinja").write_text(GIVEN)
    for d in dirs:
        for value in (GIVEN, str(tmp_path / "given.jinja")):
            analyzer = PromptAnalyzer(d, max_blocks=64, chat_template=value)
            tokenizer = Tokenizer(d, value)
            for body in BODIES:
                text, ids = engine_text_and_ids(d, body, value)
                messages = template_messages(body["messages"])
                inputs = template_inputs(body)
                assert messages is not None and inputs is not None
                assert tokenizer.chat_text(messages, inputs) == text, (d, body)
                got = analyzer.analyze(body, True, 4)
                assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64))
    # Without the flag the model's own template renders another prompt.
    body = BODIES[1]
    ids = engine_text_and_ids(model_dir, body, GIVEN)[1]
    assert PromptAnalyzer(model_dir, max_blocks=64).analyze(body, True, 4).num_tokens != len(ids)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("no-such-file.jinja", "no such file, and not a Jinja template"),
        ("{% for m in messages %}", "not a template jinja2 can compile"),
        ("{{" + "(" * 3000 + "1" + ")" * 3000 + "}}", "not a template jinja2 can compile"),
        ("", "no such file"),
    ],
)
def test_a_chat_template_the_gateway_cannot_load_is_refused_naming_the_flag(model_dir, value, why):
    from pdfleet.engine.gateway.prompt import check_chat_template

    with pytest.raises(ValueError, match=f"^--chat-template.*{why}"):
        check_chat_template(value)
    with pytest.raises(ValueError, match=f"^--chat-template.*{why}"):
        PromptAnalyzer(model_dir, max_blocks=64, chat_template=value)


def test_the_engine_and_the_gateway_build_each_message_alike():
    """One function builds the messages both hand their template; the gateway
    adds the reasoning under transformers' other name (``thinking``), and
    refuses (None) what the engine refuses (a 400 naming the call)."""
    from pdfleet.engine.entrypoints.openai.protocol import APIError, ChatMessage
    from pdfleet.engine.gateway.prompt import template_messages

    for body in BODIES:
        gateway = template_messages(body["messages"])
        assert gateway is not None
        engine = [ChatMessage(**m).template_dict() for m in body["messages"]]
        assert [{k: v for k, v in m.items() if k != "thinking"} for m in gateway] == engine
        for g, e in zip(gateway, engine, strict=True):
            assert g.get("thinking") == e.get("reasoning_content")
    for arguments in ("{no", "[" * 5000 + "]" * 5000):
        call = {"id": "c7", "type": "function", "function": {"name": "f", "arguments": arguments}}
        message = {"role": "assistant", "tool_calls": [call]}
        assert template_messages([message]) is None
        with pytest.raises(APIError, match="tool call c7: function.arguments is not valid JSON"):
            ChatMessage(**message).template_dict()


def test_a_continued_last_message_is_cut_where_the_engine_cuts_it(model_dir, tmp_path):
    """``continue_final_message``: the rendering ends at the last message's
    text, whether the template keeps its spacing or trims it; a template that
    drops the message, or never reads ``content``, is refused by the engine and
    estimated by the gateway."""
    from pdfleet.engine.entrypoints.openai.protocol import APIError

    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is "},
    ]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    trimmed = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>\n{% endfor %}"
    for value in (None, GIVEN, trimmed):
        analyzer = PromptAnalyzer(model_dir, max_blocks=64, chat_template=value)
        text, ids = engine_text_and_ids(model_dir, body, value)
        assert "colour is" in text[-12:]
        got = analyzer.analyze(body, True, 4)
        assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64)), value
    for value in ("{% for m in messages %}{{ m.role }}{% endfor %}", "{{ messages[0].content }}"):
        with pytest.raises(APIError):
            engine_text_and_ids(model_dir, body, value)
        analyzer = PromptAnalyzer(model_dir, max_blocks=64, exact=True, chat_template=value)
        assert analyzer.analyze(body, True, 4).exact_hashes is None  # estimated


def test_named_extra_special_tokens_reach_the_template(model_dir, tmp_path):
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {"image_token": "<pad>", "audio_token": "<s>"}
    d = _variant(model_dir, tmp_path / "extra", **{"tokenizer_config.json": json.dumps(config)})
    template = (
        "{{ image_token }}{{ audio_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    body = {"messages": [{"role": "user", "content": "hello"}]}
    text, ids = engine_text_and_ids(d, body, template)
    assert text.startswith("<pad><s>")
    got = PromptAnalyzer(d, max_blocks=64, chat_template=template).analyze(body, True, 4)
    assert (got.num_tokens, got.block_hashes) == (len(ids), chain_hashes(ids, 4, 64))


def test_a_given_template_that_names_one_of_the_models_templates_is_that_one(model_dir, tmp_path):
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "other", "template": "O{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    d = _variant(model_dir, tmp_path / "named", **{"tokenizer_config.json": json.dumps(config)})
    (tmp_path / "name.jinja").write_text("other")
    body = {"messages": [{"role": "user", "content": "hello"}]}
    text, ids = engine_text_and_ids(d, body, str(tmp_path / "name.jinja"))
    assert text == "Ohello"
    got = PromptAnalyzer(d, max_blocks=64, chat_template=str(tmp_path / "name.jinja"))
    assert got.analyze(body, True, 4).num_tokens == len(ids)


@pytest.mark.parametrize("name", ["max_length", "truncation", "padding", "return_tensors"])
def test_template_call_arguments_in_chat_template_kwargs_are_refused(model_dir, name):
    """Arguments of the template call that shape tokenizing would be taken by
    the call and never reach the template: a 400 naming the field."""
    from pdfleet.engine.entrypoints.openai.protocol import APIError

    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: 5}}
    with pytest.raises(APIError, match=f"chat_template_kwargs: {name} is an argument"):
        engine_text_and_ids(model_dir, body, None)
    analyzer = PromptAnalyzer(model_dir, max_blocks=64, exact=True)
    assert analyzer.analyze(body, True, 4).exact_hashes is None
    assert analyzer.analyze({**body, "chat_template_kwargs": {}}, True, 4).exact_hashes


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_a_truncated_prompt_is_counted_and_hashed_as_the_engine_keeps_it(model_dir, side):
    """``truncate_prompt_tokens``: the engine keeps the prompt's last tokens
    (or its first, ``truncation_side: right``); the gateway counts what it
    keeps, hashes the blocks it keeps from the start, and none kept from the
    end (another prompt's blocks, which it does not tokenize)."""
    from transformers import AutoTokenizer

    from pdfleet.engine.entrypoints.openai.protocol import CompletionRequest
    from pdfleet.engine.entrypoints.openai.serving_base import ServingBase

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    body: dict[str, Any] = {"prompt": prompt, "truncate_prompt_tokens": 17}
    if side is not None:
        body["truncation_side"] = side
    req = CompletionRequest(model="m", **body)
    engine = SimpleNamespace(max_model_len=4096)
    ids = tok(prompt).input_ids
    cut = ServingBase.truncate(engine, ids, req.truncate_prompt_tokens, req.truncation_side)  # type: ignore[arg-type]
    assert len(cut) == 17 < len(ids)
    analyzer = PromptAnalyzer(model_dir, max_blocks=64, exact=True)
    got = analyzer.analyze(body, False, 4)
    assert got.num_tokens == len(cut)
    if side == "right":
        assert got.block_hashes == chain_hashes(cut, 4, 64)
        assert got.exact_hashes == analyzer.exact_hashes(cut, 4)
    else:
        assert got.block_hashes == [] and got.exact_hashes == []
    whole = analyzer.analyze({"prompt": prompt, "truncate_prompt_tokens": 4000}, False, 4)
    assert whole.num_tokens == len(ids)
    # The value's other forms the engine's request model reads.
    for keep in ("17", 17.0, "17.0"):
        again = analyzer.analyze({**body, "truncate_prompt_tokens": keep}, False, 4)
        assert (again.num_tokens, again.block_hashes) == (got.num_tokens, got.block_hashes)


def test_a_long_prompts_untokenized_rest_is_counted_at_its_heads_rate(model_dir):
    """Past the exactly tokenized head, the rest of a long prompt is counted
    at the head's own characters per token or by its own text (a digit a
    token, a character beyond ASCII a token), whichever is more: digits, JSON
    or CJK text count about what they tokenize to, not four characters a
    token, also behind a head of another kind; never much under."""
    import random

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    analyzer = PromptAnalyzer(model_dir, max_blocks=4)  # a head of a few hundred characters
    rng = random.Random(0)
    for text in (
        "".join(rng.choice("0123456789") for _ in range(6000)),
        '{"a": 1.2345, "b": [0.5, 0.25]}, ' * 180,
        "数据中心的服务器" * 700,
        "The quick brown fox jumps over the lazy dog. " * 130,
        "The quick brown fox. " * 20 + "".join(rng.choice("0123456789") for _ in range(6000)),
    ):
        exact = len(tok.encode(text).ids)
        got = analyzer.analyze({"prompt": text}, False, 4).num_tokens
        assert 0.9 * exact <= got <= 1.2 * exact, (text[:20], got, exact)
    # Without a tokenizer the same estimate counts them.
    bare = PromptAnalyzer(None, max_blocks=4)
    assert bare.analyze({"prompt": "数据中心的服务器" * 700}, False, 4).num_tokens == 5600
    assert bare.analyze({"prompt": "7" * 6000}, False, 4).num_tokens == 6000
