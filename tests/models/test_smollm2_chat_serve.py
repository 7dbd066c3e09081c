"""`pdfleet serve model.gguf` answers chat through the official openai client: the
GGUF's chat template in, the model's own stop token (<|im_end|>) out."""

from __future__ import annotations

import os

import pytest
from helpers.server import ServerProcess, fleet_token


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    gguf = os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))
    proc = ServerProcess(
        ["serve", gguf, "--served-model-name", "smollm2", "--max-model-len", "1024"],
        tmp_path_factory.mktemp("serve"),
        name="smollm2",
    )
    try:
        yield proc.wait_healthy(timeout=400)
    finally:
        proc.stop()


def test_chat_answer_stops_on_the_models_end_token_with_no_template_text(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=fleet_token(), timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=48,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    text = choice.message.content
    assert "Paris" in text
    for marker in ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "assistant\n"):
        assert marker not in text
    # The stop token is not counted as text but the answer is complete.
    assert reply.usage.completion_tokens < 48


def test_streamed_chat_ends_with_stop_and_the_same_text(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=fleet_token(), timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    whole = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=48
    )
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=48, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert streamed == whole.choices[0].message.content
    assert "<|im_end|>" not in streamed
