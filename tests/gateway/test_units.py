"""The gateway's pure parts: legs, prompt analysis, metric parsing, the pool's
health state machine and its configuration."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from pdfleet.engine.config import FlexibleArgumentParser
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.contracts.gateway_events import (
    KVPairEvent,
    KVPairFailed,
    KVPairUsed,
    decode_event,
    encode_event,
)
from pdfleet.engine.gateway.answers import sse_error
from pdfleet.engine.gateway.deadlines import Deadline, IdleTimer
from pdfleet.engine.gateway.decode_leg import decode_body
from pdfleet.engine.gateway.discovery import Endpoint, StaticDiscovery
from pdfleet.engine.gateway.engines import (
    STEP_WINDOW_S,
    EngineLoad,
    EnginePool,
    EngineState,
    StepWindow,
    parse_engine_metrics,
)
from pdfleet.engine.gateway.legs import Legs
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.prefill_leg import prefill_body
from pdfleet.engine.gateway.prompt import CHARS_PER_TOKEN, PromptAnalyzer, chain_hashes
from pdfleet.engine.gateway.routing import KVPairBreaker

# -- the two legs ------------------------------------------------------------------


def test_prefill_leg_body_follows_the_protocol():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "min_completion_tokens": 5,
        "temperature": 0.7,
    }
    original = json.loads(json.dumps(body))
    leg = prefill_body(body, chat=True)
    assert leg == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.7,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body == original  # the decode leg still needs the client's body
    completion = prefill_body({"prompt": "x", "max_tokens": 9}, chat=False)
    assert "max_completion_tokens" not in completion and completion["max_tokens"] == 1
    # Each leg gets its own params dict: mutating one never leaks into the next.
    completion["kv_transfer_params"]["remote_host"] = "h"
    assert prefill_body({"prompt": "x"}, chat=False)["kv_transfer_params"]["remote_host"] is None


def test_decode_leg_is_the_original_body_plus_the_producer_params():
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2]}
    body = {"prompt": "x", "max_tokens": 9, "stream": True, "min_tokens": 2}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}


def test_sse_error_is_an_openai_error_event_then_done():
    raw = sse_error("the decode engine failed", 502).decode()
    first, done, rest = raw.split("\n\n")
    assert done == "data: [DONE]" and rest == ""
    error = json.loads(first[len("data: ") :])["error"]
    assert error == {
        "message": "the decode engine failed",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }


# -- prompts -----------------------------------------------------------------------


def test_block_hashes_are_equal_exactly_as_long_as_prefixes_are():
    a = chain_hashes(list(range(100)), 16, 64)
    b = chain_hashes([*range(40), -1, *range(41, 100)], 16, 64)
    assert len(a) == 6  # the trailing partial block is not hashed
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert len(chain_hashes(list(range(10_000)), 16, 8)) == 8  # capped


def test_prompt_analysis_without_a_tokenizer_approximates_by_characters():
    analyzer = PromptAnalyzer(None, max_blocks=64)
    text = "word " * 200
    got = analyzer.analyze({"prompt": text}, False, 16)
    assert got.num_tokens == len(text) // CHARS_PER_TOKEN
    assert len(got.block_hashes) == len(text) // (16 * CHARS_PER_TOKEN)
    ids = analyzer.analyze({"prompt": list(range(40))}, False, 16)
    assert (ids.num_tokens, len(ids.block_hashes), ids.batch) == (40, 2, False)
    batch = analyzer.analyze({"prompt": ["a" * 400, "b"]}, False, 16)
    assert batch.batch and batch.num_tokens == 100
    chat = analyzer.analyze({"messages": [{"role": "user", "content": "x" * 100}]}, True, 16)
    assert chat.num_tokens >= 25
    for bad in ({}, {"prompt": 5}, {"prompt": [{"x": 1}]}, {"messages": "hi"}):
        assert analyzer.analyze(bad, "messages" in bad, 16).num_tokens == 0


def test_prompt_analysis_with_the_tokenizer_is_exact(tiny_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    analyzer = PromptAnalyzer(tiny_model, max_blocks=64)
    text = "The quick brown fox jumps over the lazy dog. " * 10
    ids = tok.encode(text, add_special_tokens=True).ids
    got = analyzer.analyze({"prompt": text}, False, 16)
    assert got.num_tokens == len(ids)
    assert got.block_hashes == chain_hashes(ids, 16, 64)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        PromptAnalyzer("/nonexistent", 64)


def test_long_prompts_are_tokenized_only_up_to_a_bounded_head(tiny_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    analyzer = PromptAnalyzer(tiny_model, max_blocks=8, min_prompt_tokens=100)
    text = "The quick brown fox jumps over the lazy dog. " * 2000  # 90k characters
    ids = tok.encode(text, add_special_tokens=True).ids
    got = analyzer.analyze({"prompt": text}, False, 16)
    assert got.block_hashes == chain_hashes(ids, 16, 8)  # the hashed blocks are exact
    assert 0.5 < got.num_tokens / len(ids) < 2  # the rest is estimated from characters


# -- engine metrics and health -----------------------------------------------------

PDFLEET_METRICS = """\
# HELP pdfleet_engine_num_requests_running Requests in the running batch.
# TYPE pdfleet_engine_num_requests_running gauge
pdfleet_engine_num_requests_running{model_name="tiny"} 3.0
# TYPE pdfleet_engine_num_requests_waiting gauge
pdfleet_engine_num_requests_waiting{model_name="tiny"} 2.0
# TYPE pdfleet_engine_kv_cache_usage_ratio gauge
pdfleet_engine_kv_cache_usage_ratio{model_name="tiny"} 0.25
# TYPE pdfleet_engine_time_to_first_token_seconds histogram
pdfleet_engine_time_to_first_token_seconds_bucket{le="0.001",model_name="tiny"} 0.0
# TYPE pdfleet_engine_cache_config_info gauge
pdfleet_engine_cache_config_info{block_size="32",cache_dtype="float32",compat_hash="d84f8e62fded792c",enable_prefix_caching="True",num_gpu_blocks="4096"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 99.0
"""

VLLM_METRICS = """\
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
"""


def test_engine_metrics_are_read_by_native_name_with_vllm_fallback():
    assert parse_engine_metrics(PDFLEET_METRICS) == EngineLoad(
        waiting=2, running=3, kv_usage=0.25, compat_hash="d84f8e62fded792c", block_size=32
    )
    assert parse_engine_metrics(VLLM_METRICS) == EngineLoad(
        waiting=7, running=5, kv_usage=0.5, compat_hash=None, block_size=16
    )
    assert parse_engine_metrics("") == EngineLoad()  # an engine that has not stepped yet


def make_pool(
    eject_after: int = 3, readmit_after: int = 2, urls: tuple[str, ...] = ("http://d",)
) -> tuple[EnginePool, list[str]]:
    config = GatewayConfig(decode=list(urls), eject_after=eject_after, readmit_after=readmit_after)
    ejected: list[str] = []
    pool = EnginePool(
        config, StaticDiscovery([]), GatewayMetrics(), httpx.AsyncClient(), ejected.append
    )
    pool.apply([Endpoint(url, "decode") for url in urls])
    return pool, ejected


def test_engine_health_state_machine():
    pool, ejected = make_pool(eject_after=3, readmit_after=2, urls=("http://d", "http://d2"))
    e = pool.engines["http://d"]
    assert e.state == "pending" and not pool.candidates("decode")
    pool.record_success(e, EngineLoad())
    assert e.state == "healthy" and pool.candidates("decode") == [e]
    pool.record_success(pool.engines["http://d2"], EngineLoad())  # a peer that passes
    pool.record_failure(e, "timeout")
    pool.record_failure(e, "timeout")
    pool.record_success(e, EngineLoad())  # a success resets the count
    pool.record_failure(e, "timeout")
    pool.record_failure(e, "timeout")
    assert e.state == "healthy"
    pool.record_failure(e, "timeout")
    assert e.state == "ejected" and ejected == ["http://d"]
    pool.record_success(e, EngineLoad())
    assert e.state == "ejected"
    pool.record_success(e, EngineLoad())
    assert e.state == "healthy"
    pool.record_failure(e, "/health answered 503", definitive=True)
    assert e.state == "ejected"
    samples = {
        s.name: s.value
        for m in pool.metrics.registry.collect()
        for s in m.samples
        if s.labels.get("engine") == "http://d"
    }
    assert samples["pdfleet_gateway_engine_ejections_total"] == 2
    assert samples["pdfleet_gateway_engine_healthy"] == 0


def _stepped(steps: float, seconds: float, running: float | None = None) -> EngineLoad:
    """A scrape after ``steps`` steps of ``seconds`` in all, the longest
    ``seconds``; ``running``: the age of the step in progress."""
    return EngineLoad(
        steps=steps,
        step_seconds=seconds,
        step_buckets=((1.0, 0.0), (100.0, steps)),
        step_running=running,
    )


def test_a_step_that_spans_a_failed_check_or_a_stall_is_not_the_engine_s_pace():
    pool, _ = make_pool(urls=("http://d", "http://d2"))
    e = pool.engines["http://d"]
    pool.record_success(e, _stepped(0, 0))
    pool.record_success(e, _stepped(1, 5.0))  # a long step, its checks answered: its pace
    assert e.steps.longest(time.monotonic()) == 5.0
    e.steps = StepWindow(STEP_WINDOW_S)
    pool.record_failure(e, "timeout")  # stopped: the step in progress holds the stop
    # Back: a step that ended before the stop, and the one that spans it, running.
    pool.record_success(e, _stepped(2, 6.0, running=60.0))
    pool.record_success(e, _stepped(3, 66.0))  # it ended
    assert e.steps.longest(time.monotonic()) == 0.0
    pool.record_success(e, _stepped(4, 71.0))  # begun after the stop: measured again
    assert e.steps.longest(time.monotonic()) == 5.0
    e.steps = StepWindow(STEP_WINDOW_S)
    pool._eject_stalled(e, "stalled")  # judged stalled, its checks not failed
    pool.record_success(e, _stepped(5, 131.0))  # the step that spans it
    assert e.steps.longest(time.monotonic()) == 0.0


def test_an_idle_timer_waits_while_its_hold_asks_it_to():
    async def main() -> tuple[bool, bool]:
        holds: list[float] = []
        left = [60.0]

        def hold() -> float:
            holds.append(left[0])
            return left[0]

        timer: IdleTimer | None = None
        held = False
        try:
            with Deadline(None) as cm:
                timer = IdleTimer(cm, 0.01, hold)
                while not holds:  # idle time up: asked, and told to wait
                    await asyncio.sleep(0.01)
                held = not cm.expired()
                left[0] = 0.0
                timer._fire()  # (its next fire): no longer held, it expires
                await asyncio.sleep(5)
        except TimeoutError:
            pass
        assert timer is not None
        timer.cancel()
        return held, cm.expired()

    assert asyncio.run(asyncio.wait_for(main(), 10)) == (True, True)


def test_failed_checks_eject_only_while_another_engine_of_the_role_passes():
    pool, ejected = make_pool(eject_after=2, urls=("http://d", "http://d2"))
    d, d2 = pool.engines["http://d"], pool.engines["http://d2"]
    for e in (d, d2):
        pool.record_success(e, EngineLoad())
    # Every engine of the role times out (a fleet slow as a whole): none is ejected.
    for _ in range(4):
        pool.record_failure(d, "timeout")
        pool.record_failure(d2, "timeout")
    assert d.routable and d2.routable and ejected == []
    # d2 answers again: d, still failing, now leaves routing.
    pool.record_success(d2, EngineLoad())
    pool.record_failure(d, "timeout")
    assert not d.routable and ejected == ["http://d"]
    # The last routable engine of its role stays, however many checks fail...
    for _ in range(5):
        pool.record_failure(d2, "timeout")
    assert d2.routable
    # ...but a definitive answer (draining, a refused connection) ejects it.
    pool.record_failure(d2, "/health answered 503", definitive=True)
    assert not d2.routable


def test_removed_engines_leave_no_metric_series():
    pool, ejected = make_pool()
    pool.apply([])
    assert pool.engines == {} and ejected == ["http://d"]
    names = {s.name for m in pool.metrics.registry.collect() for s in m.samples if s.labels}
    assert not names & {
        "pdfleet_gateway_engine_healthy",
        "pdfleet_gateway_engine_inflight_requests",
    }


# -- configuration -----------------------------------------------------------------


def parse(argv: list[str]) -> GatewayConfig:
    parser = FlexibleArgumentParser()
    GatewayConfig.add_cli_args(parser)
    return GatewayConfig.from_cli_args(parser.parse_args(argv))


def test_flags_are_repeatable_and_round_trip(monkeypatch):
    monkeypatch.delenv("PDFLEET_API_KEY", raising=False)
    config = parse(
        [
            "--prefill",
            "http://p1:8000",
            "--prefill",
            "http://p2:8000",
            "--decode",
            "http://d1:8000",
            "http://d2:8000",
            "--disaggregation-mode",
            "Always",
            "--min-prompt-tokens",
            "512",
            "--first-token-timeout",
            "12.5",
        ]
    )
    assert config.prefill == ["http://p1:8000", "http://p2:8000"]
    assert config.decode == ["http://d1:8000", "http://d2:8000"]
    assert config.disaggregation_mode == "Always" and config.first_token_timeout == 12.5
    assert parse(config.to_cli_args()) == config


def test_api_keys_come_from_flags_or_the_environment_and_are_never_printed(monkeypatch):
    monkeypatch.setenv("PDFLEET_API_KEY", "k1, k2")
    config = parse(["--decode", "http://d"])
    assert config.api_key == ["k1", "k2"]
    assert parse(["--decode", "http://d", "--api-key", "k3"]).api_key == ["k3"]
    assert parse(["--decode", "http://d", "--api-key", "k3,k4"]).api_key == ["k3", "k4"]
    assert "k1" not in repr(config) and "k1" not in " ".join(config.to_cli_args())


def test_api_keys_from_a_mounted_secret_file(monkeypatch, tmp_path):
    monkeypatch.delenv("PDFLEET_API_KEY", raising=False)
    key_file = tmp_path / "api-key"
    key_file.write_text("k1\nk2, k3\n")
    monkeypatch.setenv("PDFLEET_API_KEY_FILE", str(key_file))
    assert parse(["--decode", "http://d"]).api_key == ["k1", "k2", "k3"]
    # $PDFLEET_API_KEY wins over the file.
    monkeypatch.setenv("PDFLEET_API_KEY", "k9")
    assert parse(["--decode", "http://d"]).api_key == ["k9"]
    monkeypatch.delenv("PDFLEET_API_KEY")
    # A missing or empty file is an error naming the variable, not a gateway without auth.
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="PDFLEET_API_KEY_FILE.*holds no key"):
        parse(["--decode", "http://d"])
    monkeypatch.setenv("PDFLEET_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PDFLEET_API_KEY_FILE: cannot read"):
        parse(["--decode", "http://d"])


def test_the_chat_template_flag_takes_the_engines_value_and_is_refused_when_bad(
    tiny_model, tmp_path, capsys
):
    """``--chat-template`` holds the value as the engines take it (inline text
    or a path, read by the gateway when it starts), needs ``--tokenizer``, and a
    value the gateway cannot load stops ``pdfleet gateway`` before it serves,
    naming the flag."""
    from pdfleet.engine.cli import main

    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    base = ["--decode", "http://d", "--tokenizer", tiny_model]
    config = parse([*base, "--chat-template", template])
    assert config.chat_template == template
    assert parse(config.to_cli_args()) == config
    assert "--chat-template" not in parse(base).to_cli_args()
    # The gateway renders chat prompts with it.
    from pdfleet.engine.gateway.app import Gateway

    gateway = Gateway(config, StaticDiscovery([]), fleet_secret=b"")
    assert gateway.analyzer.tokenizer is not None
    rendered = gateway.analyzer.tokenizer.chat_text(
        [{"role": "user", "content": "hi"}], {"add_generation_prompt": True}
    )
    assert rendered == "user: hi\n"
    with pytest.raises(ValueError, match="--chat-template needs --tokenizer"):
        GatewayConfig(decode=["http://d"], chat_template=template)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for value, why in (
        (str(tmp_path / "missing.jinja"), "no such file, and not a Jinja template"),
        (str(broken), "not a template jinja2 can compile"),
    ):
        assert main(["gateway", *base, "--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert "pdfleet gateway: error: --chat-template" in err and why in err, err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give the engines"),
        ({"decode": ["d:8000"]}, "must start with http"),
        (
            {"decode": ["http://d"], "idle_timeout": 0},
            r"--idle-timeout must be within \[0.01, 86400\]",
        ),
        ({"discovery": "kubernetes"}, "needs --selector"),
        (
            {"discovery": "kubernetes", "selector": "a=b", "decode": ["http://d"]},
            "drop --prefill",
        ),
    ],
)
def test_invalid_configuration_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


# -- waits, stalls, the KV pair breaker ------------------------------------------------


def test_first_token_bound_grows_with_the_engine_queue_and_is_capped():
    config = GatewayConfig(decode=["http://d"])
    assert config.first_token_bound(0) == 60.0  # not 300 s for an idle engine
    assert config.first_token_bound(20) == 100.0
    assert config.first_token_bound(10_000) == 300.0
    fixed = GatewayConfig(decode=["http://d"], first_token_timeout=7)
    assert fixed.first_token_bound(10_000) == 7


def test_the_scrape_counts_tokens_and_kv_pulls():
    text = (
        "pdfleet_engine_prompt_tokens_total 100.0\n"
        "pdfleet_engine_generation_tokens_total 40.0\n"
        "pdfleet_engine_kv_transfers_total 5.0\n"
        "pdfleet_engine_kv_transfer_failures_total 2.0\n"
    )
    load = parse_engine_metrics(text)
    assert (load.prompt_tokens, load.generation_tokens) == (100, 40)
    assert (load.kv_transfers, load.kv_failures) == (5, 2)


def stall_pool() -> tuple[EnginePool, dict]:
    config = GatewayConfig(decode=["http://a", "http://b"], stall_timeout=3)
    pool = EnginePool(config, StaticDiscovery([]), GatewayMetrics(), httpx.AsyncClient())
    pool.apply([Endpoint("http://a", "decode"), Endpoint("http://b", "decode")])
    engines = pool.engines
    for e in engines.values():
        pool.record_success(e, EngineLoad())
    return pool, engines


def test_an_engine_is_ejected_for_a_stall_only_while_another_makes_progress():
    pool, engines = stall_pool()
    a, b = engines["http://a"], engines["http://b"]
    a.inflight = b.inflight = 1
    a.last_progress = b.last_progress = 100.0
    # Both silent: a fleet that is slow as a whole (one long prefill) ejects nothing.
    assert pool.find_stalls(now=104.0) == []
    b.last_progress = 103.5  # b answers, a stays silent past --stall-timeout
    assert pool.find_stalls(now=104.0) == [a]
    assert a.state == "ejected" and a.stalled and b.routable
    # It answers checks again: readmitted, with a fresh stall clock.
    pool.record_success(a, EngineLoad())
    pool.record_success(a, EngineLoad())
    assert a.routable and not a.stalled


def test_token_counters_that_move_are_progress_without_any_answer():
    pool, engines = stall_pool()
    a = engines["http://a"]
    a.last_progress = 0.0
    pool.record_success(a, EngineLoad(generation_tokens=10))
    assert a.last_progress > 0  # a long non-streamed answer is not a stall


def breaker_setup():
    metrics = GatewayMetrics()
    return KVPairBreaker(threshold=2, cooldown=30, metrics=metrics), metrics


def pair_open(metrics: GatewayMetrics, prefill: str, decode: str) -> float:
    for m in metrics.registry.collect():
        for s in m.samples:
            if s.name == "pdfleet_gateway_kv_pair_open" and s.labels == {
                "prefill": prefill,
                "decode": decode,
            }:
                return s.value
    return 0.0


def test_the_kv_pair_breaker_opens_after_consecutive_failures_and_closes_after_its_cooldown():
    breaker, metrics = breaker_setup()
    breaker.record("p", "d", ok=False, now=0)
    breaker.record("p", "d", ok=True, now=1)  # a success resets the count
    breaker.record("p", "d", ok=False, now=2)
    assert not breaker.is_open("p", "d", now=2)
    breaker.record("p", "d", ok=False, now=3)
    assert breaker.is_open("p", "d", now=3) and pair_open(metrics, "p", "d") == 1
    assert not breaker.is_open("p2", "d", now=3)  # other pairs are unaffected
    assert not breaker.is_open("p", "d", now=34)  # cool-down over
    assert pair_open(metrics, "p", "d") == 0


def test_the_kv_pair_breaker_judges_pairs_by_the_decode_engines_pull_counters():
    breaker, _ = breaker_setup()
    d = EngineState("d", "decode")
    for failed in (1, 2):
        breaker.handed_off("p", "d")
        breaker.scraped(d, EngineLoad(kv_failures=failed - 1), EngineLoad(kv_failures=failed))
    assert breaker.is_open("p", "d")
    # A pair with good pulls stays closed; an unused pair is not judged.
    breaker.handed_off("p2", "d")
    breaker.scraped(d, EngineLoad(kv_transfers=1), EngineLoad(kv_transfers=2))
    breaker.scraped(d, EngineLoad(kv_failures=0), EngineLoad(kv_failures=5))
    assert not breaker.is_open("p2", "d") and ("p2", "d") not in breaker.failures
    breaker.forget("p")
    assert not breaker.is_open("p", "d") and breaker.open_until == {}


def test_a_leg_that_starts_on_an_engine_already_ejected_for_a_stall_gives_up_at_once():
    """A decode engine is chosen before the prefill leg; if the watchdog ejects
    it meanwhile, the decode leg must fail over now, not after its 60 s bound."""
    pool, engines = stall_pool()
    a, b = engines["http://a"], engines["http://b"]
    a.inflight, a.last_progress, b.last_progress = 1, 100.0, 103.5
    assert pool.find_stalls(now=104.0) == [a]

    async def leg(e: EngineState) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with contextlib.suppress(TimeoutError), Legs.watched(e, 60):
            await asyncio.sleep(30)
        return loop.time() - started

    async def main() -> tuple[float, bool]:
        gave_up = await leg(a)
        other = asyncio.create_task(leg(b))  # a routable engine's leg still waits
        await asyncio.sleep(0.2)
        waits = not other.done()
        other.cancel()
        return gave_up, waits

    gave_up, waits = asyncio.run(asyncio.wait_for(main(), 10))
    assert gave_up < 1 and waits
    assert a.waiters == set()


def test_a_stall_seen_by_another_worker_ejects_the_engine_unless_it_answers_here():
    pool, engines = stall_pool()
    a, b = engines["http://a"], engines["http://b"]
    # a: nothing in flight here, so nothing contradicts the other worker's verdict.
    assert pool.stalled_elsewhere("http://a", since=100.0, now=104.0)
    assert a.state == "ejected" and a.stalled
    # b: this worker received from it after the other's last byte, within --stall-timeout.
    b.inflight, b.last_progress = 1, 103.5
    assert not pool.stalled_elsewhere("http://b", since=100.0, now=104.0)
    assert b.routable and not b.stalled
    assert not pool.stalled_elsewhere("http://gone", since=100.0, now=104.0)


def test_breakers_of_two_workers_open_together_on_each_others_failed_hand_offs():
    (one, metrics_one), (two, metrics_two) = breaker_setup(), breaker_setup()
    sent: list[KVPairEvent] = []

    def link(to: KVPairBreaker):
        def share(event: KVPairEvent) -> None:
            sent.append(event)
            crossed = decode_event(encode_event(event))  # as it crosses the socket
            assert isinstance(crossed, KVPairUsed | KVPairFailed)
            to.apply_shared(crossed)

        return share

    one.share, two.share = link(two), link(one)
    one.handed_off("p", "d")
    one.handed_off("p", "d")  # once per scrape interval is enough for the others
    assert sent == [KVPairUsed("p", "d")]
    assert two.used == {"d": {"p"}}
    one.leg_failed("p", "d")
    assert not one.is_open("p", "d") and not two.is_open("p", "d")
    two.leg_failed("p", "d")  # the second failure landed on the other worker
    assert one.is_open("p", "d") and two.is_open("p", "d")
    assert pair_open(metrics_one, "p", "d") == pair_open(metrics_two, "p", "d") == 1
    assert len(sent) == 3  # applied events are not sent on again


def test_a_refused_connection_ejects_the_engine_here_and_tells_the_other_workers():
    pool, engines = stall_pool()
    told: list[str] = []
    pool.on_refused = lambda e: told.append(e.url)
    pool.refused(engines["http://a"], "connection refused")
    assert engines["http://a"].state == "ejected" and told == ["http://a"]
    pool.refused(engines["http://a"], "connection refused")  # already out: nothing new
    assert told == ["http://a"]
    # Another worker's refusal ejects it here, without a failed request of this one.
    assert pool.refused_elsewhere("http://b") and engines["http://b"].state == "ejected"
    assert not pool.refused_elsewhere("http://b")
