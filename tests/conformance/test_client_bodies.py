"""The bodies common clients send pass the strict field check (every field works
or sits at its no-op default), on `pdfleet serve` and through the gateway.

* guidellm's OpenAI HTTP backend (0.8): streamed, ``stream_options`` with
  ``include_usage`` and ``continuous_usage_stats``, a fixed output length as
  ``max_tokens`` (completions) or ``max_completion_tokens`` (chat) with
  ``stop: null`` and ``ignore_eos: true``. Sent as raw JSON, as guidellm does.
* the official ``openai`` client with the keyword arguments applications pass.
"""

from __future__ import annotations

import json

import httpx
from helpers.server import fleet_token

MODEL = "tiny"
USER = [{"role": "user", "content": "Tell me about the harbor at dawn."}]
STREAM_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def stream_events(target: str, path: str, body: dict) -> list[dict]:
    token = fleet_token()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    events = []
    with httpx.stream("POST", target + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_guidellm_bodies(target):
    """guidellm reads the streamed usage to count tokens: every chunk carries it,
    and ignore_eos makes the output exactly the length it asked for."""
    for path, prompt, cap in (
        ("/v1/completions", {"prompt": "Once upon a time"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER}, "max_completion_tokens"),
    ):
        body = {
            "model": MODEL,
            **prompt,
            "stream": True,
            "stream_options": STREAM_USAGE,
            cap: 8,
            "stop": None,
            "ignore_eos": True,
        }
        events = stream_events(target, path, body)
        assert all("usage" in e for e in events), path
        assert events[-1]["usage"]["completion_tokens"] == 8, path


def test_openai_client_common_kwargs(client):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=24,
        seed=5,
        user="tenant-1",
        n=1,
        stop=None,
        temperature=0.7,
        top_p=0.9,
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        store=False,
        service_tier="auto",
        metadata={},
        modalities=["text"],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    # Tools offered but not called (tool_choice "none"), one call at most.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=4,
        tools=[tool],
        tool_choice="none",
        parallel_tool_calls=False,
    )
    assert not chat.choices[0].message.tool_calls
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
