"""The reasoning parsers split ``<think>…</think>`` from the answer as vLLM's do,
whole and streamed token by token (the streamed pieces add up to the whole)."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.server import fleet_token

from pdfleet.engine.entrypoints.openai.reasoning_parsers import (
    ReasoningStream,
    get_reasoning_parser,
    prompt_opens_thought,
)

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # thinking off: all answer
    ("qwen3", "<think>cut off while thin", "cut off while thin", ""),
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_whole(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser is not None
    assert parser.split(text, final=True) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_deltas_add_up_to_the_whole(name, text, reasoning, content, step):
    parser = get_reasoning_parser(name)
    assert parser is not None
    stream = ReasoningStream(parser)
    got_r, got_c = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        got_r += r
        got_c += c
        # No piece of the tags themselves ever leaks into either stream.
        assert "</think" not in got_r and "<think" not in got_c
    assert (got_r, got_c) == (reasoning, content)


def test_unknown_parser_is_refused():
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("granite")


OPENED = [
    # (parser, output after a prompt that left "<think>" open, reasoning, content)
    ("qwen3", "cats are nice</think>The answer is 4.", "cats are nice", "The answer is 4."),
    ("qwen3", "cut off while thin", "cut off while thin", ""),
    ("qwen3", "a</thin", "a</thin", ""),  # a cut-off tag is text
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), OPENED)
@pytest.mark.parametrize("step", [0, 1, 3])
def test_a_thought_the_prompt_opened_is_reasoning_streamed_or_not(
    name, text, reasoning, content, step
):
    """The prompt's ``<think>`` (a template's, or an assistant prefill's) makes
    what comes before ``</think>`` reasoning, whole and streamed alike: the
    stream never sends it as content first."""
    parser = get_reasoning_parser(name)
    assert parser is not None
    assert parser.split(text, final=True, opened=True) == (reasoning, content)
    if step == 0:
        return
    stream = ReasoningStream(parser, opened=True)
    got_r, got_c = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        got_r += r
        got_c += c
        assert content.startswith(got_c)  # no reasoning ever streams as content
    assert (got_r, got_c) == (reasoning, content)


def test_prompt_opens_thought():
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_thought("x<think>cats")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thought("plain prompt")


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=_headers(),
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [x[len("data: ") :] for x in r.iter_lines() if x.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def _headers() -> dict[str, str]:
    token = fleet_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


# An assistant prefill that opens a thought: the output continues it.
PREFILLED = {
    "model": "tiny",
    "messages": [
        {"role": "user", "content": "Think, then answer."},
        {"role": "assistant", "content": "<think>cats"},
    ],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "max_tokens": 6,
    "temperature": 0,
    "return_token_ids": True,
}


@pytest.mark.parametrize("include", [True, False])
def test_streamed_reasoning_matches_the_whole_and_carries_every_token_id(serve_url, include):
    """On the engine served with ``--reasoning-parser qwen3``: the output after
    an opened ``<think>`` is reasoning in the whole response and in the stream
    (never content first, never sent twice), ``include_reasoning: false`` drops
    it from both, and the streamed chunks carry every generated token id."""
    body = {**PREFILLED, "include_reasoning": include}
    whole = httpx.post(
        serve_url + "/v1/chat/completions", json=body, headers=_headers(), timeout=60
    )
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    message = choice["message"]
    chunks = [c["choices"][0] for c in _stream(serve_url, body) if c["choices"]]
    streamed_r = "".join(c["delta"].get("reasoning") or "" for c in chunks)
    streamed_c = "".join(c["delta"].get("content") or "" for c in chunks)
    assert streamed_c == (message["content"] or "")
    assert streamed_r == (message.get("reasoning") or "")
    if include:
        assert message["reasoning"] == message["reasoning_content"]
    else:
        assert "reasoning" not in message and streamed_r == ""
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert len(choice["token_ids"]) == 6
