"""`pdfleet bench` against a real engine process, and its arithmetic."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from helpers.fleet import start_engines
from tokenizers import Tokenizer

from pdfleet.engine.bench import BenchConfig, RequestResult, run_benchmark
from pdfleet.engine.bench.dataset import Workload, jsonl_items
from pdfleet.engine.bench.report import percentile, summarize
from pdfleet.engine.contracts.launch import python_module


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    (proc,) = start_engines(tiny_model, tmp_path_factory.mktemp("bench"), ["engine"])
    try:
        yield proc
    finally:
        proc.stop()


def bench_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_module("pdfleet.engine.cli"), "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_at_fixed_concurrency_reports_sane_numbers_and_json(engine, tiny_model, tmp_path):
    out = tmp_path / "result.json"
    n, input_len, output_len = 24, 48, 12
    proc = bench_cli(
        "--url",
        engine.url + "/v1",
        "--num-requests",
        str(n),
        "--concurrency",
        "6",
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--tokenizer",
        tiny_model,
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (n, 0)
    assert result["total_prompt_tokens"] == n * input_len  # exact with the tokenizer
    assert result["total_output_tokens"] == n * output_len  # ignore_eos by default
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = result[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert result["ttft_ms"]["p50"] < result["e2e_ms"]["p50"]
    assert result["request_throughput"] == pytest.approx(n / result["duration_s"])
    assert result["output_throughput"] == pytest.approx(n * output_len / result["duration_s"])
    # Every request meets a one-minute SLO: goodput is the request throughput.
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["slo_attainment"] == 1.0
    assert result["config"]["concurrency"] == 6


def test_library_poisson_arrivals_chat_and_an_impossible_slo(engine):
    result = run_benchmark(
        BenchConfig(
            url=engine.url,
            endpoint="chat",
            num_requests=12,
            request_rate=20.0,
            input_len=32,
            output_len=6,
            slo_ttft_ms=0.001,
            quiet=True,
        )
    )
    assert (result.completed, result.failed) == (12, 0)
    assert result.total_output_tokens == 12 * 6
    assert result.goodput == 0.0 and result.slo_attainment == 0.0


def test_duration_bounds_the_run_and_failures_are_reported(engine, tmp_path):
    out = tmp_path / "r.json"
    proc = bench_cli(
        "--url",
        engine.url,
        "--model",
        "no-such-model",
        "--num-requests",
        "None",
        "--duration",
        "1",
        "--concurrency",
        "2",
        "--json",
        str(out),
    )
    assert proc.returncode == 1  # nothing completed
    result = json.loads(out.read_text())
    assert result["completed"] == 0 and result["failed"] >= 1
    assert result["duration_s"] < 10
    assert result["ttft_ms"]["p50"] is None  # no sample is null in JSON, not NaN
    assert any("HTTP 404" in e for e in result["errors"])


def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile(values, 99) == pytest.approx(9.76)
    assert math.isnan(percentile([], 50))


def test_goodput_counts_requests_meeting_every_slo():
    config = BenchConfig(num_requests=4, slo_ttft_ms=100, slo_tpot_ms=10)
    results = [
        RequestResult(True, 0.0, ttft=0.05, e2e=0.05 + 9 * 0.005, output_tokens=10),  # good
        RequestResult(True, 0.0, ttft=0.2, e2e=0.3, output_tokens=10),  # TTFT too slow
        RequestResult(True, 0.0, ttft=0.05, e2e=0.05 + 9 * 0.02, output_tokens=10),  # TPOT
        RequestResult(False, 0.0, error="HTTP 500"),
    ]
    summary = summarize(results, 2.0, config)
    assert summary.goodput == 0.5 and summary.slo_attainment == 0.25
    assert (summary.completed, summary.failed, summary.errors) == (3, 1, ["HTTP 500"])
    assert summary.tpot_ms["p50"] == pytest.approx(100 / 9)  # of 5, 11.1 and 20 ms


def test_workloads_are_seeded_and_exact_with_a_tokenizer(tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    a = Workload(64, 8, seed=1, chat=False, shared_prefix_len=32, tokenizer=tiny_model)
    b = Workload(64, 8, seed=1, chat=False, shared_prefix_len=32, tokenizer=tiny_model)
    prompts = [a.get(i).prompt for i in range(20)]
    assert prompts == [b.get(i).prompt for i in range(20)]
    assert prompts != [Workload(64, 8, 2, False, 32, tiny_model).get(i).prompt for i in range(20)]
    assert all(len(tok.encode(p).ids) == 64 for p in prompts)
    leading = {tuple(tok.encode(p).ids[:24]) for p in prompts}
    assert len(leading) == 1  # the shared prefix
    chat = Workload(16, 8, seed=1, chat=True).get(0)
    assert chat.prompt is None and chat.messages[0]["role"] == "user"


def test_jsonl_datasets(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "one", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "two"}]}\n'
    )
    chat = jsonl_items(str(path), 16, chat=True)
    assert [r.max_tokens for r in chat] == [3, 16]
    assert chat[0].messages == [{"role": "user", "content": "one"}]
    with pytest.raises(ValueError, match="prompts.jsonl:3: needs a string `prompt`"):
        jsonl_items(str(path), 16, chat=False)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        jsonl_items(str(tmp_path / "bad.jsonl"), 16, chat=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_requests": None}, "bound the run"),
        ({"concurrency": 0}, "--concurrency must be >= 1"),
        ({"request_rate": -1.0}, "--request-rate must be > 0"),
        ({"shared_prefix_len": 200, "input_len": 100}, "--shared-prefix-len"),
        ({"url": "localhost:8000"}, "must start with http"),
    ],
)
def test_invalid_bench_settings_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)
