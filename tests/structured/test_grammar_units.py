"""Grammar compiler, bitmask, request checks and tool parsers, in process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdfleet.engine.config.admission import AdmissionConfig
from pdfleet.engine.contracts.sampling_checks import check_sampling
from pdfleet.engine.entrypoints.openai.tool_parsers import (
    ForcedParser,
    get_parser,
    value_end,
)
from pdfleet.engine.sample.grammar import GrammarCompiler, apply_bitmask
from pdfleet.engine.sampling_params import StructuredOutputsParams as Spec


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    yield compiler
    compiler.close()


def allowed_ids(compiler, matcher) -> list[int]:
    bm = compiler.allocate_bitmask(1)
    compiler.fill_bitmask([matcher], bm)
    return [i for i in range(compiler.vocab_size) if (int(bm[0, i // 32]) >> (i % 32)) & 1]


def test_cache_compiles_each_spec_once_and_stays_bounded_in_bytes(compiler, monkeypatch):
    # Room for two of the small grammars below (0.5 to 1.2 KB each here), not three.
    limits = AdmissionConfig(grammar_cache_bytes=2100, max_grammar_memory_bytes=2100)
    monkeypatch.setattr(compiler, "limits", limits)
    n0 = compiler.num_compiled
    a, b, c = Spec(regex="a+"), Spec(regex="b+"), Spec(choice=("x", "y"))
    assert compiler.compile(a) is compiler.compile(Spec(regex="a+"))
    assert compiler.num_compiled == n0 + 1
    compiler.compile(b)
    compiler.compile(c)
    assert compiler.cache_bytes <= 2100
    assert compiler.num_evicted >= 1
    assert compiler.lookup(Spec(regex="a+")) is None  # the least recently used went first
    assert compiler.compile(a) is a.compiled  # a request keeps its own grammar
    compiler.compile(Spec(regex="a+"))  # evicted: compiled again
    assert compiler.num_compiled == n0 + 4


def test_length_bounded_strings_never_allow_control_characters(compiler, tokenizer):
    m = compiler.matcher(Spec(json={"type": "string", "maxLength": 6}))
    assert m.accept_string('"')
    ids = allowed_ids(compiler, m)
    assert ids
    assert not [i for i in ids if any(ord(ch) < 32 for ch in tokenizer.decode([i]))]


def test_matcher_is_advanced_over_tokens_already_produced(compiler, tokenizer):
    spec = Spec(choice=("left", "right"))
    ids = tokenizer("ri", add_special_tokens=False).input_ids
    m = compiler.matcher(spec, ids)
    allowed = allowed_ids(compiler, m)
    assert allowed
    for t in allowed:
        text = "ri" + tokenizer.decode([t])
        assert "right".startswith(text) or text.startswith("right"), text


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (Spec(json={"type": "strin"}), "Unsupported type"),
        (Spec(json='{"type": '), "not valid JSON"),
        (Spec(json={"type": "array", "items": {"not": {"type": "string"}}}), "$.items: "),
        (Spec(json={"properties": {"a": {"multipleOf": 3}}}), "'multipleOf'"),
        (Spec(regex="[a-z"), "cannot compile the regex"),
        (Spec(grammar="root ::= ("), "cannot compile the grammar"),
    ],
)
def test_bad_specs_are_value_errors_naming_the_problem(compiler, spec, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        compiler.compile(spec)
    assert "/project/" not in str(e.value)  # no C++ source locations


def test_spec_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        Spec(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one"):
        Spec()


def test_apply_bitmask_masks_only_the_given_rows():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 2  # token 34 only
    apply_bitmask(logits, bitmask, [1])
    assert torch.isinf(logits[1]).sum() == 39 and logits[1, 34] == 0
    assert (logits[0] == 0).all() and (logits[2] == 0).all()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_choice": "ab"}, "guided_choice"),
        ({"guided_regex": "a", "guided_json": {}}, "only one output constraint"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "guided_regex": "a",
            },
            "forced tool_choice",
        ),
    ],
)
def test_check_sampling_refuses_bad_structured_and_tool_fields(body, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_sampling(body)


# -- tool parsers ------------------------------------------------------------------


def stream_parse(parser, text: str, step: int = 3):
    """Feed ``text`` in pieces; return what each call's fields grew to, and check
    that every partial result is a prefix of the final one."""
    seen: dict[int, tuple[str | None, str]] = {}
    for end in range(step, len(text) + step, step):
        _, calls = parser.parse(text[:end], final=end >= len(text))
        for i, c in enumerate(calls):
            old = seen.get(i, (None, ""))
            assert c.arguments.startswith(old[1])
            seen[i] = (c.name or old[0], c.arguments)
    return seen


@pytest.mark.parametrize(
    ("name", "text", "content"),
    [
        (
            "hermes",
            'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"b": "x}"}}</tool_call>',
            "Sure. ",
        ),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x}"}}',
            "",
        ),
        (
            "mistral",
            'ok[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
            '{"name": "g", "arguments": {"b": "x}"}}]',
            "ok",
        ),
    ],
)
def test_parsers_find_calls_whole_and_while_streaming(name, text, content):
    parser = get_parser(name)
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {"b": "x}"}),
    ]
    streamed = stream_parse(parser, text)
    assert [streamed[i] for i in sorted(streamed)] == [(c.name, c.arguments) for c in calls]


def test_parsers_hold_back_a_possible_marker_and_leave_plain_text_alone():
    hermes = get_parser("hermes")
    assert hermes.parse("Hello <tool", final=False) == ("Hello ", [])
    assert hermes.parse("Hello <tool", final=True) == ("Hello <tool", [])
    assert get_parser("llama3_json").parse("It is sunny.") == ("It is sunny.", [])


def test_forced_parsers_read_named_and_required_output():
    _, (call,) = ForcedParser("f").parse('{"a": [1, 2]}')
    assert (call.name, call.arguments) == ("f", '{"a": [1, 2]}')
    _, calls = ForcedParser(None).parse(
        '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    )
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]


def test_value_end_skips_braces_inside_strings():
    s = '{"a": "}{\\"", "b": [1, {"c": 2}]} tail'
    assert s[: value_end(s, 0)] == '{"a": "}{\\"", "b": [1, {"c": 2}]}'
    assert value_end('{"a": 1', 0) is None


def test_unknown_parser_name_is_a_value_error():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("pythonic")


def test_required_tool_schema_keeps_each_tools_definitions_resolvable(compiler):
    from pydantic import BaseModel

    from pdfleet.engine.entrypoints.openai.tool_parsers import forced_schema

    class Unit(BaseModel):
        name: str

    class Args(BaseModel):
        unit: Unit

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": Args.model_json_schema()}}
    ]
    schema = forced_schema(tools, "required", parallel=False)
    assert "Unit" in schema["$defs"] and schema["maxItems"] == 1
    m = compiler.matcher(Spec(json=schema))
    assert m.accept_string('[{"name": "f", "parameters": {"unit": {"name": "c"}}}]')
    clash = dict(tools[0], function={"name": "g", "parameters": {"$defs": {"Unit": {}}}})
    with pytest.raises(ValueError, match="'Unit' differently"):
        forced_schema([tools[0], clash], "required", parallel=True)
