"""Constrained requests and tool calls through the P/D gateway (real NIXL
connector in host memory): the prefill leg samples its token under the grammar,
the decode engine rebuilds the matcher, and greedy output equals aggregated."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.fleet import kv_transfer_args, metric, start_engines, start_gateway
from helpers.server import fleet_token, wait_until
from helpers.tools import ASK, TOOLS, TOOLS_TEMPLATE, check_call, stream_calls

# Long enough that the Conditional gateway disaggregates it (min-prompt-tokens below).
LONG = (
    "The harbor was quiet before dawn, and the fishing boats rocked gently against the "
    "old wooden pier while gulls circled overhead waiting for the first catch of the day. "
)
MIN_PROMPT_TOKENS = 32
DECISIONS = "pdfleet_gateway_disagg_decisions_total"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "temp", "sky"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("structured-fleet")
    template = log_dir / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    tool_flags = [
        "--chat-template",
        str(template),
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
    ]
    prefill, decode = start_engines(
        tiny_model,
        log_dir,
        ["prefill", "decode"],
        extra=tool_flags,
        per_engine=[
            kv_transfer_args("NixlConnector", "kv_producer"),
            kv_transfer_args("NixlConnector", "kv_consumer"),
        ],
    )
    common = ["--prefill", prefill.url, "--decode", decode.url, "--scrape-interval", "0.2"]
    gateways = {}
    try:
        gateways["always"] = start_gateway([*common, "--disaggregation-mode", "Always"], log_dir)
        gateways["conditional"] = start_gateway(
            [
                *common,
                "--disaggregation-mode",
                "Conditional",
                "--min-prompt-tokens",
                str(MIN_PROMPT_TOKENS),
                "--tokenizer",
                tiny_model,
            ],
            log_dir,
        )
        yield prefill, decode, gateways
    finally:
        for g in gateways.values():
            g.stop()
        prefill.stop()
        decode.stop()


def client_for(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def constrained(client: openai.OpenAI, content: str, stream: bool) -> str:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    )
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_constrained_output_through_always_gateway_equals_aggregated(fleet, stream):
    _, decode, gateways = fleet
    direct = client_for(decode.url, fleet_token() or "none")
    via = client_for(gateways["always"].url)
    transfers0 = metric(decode.url, "pdfleet_engine_kv_transfers_total")
    legs0 = metric(gateways["always"].url, DECISIONS, decision="prefill_decode")
    # A fresh long prompt per case: no engine caches its prefix yet, so its KV moves.
    for content in ("Weather?", f"Case {stream}. {LONG} Weather?"):
        out = constrained(via, content, stream)
        assert out == constrained(direct, content, False)
        data = json.loads(out)
        assert set(data) == {"city", "temp", "sky"} and -40 <= data["temp"] <= 50
    # Both went through the prefill engine; the long one's KV moved over the connector.
    assert metric(gateways["always"].url, DECISIONS, decision="prefill_decode") == legs0 + 2
    assert wait_until(
        lambda: metric(decode.url, "pdfleet_engine_kv_transfers_total") >= transfers0 + 1, 10
    )


@pytest.mark.parametrize("mode", ["always", "conditional"])
def test_tool_calls_through_the_gateway_streaming_and_not(fleet, mode):
    _, decode, gateways = fleet
    client = client_for(gateways[mode].url)
    direct = client_for(decode.url, fleet_token() or "none")
    for messages in (ASK, [{"role": "user", "content": LONG + " Weather in Paris?"}]):
        kw = dict(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        r = client.chat.completions.create(**kw)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        check_call(call)
        ref = direct.chat.completions.create(**kw).choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == (
            ref.function.name,
            ref.function.arguments,
        )
        calls, finish = stream_calls(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (call.function.name, call.function.arguments)
        ]


def test_gateway_refuses_bad_response_format_before_any_engine(fleet):
    gateways = fleet[2]
    client = client_for(gateways["always"].url)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    assert "response_format.json_schema.schema" in str(e.value)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    # A schema only the engine can judge: the prefill engine's 400 reaches the client.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            },
        )
    assert "Unsupported type" in str(e.value)
