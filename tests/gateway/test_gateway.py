"""The gateway between the official openai client and real engine processes."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from helpers.fleet import auth_headers, engines_view, metric, start_gateway
from helpers.server import fleet_token, wait_until

from pdfleet.engine.gateway.prompt import PromptAnalyzer

SHORT = "The harbor was quiet."
LONG = (
    "The harbor was quiet before dawn, and the fishing boats rocked gently against the "
    "old wooden pier while gulls circled overhead waiting for the first catch of the day. "
)
MIN_PROMPT_TOKENS = 32


@pytest.fixture(scope="module")
def gateways(engines, tiny_model, tmp_path_factory):
    """Conditional (with the model's tokenizer), Always and Disabled gateways."""
    prefill, decode = engines
    log_dir = tmp_path_factory.mktemp("gateways")
    common = ["--prefill", prefill.url, "--decode", decode.url, "--scrape-interval", "0.2"]
    procs = {}
    try:
        procs["conditional"] = start_gateway(
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
        # Its 200-request burst waits at the gateway for slots once the engines
        # queue; on a loaded 2-core host that can pass the default 60 s bound,
        # and this file tests completion, not the overload answer (test_slow_fleet).
        procs["always"] = start_gateway(
            [*common, "--disaggregation-mode", "Always", "--queue-timeout", "180"], log_dir
        )
        procs["disabled"] = start_gateway([*common, "--disaggregation-mode", "Disabled"], log_dir)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def client_for(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def engine_client(url: str) -> openai.OpenAI:
    """An engine called directly, with the fleet token (as the gateway calls it)."""
    return client_for(url, fleet_token() or "none")


def generate(client: openai.OpenAI, chat: bool, stream: bool, prompt: str) -> str:
    kw = dict(model="tiny", max_tokens=12, temperature=0)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            return (
                client.chat.completions.create(messages=messages, **kw).choices[0].message.content
            )
        chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if not stream:
        return client.completions.create(prompt=prompt, **kw).choices[0].text
    chunks = client.completions.create(prompt=prompt, stream=True, **kw)
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("mode", ["conditional", "always"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_output_through_the_gateway_equals_a_direct_engine(
    gateways, engines, mode, chat, stream
):
    direct = engine_client(engines[1].url)
    via = client_for(gateways[mode].url)
    for prompt in (SHORT, LONG):
        assert generate(via, chat, stream, prompt) == generate(direct, chat, False, prompt)


def test_conditional_decisions_are_visible_in_metrics_and_long_prompts_move_kv_blocks(
    gateways, engines
):
    url = gateways["conditional"].url
    decode = engines[1].url
    client = client_for(url)

    def decisions(decision: str, reason: str) -> float:
        return metric(
            url, "pdfleet_gateway_disagg_decisions_total", decision=decision, reason=reason
        )

    short0 = decisions("decode_only", "short_prompt")
    long0 = decisions("prefill_decode", "long_prompt")
    cached0 = decisions("decode_only", "cached_prefix")
    pulled0 = metric(decode, "pdfleet_engine_kv_transfer_blocks_pulled_total")
    transfers0 = metric(decode, "pdfleet_engine_kv_transfers_total")

    client.completions.create(model="tiny", prompt=SHORT, max_tokens=2)
    assert decisions("decode_only", "short_prompt") == short0 + 1

    fresh = "A brand new story begins here. " + LONG * 2
    out = client.completions.create(model="tiny", prompt=fresh, max_tokens=2)
    assert decisions("prefill_decode", "long_prompt") == long0 + 1
    # The producer's KV moved over NIXL: the decode engine pulled the prompt's
    # full blocks (all but the trailing partial one) instead of recomputing them.
    full_blocks = (out.usage.prompt_tokens - 1) // 16
    assert wait_until(
        lambda: metric(decode, "pdfleet_engine_kv_transfers_total") == transfers0 + 1, 10
    )
    pulled = metric(decode, "pdfleet_engine_kv_transfer_blocks_pulled_total") - pulled0
    assert full_blocks >= 2 and pulled >= full_blocks // 2, (pulled, full_blocks)

    # The same prompt again: the chosen decode engine now caches its prefix.
    client.completions.create(model="tiny", prompt=fresh, max_tokens=2)
    assert decisions("decode_only", "cached_prefix") == cached0 + 1


def test_gateway_counts_prompt_tokens_like_the_engine(engines, tiny_model):
    analyzer = PromptAnalyzer(tiny_model, max_blocks=64)
    direct = engine_client(engines[1].url)
    out = direct.completions.create(model="tiny", prompt=LONG, max_tokens=1)
    assert analyzer.analyze({"prompt": LONG}, False, 16).num_tokens == out.usage.prompt_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]
    chat = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    counted = analyzer.analyze({"messages": messages}, True, 16).num_tokens
    assert counted == chat.usage.prompt_tokens


def test_both_legs_reach_their_engines_and_disabled_skips_prefill(gateways, engines):
    prefill, decode = engines

    def finished(engine) -> float:
        return metric(engine.url, "pdfleet_engine_request_success_total")

    p0, d0 = finished(prefill), finished(decode)
    client_for(gateways["always"].url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
    # The engines' counters move on their next step; wait for both legs to show.
    assert wait_until(lambda: finished(prefill) == p0 + 1 and finished(decode) == d0 + 1, 10)

    p1, d1 = finished(prefill), finished(decode)
    client_for(gateways["disabled"].url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
    assert wait_until(lambda: finished(decode) == d1 + 1, 10)
    assert finished(prefill) == p1
    url = gateways["disabled"].url
    assert metric(url, "pdfleet_gateway_disagg_decisions_total", reason="disabled") >= 1


def test_request_id_reaches_the_engine_and_comes_back_and_may_repeat(gateways):
    url = gateways["always"].url

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        url + "/v1/completions",
                        json={"model": "tiny", "prompt": LONG, "max_tokens": 2},
                        headers={"X-Request-Id": "trace-42"},
                    )
                    for _ in range(2)
                )
            )

    # The same client id twice at once: the engines key requests by their own
    # ids, so both complete; the id only labels the answer.
    for resp in asyncio.run(twice()):
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "trace-42"
        assert resp.json()["id"] == "cmpl-trace-42"
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
        },
        headers={"X-Request-Id": "trace-43"},
        timeout=60,
    ) as stream:
        assert stream.headers["x-request-id"] == "trace-43"
        lines = [ln for ln in stream.iter_lines() if ln.startswith("data: {")]
    assert lines and len({json.loads(ln[6:])["id"] for ln in lines}) == 1
    generated = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60
    )
    assert len(generated.headers["x-request-id"]) >= 16
    # An id that is not a plain token (a header injection attempt) is replaced.
    odd = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "a b<script>"},
        timeout=60,
    )
    assert odd.status_code == 200 and odd.headers["x-request-id"] != "a b<script>"


# "disabled" has one decode engine: its requests take the route that skips the
# prompt analysis, and bad input still gets the gateway's (or the engine's) 400.
@pytest.mark.parametrize("mode", ["conditional", "always", "disabled"])
def test_bad_input_gets_an_openai_shaped_4xx(gateways, mode):
    url = gateways[mode].url
    client = client_for(url)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=LONG, max_tokens=-1)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=LONG, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x" * 5000, max_tokens=2)  # too long
    bad_json = httpx.post(
        url + "/v1/completions",
        content=b'{"prompt": "unterminated',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert bad_json.status_code == 400
    error = bad_json.json()["error"]
    assert error["type"] == "BadRequestError" and "JSON" in error["message"]
    assert metric(url, "pdfleet_gateway_requests_total", status="400") >= 4


def test_engines_and_the_gateway_answer_one_error_body(gateways, engines):
    """OpenAI's error shape with the HTTP status as an integer ``code`` (as vLLM
    sends it), the same from an engine and from the gateway in front of it: for
    a refused input, an unknown route and an unknown method."""
    direct, via = engine_client(engines[1].url), client_for(gateways["disabled"].url)
    bodies = []
    for client in (direct, via):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="no-such-model", prompt=SHORT, max_tokens=2)
        assert err.value.status_code == 404 and err.value.code == "404"  # the client's str()
        bodies.append(err.value.body)
    assert (
        bodies[0]
        == bodies[1]
        == {
            "message": "The model `no-such-model` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    )
    engine = {"authorization": f"Bearer {fleet_token()}"}
    for method, path, status, kind in (
        ("GET", "/v1/no-such-route", 404, "NotFoundError"),
        ("POST", "/health", 405, "MethodNotAllowedError"),
    ):
        answers = [
            httpx.request(method, engines[1].url + path, headers=engine, timeout=10),
            httpx.request(method, gateways["disabled"].url + path, timeout=10),
        ]
        for r in answers:
            assert r.status_code == status and r.headers["content-type"] == "application/json"
            assert r.json() == {
                "error": {"message": r.reason_phrase, "type": kind, "param": None, "code": status}
            }
        if status == 405:
            assert [r.headers["allow"] for r in answers] == ["GET", "GET"]


def test_models_health_engines_and_metrics(gateways, engines):
    url = gateways["always"].url
    assert [m.id for m in client_for(url).models.list().data] == ["tiny"]
    assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
    view = engines_view(url)
    assert view["routable"] == {"prefill": 1, "decode": 1}
    assert {(e["url"], e["role"], e["state"]) for e in view["engines"]} == {
        (engines[0].url, "prefill", "healthy"),
        (engines[1].url, "decode", "healthy"),
    }
    assert metric(url, "pdfleet_gateway_engine_healthy", engine=engines[1].url) == 1
    client_for(url).completions.create(model="tiny", prompt=SHORT, max_tokens=3, stream=True)
    assert metric(url, "pdfleet_gateway_time_to_first_token_seconds_count") >= 1
    assert metric(url, "pdfleet_gateway_e2e_request_latency_seconds_count") >= 1


def test_200_concurrent_short_requests_complete_and_leave_no_kv_blocks(gateways, engines):
    url = gateways["always"].url

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=180)

        async def one(i: int) -> int:
            kw = dict(model="tiny", prompt=f"Request {i}: {SHORT}", max_tokens=4, temperature=0)
            kw["extra_body"] = {"ignore_eos": True}
            if i % 2:
                out = await client.completions.create(**kw)
                return out.usage.completion_tokens
            n = 0
            async for chunk in await client.completions.create(**kw, stream=True):
                n += sum(1 for c in chunk.choices if c.text)
            return n

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 240)
        finally:
            await client.close()

    counts = asyncio.run(main())
    assert len(counts) == 200 and all(n >= 1 for n in counts[0::2])
    assert all(n == 4 for n in counts[1::2])
    for engine in engines:
        assert wait_until(
            lambda e=engine: metric(e.url, "pdfleet_engine_kv_cache_usage_ratio") == 0, 20
        ), f"KV blocks left on {engine.url}"
        assert metric(engine.url, "pdfleet_engine_num_requests_running") == 0
    # A leg leaves the gauge once its handler has finished, which may be just
    # after its client read the last byte.
    assert wait_until(lambda: metric(url, "pdfleet_gateway_engine_inflight_requests") == 0, 10)


def test_api_keys(engines, tmp_path_factory):
    gw = start_gateway(
        ["--decode", engines[1].url, "--api-key", "key-one", "--api-key", "key-two"],
        tmp_path_factory.mktemp("keys"),
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            client_for(gw.url, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        no_key = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert no_key.status_code == 401
        assert no_key.json()["error"]["type"] == "AuthenticationError"
        for key in ("key-one", "key-two"):
            out = client_for(gw.url, key).completions.create(model="tiny", prompt="x", max_tokens=1)
            assert out.choices[0].finish_reason == "length"
        assert [m.id for m in client_for(gw.url, "key-one").models.list().data] == ["tiny"]
        # Only the bare health probe is open; what names engines needs a key.
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
        for path in ("/metrics", "/engines"):
            assert httpx.get(gw.url + path, timeout=5).status_code == 401
            assert httpx.get(gw.url + path, headers=auth_headers("key-two")).status_code == 200
            # The operator scrapes with the fleet token.
            assert httpx.get(gw.url + path, headers=auth_headers()).status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(gw.url + path, timeout=5).status_code == 404
    finally:
        gw.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_goes_away_aborts_the_engine_request(gateways, engines, stream):
    decode = engines[1]

    def finished_by_length() -> float:
        return metric(decode.url, "pdfleet_engine_request_success_total", finished_reason="length")

    def idle() -> bool:
        return metric(decode.url, "pdfleet_engine_num_requests_running") == 0

    def generated() -> float:
        return metric(decode.url, "pdfleet_engine_generation_tokens_total")

    # A finished request first: an engine's first step also reports its warm-up.
    # The engine delivers the answer before its metrics count it, and its
    # running gauge reads 0 meanwhile: wait for the count, not the gauge.
    counted = finished_by_length()
    engine_client(decode.url).completions.create(model="tiny", prompt="x", max_tokens=1)
    assert wait_until(lambda: finished_by_length() > counted and idle(), 10)
    before, generated0 = finished_by_length(), generated()
    gw = gateways["disabled"].url

    def answered(status: str) -> float:
        return metric(gw, "pdfleet_gateway_requests_total", status=status)

    gone, served = answered("499"), answered("200")
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 480, "ignore_eos": True}
    url = gw + "/v1/completions"
    if stream:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as resp:
            next(resp.iter_lines())  # one event, then hang up
    else:
        # A JSON answer comes whole at the end: hang up once the engine runs it
        # (a fixed client timeout could fire before the request got there).
        payload = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        port = int(gateways["disabled"].url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"%scontent-length: %d\r\n\r\n%s" % (head.encode(), len(payload), payload))
            assert wait_until(lambda: not idle(), 10), "the request never ran on the engine"
    # The engine request ends without running to its 480 tokens: it was aborted.
    # (Its tokens are read first: once they show, the gauge is of that step or later.)
    assert wait_until(lambda: generated() > generated0 and idle(), 10)
    assert finished_by_length() == before
    assert generated() - generated0 < 480
    # The gateway counts it as the client's hang-up (499), not as served.
    assert wait_until(lambda: answered("499") == gone + 1, 10), (answered("499"), gone)
    assert answered("200") == served
