"""pdfleet's OpenAI API, as vLLM serves it, with the official `openai` client:
each case runs against `pdfleet serve` and through a `pdfleet up` P/D gateway
(fixtures in conftest.py: one server and one fleet for the whole suite).

Written from vLLM's documented behaviour and OpenAI's API reference.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from helpers.server import fleet_token

MODEL = "tiny"
# The servers' generation-config default (conftest.py starts them with it).
DEFAULT_MAX_TOKENS = 24
USER = [{"role": "user", "content": "Tell me about the harbor at dawn."}]
IDS = list(range(100, 160))  # a token-id prompt (the tiny vocabulary has over 1000 ids)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


def refused(call, param: str) -> str:
    """Run ``call``: it must be a 400 naming ``param``; its message."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    assert isinstance(err, dict), e.value
    assert err.get("param") == param, err
    assert e.value.status_code == 400
    return err["message"]


def headers() -> dict[str, str]:
    token = fleet_token()
    return {"authorization": f"Bearer {token}"} if token else {}


# -- completions and chat ----------------------------------------------------------


def test_completion_and_chat_basics(client):
    c = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, seed=1, top_p=0.9
    )
    assert c.object == "text_completion" and c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.completion_tokens <= 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, seed=1, top_p=0.9
    )
    assert again.choices[0].text == c.choices[0].text  # seed: reproducible
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"


def test_sampling_fields_are_read(client):
    """top_k 1 and min_p 1 leave only the most likely token (greedy); min_tokens
    holds EOS off; penalties, priority, user and skip_special_tokens are taken."""
    greedy = client.completions.create(model=MODEL, prompt=IDS, max_tokens=6, temperature=0)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        c = client.completions.create(
            model=MODEL, prompt=IDS, max_tokens=6, temperature=1.0, seed=7, extra_body=extra
        )
        assert c.choices[0].text == greedy.choices[0].text, extra
    c = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="tenant-7",
        extra_body={
            "min_tokens": 8,
            "repetition_penalty": 1.3,
            "priority": 0,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        },
    )
    assert c.usage.completion_tokens == 8
    # A priority is honoured only by an engine scheduling by priority (vLLM's rule);
    # through the gateway a client's own is refused unless its tenant may set one
    # (docs/flow-control.md). Either way a 400 naming the field.
    message = refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 1}
        ),
        "priority",
    )
    assert "--scheduling-policy priority" in message or "may not set a request priority" in message


def test_streamed_n_sends_each_finish_once(client):
    """Each choice ends with exactly one finish_reason (not one per later step)."""
    stream = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=12, n=3, stream=True, temperature=1.0, seed=3
    )
    finishes: dict[int, int] = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=9, n=2, stream=True, seed=4
    )
    finishes = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert finishes == {0: 1, 1: 1}


def test_generation_config_max_tokens_is_the_default(client):
    """Without max_tokens the generation config's max_new_tokens bounds the output
    (not what the context leaves); it also caps a larger max_tokens."""
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert chat.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=100, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS
    small = client.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert small.usage.completion_tokens == 3


def test_stop_and_stop_token_ids(client):
    free = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    first = free.choices[0].text
    stopped = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tid = stopped.choices[0].token_ids[2]
    cut = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [tid], "return_token_ids": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == tid
    assert cut.choices[0].token_ids[-1] == tid
    if len(first) > 3:
        stop = first[1:3]
        s = client.completions.create(
            model=MODEL, prompt=IDS, max_tokens=8, temperature=0, stop=[stop]
        )
        assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop"


# -- usage and stream options -------------------------------------------------------


def test_continuous_usage_is_per_choice_with_n_and_batched_prompts(client):
    """vLLM's per-chunk usage: the chunk's own prompt's tokens and the tokens
    its own choice has generated so far (never the request's sums)."""
    cont = {"include_usage": True, "continuous_usage_stats": True}
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=3,
            stream=True,
            stream_options=cont,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    so_far: dict[int, int] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        so_far[choice.index] = so_far.get(choice.index, 0) + len(choice.token_ids)
        assert c.usage.prompt_tokens == len(prompts[choice.index // 2]), c
        assert c.usage.completion_tokens == so_far[choice.index], c
    assert sorted(so_far.values()) == [3, 3, 3, 3]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 3 + 7  # each prompt once, whatever n
    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            n=2,
            max_tokens=3,
            stream=True,
            stream_options=cont,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    chat_so_far: dict[int, int] = {}
    for c in chat[:-1]:
        (choice,) = c.choices
        chat_so_far[choice.index] = chat_so_far.get(choice.index, 0) + len(
            choice.model_extra.get("token_ids") or []
        )
        assert c.usage.completion_tokens == chat_so_far[choice.index], c
        assert c.usage.prompt_tokens == chat[-1].usage.prompt_tokens
    assert chat[-1].usage.completion_tokens == 6


def test_stream_options_usage_and_continuous_usage_stats(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Once",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in chat)
    assert chat[-1].usage.completion_tokens == 4
    plain = list(
        client.completions.create(
            model=MODEL,
            prompt="Once",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


# -- logprobs -------------------------------------------------------------------------


def test_completion_logprobs_forms(client):
    zero = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=4, logprobs=0, extra_body={"ignore_eos": True}
    )
    lp = zero.choices[0].logprobs
    assert len(lp.tokens) == 4
    # logprobs 0: one entry, the sampled token.
    assert all(len(t) == 1 for t in lp.top_logprobs)
    assert [next(iter(t)) for t in lp.top_logprobs] == lp.tokens
    three = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=3, logprobs=3, extra_body={"ignore_eos": True}
    )
    assert all(3 <= len(t) <= 4 for t in three.choices[0].logprobs.top_logprobs)
    echo = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=2,
        logprobs=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(IDS) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    as_ids = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=2,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    c = as_ids.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]


def test_chat_logprobs_and_top_logprobs_bounds(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(x.top_logprobs) == 2 for x in content)
    message = refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=3, logprobs=True, top_logprobs=-1
        ),
        "top_logprobs",
    )
    # Names what was sent (-1: the whole vocabulary) and the bound, never a
    # number the client did not send.
    assert message.startswith("top_logprobs: -1 asks for the whole vocabulary"), message
    assert "max_logprobs (20)" in message and "got" not in message
    message = refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=3, logprobs=True, top_logprobs=21
        ),
        "top_logprobs",
    )
    assert "0..20" in message and message.endswith("got 21"), message


def test_prompt_logprobs(client):
    """vLLM's prompt_logprobs: per prompt token (None first), keyed by token id,
    the actual token always among them; on both routes; -1 bounded by max_logprobs."""
    c = client.completions.create(
        model=MODEL, prompt=IDS[:12], max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    plp = c.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == 12 and plp[0] is None
    for tid, entry in zip(IDS[1:12], plp[1:], strict=True):
        assert str(tid) in entry and 2 <= len(entry) <= 3
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in plp[1:])
    for value in (-1, 21):
        message = refused(
            lambda v=value: client.completions.create(
                model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": v}
            ),
            "prompt_logprobs",
        )
        assert "max_logprobs" in message and "20" in message
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        ),
        "prompt_logprobs",
    )


# -- token ids, truncation, logit_bias ---------------------------------------------------


def test_return_token_ids(client):
    c = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=4, extra_body={"return_token_ids": True}
    )
    choice = c.choices[0]
    assert choice.prompt_token_ids == IDS
    assert len(choice.token_ids) == c.usage.completion_tokens
    streamed_ids: list[int] = []
    prompt_ids = []
    for chunk in client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=4,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ):
        for ch in chunk.choices:
            streamed_ids += ch.token_ids or []
            if getattr(ch, "prompt_token_ids", None):
                prompt_ids.append(ch.prompt_token_ids)
    assert len(streamed_ids) == 4 and prompt_ids == [IDS]
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, extra_body={"return_token_ids": True}
    )
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens


def test_truncate_prompt_tokens(client):
    left = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True},
    )
    assert left.usage.prompt_tokens == 10 and left.choices[0].prompt_token_ids == IDS[-10:]
    right = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=1,
        extra_body={
            "truncate_prompt_tokens": 10,
            "truncation_side": "right",
            "return_token_ids": True,
        },
    )
    assert right.choices[0].prompt_token_ids == IDS[:10]
    # A prompt longer than the context fits once truncated to it.
    long = client.completions.create(
        model=MODEL,
        prompt=list(range(100, 700)),
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 100},
    )
    assert long.usage.prompt_tokens == 100
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5


def test_logit_bias(client):
    """A +100 bias makes greedy sampling pick that token; out-of-vocabulary ids
    are 400s naming logit_bias and the bound."""
    c = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=4,
        temperature=0,
        logit_bias={"777": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert c.choices[0].token_ids == [777] * 4
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=3,
        temperature=0,
        logit_bias={"555": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert chat.choices[0].token_ids == [555] * 3
    message = refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, logit_bias={"4096": 1}
        ),
        "logit_bias",
    )
    assert re.search(r"must be < \d+", message), message
    # A bias past +-100 is clamped to it (vLLM's behaviour), not refused.
    clamped = client.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=2,
        temperature=0,
        logit_bias={"777": 1e6},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert clamped.choices[0].token_ids == [777] * 2


# Bad logit_bias keys and values: the same message on the engine and the gateway.
BAD_BIAS = [
    ({"abc": 1}, "logit_bias: key 'abc' is not a token id"),
    ({"-1": 1}, "logit_bias: token id '-1' is outside the model's vocabulary (must be >= 0)"),
    ({"4096": 1}, "logit_bias: token id '4096' is outside the model's vocabulary (must be < "),
    ({"7": "x"}, "logit_bias: the bias of token 7 must be a number, got 'x'"),
]


@pytest.mark.parametrize(("bias", "message"), BAD_BIAS)
def test_a_bad_logit_bias_is_worded_alike_on_engine_and_gateway(
    serve_url, fleet_url, bias, message
):
    got = []
    for url in (serve_url, fleet_url):
        r = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": bias},
            headers=headers(),
            timeout=30,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and err["message"].startswith(message), err
        got.append(err["message"])
    assert got[0] == got[1]


# -- chat specifics ----------------------------------------------------------------------------


def test_chat_echo_custom_roles_and_prompt_text(client):
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert chat.choices[0].message.content.startswith("Once upon")
    streamed = ""
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        stream=True,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    ):
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
    assert streamed.startswith("Once upon")
    # The echoed message has no sampled logprobs: echo with logprobs is a 400
    # naming echo (streamed or not), never logprobs silently missing.
    for stream in (False, True):
        message = refused(
            lambda stream=stream: client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=3,
                logprobs=True,
                stream=stream,
                extra_body={
                    "echo": True,
                    "continue_final_message": True,
                    "add_generation_prompt": False,
                },
            ),
            "echo",
        )
        assert "logprobs" in message and "prompt_logprobs" in message
    # Echo with nothing to echo (the last message is the user's) leaves logprobs alone.
    plain = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, logprobs=True, extra_body={"echo": True}
    )
    assert plain.choices[0].logprobs is not None
    custom = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "narrator", "content": "The sea was calm."}, *USER],
        max_tokens=2,
        extra_body={"return_prompt_text": True},
    )
    assert "<|im_start|>narrator" in custom.model_extra["prompt_text"]


def test_named_tool_choice_cut_by_max_tokens_returns_no_call(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=3,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls


PING = {
    "type": "function",
    "function": {
        "name": "p",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def test_required_tool_choice_cut_by_max_tokens_returns_no_call(client):
    """``required`` writes a JSON array of calls; cut off before the array
    closes, the whole response is no tool call (finish_reason ``length``), even
    when some items of the array are complete. Streamed, the calls go out as
    they are written (vLLM's streaming): names once complete, arguments as
    fragments, so a cut-off stream may end inside a call's arguments."""
    kw = dict(model=MODEL, messages=USER, tools=[PING], tool_choice="required", temperature=0)
    seen_complete_item = False
    for limit in (20, 21, 22, 23, 24):
        choice = client.chat.completions.create(**kw, max_tokens=limit).choices[0]
        if choice.finish_reason != "length":
            continue
        assert not choice.message.tool_calls, (limit, choice)
        seen_complete_item |= '"p"' in (choice.message.content or "") and "}}" in (
            choice.message.content or ""
        )
        streamed = list(client.chat.completions.create(**kw, max_tokens=limit, stream=True))
        deltas = [c.choices[0] for c in streamed if c.choices]
        assert deltas[-1].finish_reason == "length"
        for d in deltas:
            for call in d.delta.tool_calls or []:
                if call.function and call.function.name is not None:
                    assert call.function.name == "p"
    assert seen_complete_item  # the cut-off kept a complete item out of tool_calls


def test_guided_choice_and_response_format(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert chat.choices[0].message.content in ("yes", "no")
    refused(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=8,
            extra_body={"guided_choice": ["a"], "guided_decoding_backend": "outlines"},
        ),
        "guided_decoding_backend",
    )
    ok = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=8,
        extra_body={"guided_regex": "[ab]{3}", "guided_decoding_backend": "xgrammar"},
    )
    assert len(ok.choices[0].text) == 3 and set(ok.choices[0].text) <= {"a", "b"}


# -- refusals and errors --------------------------------------------------------------------


def test_refused_and_unknown_fields_are_400s_naming_them(client):
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"use_beam_search": True}
        ),
        "use_beam_search",
    )
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, extra_body={"min_characters": 5}
        ),
        "min_characters",
    )
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, extra_body={"frobnicate": 1}
        ),
        "frobnicate",
    )
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, n=2, extra_body={"best_of": 3}
        ),
        "best_of",
    )
    # Inert values of refused fields pass (what clients send by default).
    client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=1,
        extra_body={"use_beam_search": False, "length_penalty": 1.0, "bad_words": []},
    )


def test_error_shape_and_unknown_routes(target):
    for method, path, status in (
        ("GET", "/v1/no-such-route", 404),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/models/no-such-model", 404),
        # A trailing slash is another (unknown) route, never a redirect.
        ("POST", "/v1/chat/completions/", 404),
        ("GET", "/v1/models/", 404),
    ):
        r = httpx.request(method, target + path, headers=headers(), timeout=30)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    r = httpx.post(
        target + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "temperature": -1},
        headers=headers(),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert ">= 0" in r.json()["error"]["message"]


# -- models and tokenizer routes -----------------------------------------------------------


def test_models_and_tokenizer_routes(client, target):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    r = httpx.post(
        target + "/tokenize",
        json={"model": MODEL, "prompt": "Once upon a time", "return_token_strs": True},
        headers=headers(),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    d = httpx.post(
        target + "/detokenize",
        json={"model": MODEL, "tokens": body["tokens"]},
        headers=headers(),
        timeout=30,
    )
    assert d.status_code == 200 and "Once upon a time" in d.json()["prompt"]
    chat = httpx.post(
        target + "/tokenize",
        json={"model": MODEL, "messages": USER, "chat_template_kwargs": {"x": 1}},
        headers=headers(),
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    bad = httpx.post(
        target + "/tokenize",
        json={"model": MODEL, "prompt": "x", "use_beam_search": True},
        headers=headers(),
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def test_request_id_names_the_response(client):
    c = client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"request_id": "abc-123"}
    )
    assert c.id == "cmpl-abc-123"


def test_cache_salt_separates_prefix_caches(serve_url):
    """Equal prompts share cached blocks only under the same salt (engine-level:
    in the P/D fleet `cached_tokens` of the decode engine counts the KV it
    pulled, whatever the salt; the gateway's index is unit-tested)."""
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key=fleet_token() or "none")
    prompt = list(range(300, 364))

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return c.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": ""}
        ),
        "cache_salt",
    )


def test_json_body_fields_pass_the_gateway_unchanged(target):
    """spaces_between_special_tokens, add_special_tokens, documents and
    chat_template_kwargs are read (documents reach the template; a reserved
    template argument is refused)."""
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 1,
        "documents": [{"title": "t", "text": "x"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "spaces_between_special_tokens": False,
    }
    r = httpx.post(target + "/v1/chat/completions", json=body, headers=headers(), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(
        target + "/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"add_generation_prompt": False}},
        headers=headers(),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    plain = httpx.post(
        target + "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 1, "return_token_ids": True},
        headers=headers(),
        timeout=60,
    ).json()
    bare = httpx.post(
        target + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Once",
            "max_tokens": 1,
            "return_token_ids": True,
            "add_special_tokens": False,
        },
        headers=headers(),
        timeout=60,
    ).json()
    assert len(plain["choices"][0]["prompt_token_ids"]) == (
        len(bare["choices"][0]["prompt_token_ids"]) + 1
    ), json.dumps([plain, bare])


def test_invocations_routes_by_body(target):
    """SageMaker's /invocations: a chat body is a chat completion, a prompt a
    completion; anything else a 400."""
    chat = httpx.post(
        target + "/invocations",
        json={"model": MODEL, "messages": USER, "max_tokens": 2},
        headers=headers(),
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    completion = httpx.post(
        target + "/invocations",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 2},
        headers=headers(),
        timeout=60,
    )
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    bad = httpx.post(
        target + "/invocations",
        json={"model": MODEL, "prompt": "x", "use_beam_search": True},
        headers=headers(),
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def test_explicit_null_of_an_optional_field_means_its_default(target):
    """vLLM types these Optional: ``null`` is their default, not a 400 (fields
    vLLM does not type Optional still refuse ``null``)."""
    chat = httpx.post(
        target + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": USER,
            "max_tokens": 2,
            "n": None,
            "stream": None,
            "logprobs": None,
            "parallel_tool_calls": None,
        },
        headers=headers(),
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    completion = httpx.post(
        target + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": None, "echo": None},
        headers=headers(),
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"
    bad = httpx.post(
        target + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 2, "include_reasoning": None},
        headers=headers(),
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include_reasoning"


NESTED_UNKNOWN = [
    ({"response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "bogus": 1},
            }
        },
        "response_format.json_schema.bogus",
    ),
    ({"messages": [{"role": "user", "content": "hi", "bogus_key": 1}]}, "messages.0.bogus_key"),
    ({"messages": [{"role": "user", "content": "hi", "refusal": "no"}]}, "messages.0.refusal"),
]


@pytest.mark.parametrize(("extra", "path"), NESTED_UNKNOWN)
def test_an_unknown_nested_key_is_refused_by_its_path(target, extra, path):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **extra}
    r = httpx.post(target + "/v1/chat/completions", json=body, headers=headers(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == path and path in err["message"], err


def test_what_clients_send_in_messages_passes(client):
    """The keys of the official client's message types, and an assistant
    message sent back as a response gave it (null refusal, audio,
    function_call, annotations; its reasoning), all pass."""
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    echoed = first.choices[0].message.model_dump()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "Be brief.", "name": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        echoed,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "refusal": None,
            "audio": None,
            "function_call": None,
            "reasoning_content": "thought",
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "and?"},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
