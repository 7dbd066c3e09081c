"""Structured outputs and tool calls through a real `pdfleet serve` process and the
official openai client, on the built-in random-weights model: whatever the
weights, the grammar makes every answer valid."""

from __future__ import annotations

import asyncio
import json
import re
from enum import StrEnum
from typing import Annotated, Literal

import httpx
import openai
import pytest
from helpers.server import ServerProcess, fleet_token
from helpers.tools import ASK, TOOLS, TOOLS_TEMPLATE, check_call, stream_calls
from pydantic import BaseModel, Field

MAX_LEN = 1024


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    template = tmp / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    proc = ServerProcess(
        [
            "serve",
            tiny_model,
            "--max-model-len",
            str(MAX_LEN),
            "--served-model-name",
            "tiny",
            "--disable-log-stats",
            "--chat-template",
            str(template),
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
        ],
        tmp,
    )
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=fleet_token(), max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def aclient(server):
    """Makes an async client: one per event loop (each test runs its own)."""
    return lambda: openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=fleet_token(), max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


# -- 20+ schemas, parsed by the openai client --------------------------------------

Short = Field(max_length=6)


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Flat(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: int = Field(ge=-50, le=50)
    y: int = Field(ge=-50, le=50)


class Segment(BaseModel):
    start: Point
    end: Point


class Tagged(BaseModel):
    tags: list[Color] = Field(max_length=3)


class WithEnum(BaseModel):
    color: Color
    ok: bool


class WithLiteral(BaseModel):
    mode: Literal["fast", "slow"]
    level: Literal[1, 2, 3]


class Bounded(BaseModel):
    ratio: float = Field(ge=0.0, le=1.0)
    count: int = Field(ge=10, le=20)


class Patterned(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")


class Phone(BaseModel):
    number: str = Field(pattern=r"^\+[0-9]{2} [0-9]{4}$")


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog


class MaybeNumber(BaseModel):
    value: int | None = Field(ge=0, le=9)


class StrOrInt(BaseModel):
    v: Annotated[str, Field(max_length=4)] | Annotated[int, Field(ge=0, le=99)]


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=2)

    model_config = {"json_schema_extra": {"additionalProperties": False}}


class Address(BaseModel):
    city: str = Short
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Short
    address: Address
    friends: list[str] = Field(max_length=2)


class Deep(BaseModel):
    class Inner(BaseModel):
        class Leaf(BaseModel):
            flag: bool

        leaf: Leaf
        n: int = Field(ge=0, le=5)

    inner: Inner


class Fixed(BaseModel):
    pair: tuple[int, bool]


class Items(BaseModel):
    ids: list[int] = Field(min_length=1, max_length=3)


class Order(BaseModel):
    item: Literal["tea", "coffee"]
    size: Color
    quantity: int = Field(ge=1, le=3)
    note: str | None = Field(max_length=5)


class Boolean(BaseModel):
    answer: bool


SCHEMAS = [
    Flat,
    Point,
    Segment,
    Tagged,
    WithEnum,
    WithLiteral,
    Bounded,
    Patterned,
    Phone,
    Pet,
    MaybeNumber,
    Matrix,
    Address,
    Person,
    Deep,
    Fixed,
    Items,
    Order,
    Boolean,
    StrOrInt,
]


def test_parse_returns_a_valid_instance_for_each_of_20_schemas(aclient):
    assert len(SCHEMAS) >= 20

    async def one(c, model):
        return await c.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": f"Give me a {model.__name__}."}],
            response_format=model,
            max_tokens=160,
            temperature=0,
        )

    async def run():
        async with aclient() as c:
            return await asyncio.gather(*(one(c, m) for m in SCHEMAS))

    results = asyncio.run(run())
    for model, r in zip(SCHEMAS, results, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), model.__name__
        # The text itself is the schema's JSON (parse() already validated it).
        model.model_validate_json(choice.message.content)


def test_vllm_regex_choice_and_grammar_fields(client):
    msg = [{"role": "user", "content": "Pick."}]
    r = client.chat.completions.create(
        model="tiny",
        messages=msg,
        max_tokens=12,
        extra_body={"guided_regex": r"[a-c]{3}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(
        model="tiny",
        messages=msg,
        max_tokens=12,
        extra_body={"guided_choice": ["left", "right", "up"]},
    )
    assert r.choices[0].message.content in ("left", "right", "up")
    r = client.completions.create(
        model="tiny",
        prompt="The answer is",
        max_tokens=12,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}},
    )
    assert r.choices[0].text in ("yes", "no", "maybe")
    r = client.completions.create(
        model="tiny",
        prompt="The answer is",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)


def test_json_object_and_json_schema_strict(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer."}],
        max_tokens=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    )
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON."}],
        max_tokens=3,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert text.startswith("{") and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "Unsupported type",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
            "uniqueItems",
        ),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_bad_schema_is_a_400_naming_the_problem(client, response_format, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            response_format=response_format,
        )
    assert needle in str(e.value)
    assert e.value.body["param"] and e.value.body["param"].startswith("response_format")


def test_bad_regex_and_grammar_are_400s_and_the_server_keeps_serving(client):
    for extra, needle, param in [
        ({"guided_regex": "[a-z"}, "regex", "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "grammar", "guided_grammar"),
        ({"guided_choice": []}, "guided_choice", "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one output", "guided_choice"),
        ({"structured_outputs": {"regex": "(a"}}, "regex", "structured_outputs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
        assert needle in str(e.value), extra
        assert e.value.body["param"] == param, extra
    r = client.completions.create(model="tiny", prompt="still here", max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_grammar_unsatisfiable_within_max_tokens_ends_with_length(client):
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=5,
        extra_body={"guided_regex": "a{40}"},
    )
    assert r.choices[0].finish_reason == "length"
    assert set(r.choices[0].text) <= {"a"}


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(aclient, client):
    prompts = [f"Story {i}: the river" for i in range(4)]
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]

    async def run():
        c = aclient()
        free = [
            c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
            for p in prompts
        ]
        constrained = [
            c.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=16,
                temperature=0,
                extra_body={"guided_regex": "[0-9]{10,20}"},
            )
            for p in prompts
        ]
        async with c:
            return await asyncio.gather(*free, *constrained)

    results = asyncio.run(run())
    assert [r.choices[0].text for r in results[:4]] == alone
    for r in results[4:]:
        assert r.choices[0].text.isdigit()


# -- tool calls --------------------------------------------------------------------


def test_named_tool_choice_always_returns_a_parsable_call(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    check_call(call, names=("get_weather",))


def test_required_tool_choice_without_parallel_calls_returns_one_call(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    check_call(call)


def test_streamed_required_tool_calls_arrive_as_id_name_then_argument_fragments(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    calls, finish = stream_calls(stream)
    assert finish == "tool_calls" and len(calls) == 1
    for c in calls.values():
        args = json.loads(c["arguments"])
        assert isinstance(args, dict)
        assert c["name"] in ("get_weather", "add")
    # Greedy: the same calls as non-streaming.
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls.values()
    ]


HERMES_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9]\}\}</tool_call>'


def test_auto_tool_choice_parses_hermes_calls_streaming_and_not(client):
    # The random model never writes a call by itself: a regex makes it write one
    # in the hermes format, which the auto parser must then find.
    kwargs = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=150,
        temperature=0,
        extra_body={"guided_regex": r"Sure\. " + HERMES_CALL},
    )
    r = client.chat.completions.create(**kwargs)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and 0 <= json.loads(call.function.arguments)["a"] <= 9
    calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("add", call.function.arguments)
    ]


def test_tool_choice_none_returns_text_and_auto_without_a_call_is_plain_content(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=30,
        extra_body={"guided_choice": ["No tools needed."]},
    )
    assert r.choices[0].message.content == "No tools needed."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_tool_results_round_trip_into_the_next_prompt(http):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees, sunny"},
    ]
    tok = http.post("/tokenize", json={"messages": messages}).json()
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "18 degrees, sunny [result of call_abc123]" in text
    # And a chat request carrying them is served.
    r = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text


def test_bad_tools_and_tool_choice_are_400s(client):
    cases = [
        (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "no tool named 'nope'",
        ),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kwargs)
        assert needle in str(e.value), kwargs
