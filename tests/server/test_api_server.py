"""A real `pdfleet serve` process driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import httpx
import openai
import pytest
from helpers.server import ServerProcess, fleet_token, scrape, stop_all, wait_until
from prometheus_client.parser import text_string_to_metric_families

from pdfleet.engine import LLM, SamplingParams

MAX_LEN = 512


# The engines of this module: the shared one, and one each for the tests that
# fill its queue, authenticate with their own key or stop it. They start side by
# side (one engine's start is mostly waiting on one core); each is used by one
# test, or by the shared fixtures only.
ENGINES = {
    "server": [
        "--max-model-len",
        str(MAX_LEN),
        "--served-model-name",
        "tiny",
        "--disable-log-stats",
    ],
    "queue-503": [
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--api-key",
        "sekret",
    ],
    "queue-burst": [
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
    ],
    "sigterm": ["--max-model-len", "512", "--shutdown-timeout", "60"],
}


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """Name -> its ServerProcess, started (not yet waited on)."""
    logs = tmp_path_factory.mktemp("server")
    procs = {
        name: ServerProcess(["serve", tiny_model, *args], logs, name)
        for name, args in ENGINES.items()
    }
    try:
        yield procs
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def server(engines):
    return engines["server"].wait_healthy()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=fleet_token(), max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def http(server):
    """httpx against the engine with the fleet token (as the gateway calls it)."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, max_model_len=MAX_LEN)


PROMPT = "The harbor was quiet before dawn."


def test_models_health_and_tokenize(http, server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http.get("/health").json() == {"status": "ok"}
    tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_LEN
    detok = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"].endswith("hello world")
    chat_tok = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 3


def test_greedy_completion_equals_offline_generate(client, offline):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    (ref,) = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_chat_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    (ref,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streaming_completion_matches_non_streaming_with_usage(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streaming_chat_n2_stop_logprobs_seed(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=12,
        temperature=1.0,
        seed=11,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in whole.choices] == [c.message.content for c in again.choices]
    assert {c.index for c in whole.choices} == {0, 1}
    # One logprobs entry per generated token of each choice.
    assert sum(len(c.logprobs.content) for c in whole.choices) == whole.usage.completion_tokens
    for c in whole.choices:
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.logprobs.content) == kw["max_tokens"]
        assert c.logprobs.content and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens
    # stop: the text ends before the stop string
    base = whole.choices[0].message.content
    stop = next(
        (
            base[i : i + 2]
            for i in range(3, len(base) - 2)
            if base[i : i + 2].strip() and "\ufffd" not in base[i : i + 2]
        ),
        None,
    )
    if stop is not None:
        cut = client.chat.completions.create(
            **{**kw, "n": 1, "logprobs": False, "top_logprobs": None}, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert stop not in cut.choices[0].message.content


def test_completion_logprobs_echo_and_token_prompts(client, offline):
    tok = offline.get_tokenizer()
    ids = tok(PROMPT).input_ids
    out = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 5
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith(tok.decode(ids))
    batch = client.completions.create(
        model="tiny", prompt=[ids, ids[:5]], max_tokens=3, temperature=0, n=2
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(ids) + 5


def test_cached_tokens_are_reported(client):
    long_prompt = PROMPT * 8
    client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    out = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16


def test_async_client_32_concurrent_streams(server):
    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=fleet_token(), max_retries=0, timeout=120
        )

        async def one(i: int):
            n_tok, usage, text = 0, None, ""
            stream = await aclient.completions.create(
                model="tiny",
                prompt=f"Request number {i}:",
                max_tokens=10 + i % 7,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                usage = chunk.usage or usage
            n_tok = usage.completion_tokens
            return i, n_tok, usage

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 300)
        await aclient.close()
        return results

    for i, n_tok, usage in asyncio.run(main()):
        assert n_tok == 10 + i % 7
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_client_disconnect_aborts_and_frees_blocks(http, server):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert scrape(server.url)["pdfleet_engine_num_requests_running"] == 1
    # The connection is closed: the request is aborted at once and its blocks freed.
    assert wait_until(lambda: scrape(server.url)["pdfleet_engine_num_requests_running"] == 0, 10)
    assert scrape(server.url)["pdfleet_engine_kv_cache_usage_ratio"] == 0.0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -2}, 400, "temperature"),
        ({"prompt": "x", "top_p": 7}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ({"prompt": "word " * 2000}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [99999999]}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": "x"}}, 400, "logit_bias"),
        ({"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
        ({"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ],
)
def test_bad_completion_requests_get_openai_shaped_4xx(http, server, body, status, param):
    r = http.post("/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param and err["message"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": []}, 400),
        ({"messages": [{"role": "", "content": "x"}]}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
        ({"messages": "hello"}, 400),
    ],
)
def test_bad_chat_requests(http, server, body, status):
    r = http.post("/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status


def test_invalid_json_and_the_server_keeps_serving(http, server, client):
    r = http.post(
        "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-5)
    assert client.completions.create(model="tiny", prompt="still alive", max_tokens=2).choices


def test_metrics_parse_and_hold_both_name_sets(http, server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)

    text = http.get("/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "pdfleet_engine_num_requests_running",
        "pdfleet_engine_num_requests_waiting",
        "pdfleet_engine_kv_cache_usage_ratio",
        "pdfleet_engine_prefix_cache_queries_total",
        "pdfleet_engine_prefix_cache_hits_total",
        "pdfleet_engine_num_preemptions_total",
        "pdfleet_engine_prompt_tokens_total",
        "pdfleet_engine_generation_tokens_total",
        "pdfleet_engine_time_to_first_token_seconds_count",
        "pdfleet_engine_inter_token_latency_seconds_count",
        "pdfleet_engine_e2e_request_latency_seconds_count",
        "pdfleet_engine_request_queue_time_seconds_count",
        "pdfleet_engine_cache_config_info",
    ):
        assert name in names, name
    values = scrape(server.url)
    assert values["pdfleet_engine_generation_tokens_total"] >= 3
    assert values["pdfleet_engine_e2e_request_latency_seconds_count"] >= 1


def test_client_request_id_is_echoed_and_two_requests_may_share_it(http):
    bodies = [
        http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"x-request-id": "abc123"},
        )
        for _ in range(2)
    ]
    # Both served (the engine keys them by ids of its own); the body's id carries the
    # client's id as vLLM's does, the header echoes it.
    for r in bodies:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "abc123"
        assert r.json()["id"] == "cmpl-abc123"
    plain = [http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}) for _ in range(2)]
    for r in plain:
        assert r.headers["x-request-id"] == r.json()["id"]
        assert r.json()["id"].startswith("cmpl-") and len(r.json()["id"]) > 20
    assert plain[0].json()["id"] != plain[1].json()["id"]


def test_queue_bound_answers_503_and_api_key(engines):
    proc = engines["queue-503"]
    try:
        proc.wait_healthy()
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        headers = {"authorization": "Bearer sekret"}

        def engine_state() -> tuple[float, float]:
            text = httpx.get(proc.url + "/metrics", headers=headers, timeout=5).text
            values = {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
            }
            return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]

        async def main():
            async with httpx.AsyncClient(timeout=120, headers=headers) as c:
                # Streams long enough that the first cannot finish while the test
                # looks; they are closed (and so aborted) once the third is answered.
                body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                url = proc.url + "/v1/completions"
                async with c.stream("POST", url, json=body) as first:
                    # Wait on the engine's own count, not on a sleep: the first runs.
                    assert await asyncio.to_thread(
                        wait_until, lambda: engine_state() == (1, 0), 60
                    ), engine_state()
                    async with c.stream("POST", url, json=body) as second:
                        # The second waits behind it (max-num-seqs 1): the queue is full.
                        assert await asyncio.to_thread(
                            wait_until, lambda: engine_state() == (1, 1), 60
                        ), engine_state()
                        third = await c.post(url, json={**body, "stream": False})
                        return third, first.status_code, second.status_code

        third, first, second = asyncio.run(main())
        assert third.status_code == 503, third.text
        assert third.json()["error"]["type"] == "ServiceUnavailableError"
        assert first == second == 200
        # Closing the streams aborted both: nothing is left running or waiting.
        assert wait_until(lambda: engine_state() == (0, 0), 60), engine_state()
    finally:
        proc.stop()


def test_queue_bound_holds_for_a_burst_that_lands_between_two_steps(engines):
    # One runs and two wait at most: a burst of concurrent requests admits no more
    # than that, although all of them arrive before the engine's next step.
    proc = engines["queue-burst"]
    try:
        proc.wait_healthy()
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}

        async def main():
            async with (
                httpx.AsyncClient(timeout=120, headers=proc.headers) as c,
                contextlib.AsyncExitStack() as streams,
            ):
                url = proc.url + "/v1/completions"
                # The streams stay open (so none finishes) until every status is in.
                responses = await asyncio.gather(
                    *(
                        streams.enter_async_context(c.stream("POST", url, json=body))
                        for _ in range(12)
                    )
                )
                return sorted(r.status_code for r in responses)

        statuses = asyncio.run(main())
        # Two are admitted before the engine steps; a third when a step moved the
        # first into the batch while the burst still arrived. Never more.
        admitted = statuses.count(200)
        assert 2 <= admitted <= 3 and statuses.count(503) == 12 - admitted, statuses
    finally:
        proc.stop()


def test_sigterm_lets_the_stream_finish_then_exits_zero(engines):
    proc = engines["sigterm"]
    try:
        proc.wait_healthy()
        body = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream(
            "POST", proc.url + "/v1/completions", json=body, timeout=60, headers=proc.headers
        ) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    proc.signal(signal.SIGTERM)
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"
        deadline = time.monotonic() + 30
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.proc.returncode == 0, proc.log()
    finally:
        proc.stop()


def test_auto_tool_choice_on_a_model_without_a_parser_names_the_flag_and_the_resource_field(
    client,
):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=4
        )
    error = refused.value.body
    assert error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in error["message"]
    assert "spec.serving.enableAutoToolChoice" in error["message"]
    assert "spec.serving.toolCallParser" in error["message"]
