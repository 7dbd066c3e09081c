"""vLLM's render routes and ``/tokenizer_info``, on `pdfleet serve` and through
the `pdfleet up` gateway (the shared fixtures of conftest.py).

A render answers what the generation route would run (the prompt's token ids
and the resolved sampling parameters) without generating: its token ids are
the ones ``/tokenize`` gives, and its bad input is the generation route's 400.
"""

from __future__ import annotations

import json

import httpx
from helpers.server import fleet_token

MODEL = "tiny"
DEFAULT_MAX_TOKENS = 24  # the servers' generation-config default (conftest.py)
USER = [{"role": "user", "content": "Tell me about the harbor at dawn."}]


def post(target: str, path: str, body: dict) -> httpx.Response:
    token = fleet_token()
    return httpx.post(
        target + path,
        json=body,
        headers={"authorization": f"Bearer {token}"} if token else {},
        timeout=60,
    )


def tokens(target: str, body: dict) -> list[int]:
    r = post(target, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_completions_render(target):
    r = post(
        target,
        "/v1/completions/render",
        {
            "model": MODEL,
            "prompt": ["Once upon a time", "The harbor"],
            "max_tokens": 5,
            "temperature": 0.5,
            "stop": ["\n"],
            "logit_bias": {"9": 3},
            "cache_salt": "tenant-a",
        },
    )
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, list) and len(rendered) == 2  # one per prompt
    first, second = rendered
    assert first["token_ids"] == tokens(target, {"model": MODEL, "prompt": "Once upon a time"})
    assert second["token_ids"] == tokens(target, {"model": MODEL, "prompt": "The harbor"})
    assert first["request_id"].startswith("cmpl-") and first["request_id"] != second["request_id"]
    params = first["sampling_params"]
    assert params["max_tokens"] == 5 and params["temperature"] == 0.5
    assert params["stop"] == ["\n"] and params["logit_bias"] == {"9": 3.0}
    assert first["cache_salt"] == "tenant-a" and first["model"] == MODEL
    assert first["stream"] is False
    # Without max_tokens: OpenAI's completions default (16), as generating would use.
    r = post(target, "/v1/completions/render", {"model": MODEL, "prompt": "Once"})
    assert r.json()[0]["sampling_params"]["max_tokens"] == 16


def test_chat_completions_render(target, serve_url):
    r = post(
        target,
        "/v1/chat/completions/render",
        {"model": MODEL, "messages": USER, "max_completion_tokens": 7, "seed": 3},
    )
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, dict)  # one conversation: one rendered prompt
    assert rendered["token_ids"] == tokens(target, {"model": MODEL, "messages": USER})
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 7
    assert rendered["sampling_params"]["seed"] == 3
    # Without max_tokens: the generation config's default (conftest.py), not the context.
    r = post(target, "/v1/chat/completions/render", {"model": MODEL, "messages": USER})
    assert r.json()["sampling_params"]["max_tokens"] == DEFAULT_MAX_TOKENS
    # kv_transfer_params are internal: an engine returns what its internal caller
    # sent (the render is what would run); the gateway drops a client's.
    kv = {"do_remote_decode": True}
    r = post(
        target,
        "/v1/chat/completions/render",
        {"model": MODEL, "messages": USER, "kv_transfer_params": kv},
    )
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"] == (kv if target == serve_url else None)
    # The same key JSON-escaped names the same field: the gateway drops it too.
    token = fleet_token()
    escaped = json.dumps({"model": MODEL, "messages": USER}).rstrip("}")
    escaped += ', "kv_transfer_param\\u0073": ' + json.dumps(kv) + "}"
    r = httpx.post(
        target + "/v1/chat/completions/render",
        content=escaped.encode(),
        headers={"content-type": "application/json"}
        | ({"authorization": f"Bearer {token}"} if token else {}),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"] == (kv if target == serve_url else None)
    # A grammar is rendered as the constraint it is.
    r = post(
        target,
        "/v1/chat/completions/render",
        {"model": MODEL, "messages": USER, "structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["sampling_params"]["structured_outputs"] == {"choice": ["yes", "no"]}


def test_render_refuses_what_generation_refuses(target):
    """The same checks as the generation routes: unknown and refused fields,
    the context bound, logprob bounds and an unknown model."""
    cases = [
        ("/v1/completions/render", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions/render", {"messages": USER, "no_such_field": 1}, "no_such_field"),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
        ("/v1/completions/render", {"prompt": "x", "logprobs": 10**6}, "logprobs"),
    ]
    for path, body, param in cases:
        r = post(target, path, {"model": MODEL, **body})
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = post(target, "/v1/chat/completions/render", {"model": "gpt-9", "messages": USER})
    assert r.status_code == 404, r.text


def test_tokenizer_info(target, serve_url):
    token = fleet_token()
    r = httpx.get(
        target + "/tokenizer_info",
        headers={"authorization": f"Bearer {token}"} if token else {},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"]
    assert "chat_template" in info  # the template chat requests are rendered with
    # Settings that name the server's files are not shown.
    assert not any(k.endswith("_file") or k == "name_or_path" for k in info)
    # Behind the engine's credentials like every route (the suite's gateway has no keys).
    if token:
        assert httpx.get(serve_url + "/tokenizer_info", timeout=30).status_code == 401
