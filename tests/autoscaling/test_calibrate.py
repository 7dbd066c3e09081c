"""``pdfleet sim calibrate`` against a real tiny engine, and ``--fleet-model``."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from helpers.server import ServerProcess, fleet_headers

from pdfleet.engine.contracts import metrics as names
from pdfleet.engine.contracts.launch import python_module
from pdfleet.operator.autoscaling.samples import parse_engine_metrics, sample_from_snapshots
from pdfleet.operator.autoscaling_lab.calibrate import least_squares, load_fleet_model


def pdfleet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*python_module("pdfleet.engine.cli"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = ServerProcess(
        ["serve", tiny_model, "--max-model-len", "512", "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("calibrate"),
    )
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def calibrated(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "fleet_model.json"
    done = pdfleet(
        "sim",
        "calibrate",
        "--url",
        engine.url,
        "--out-file",
        str(out),
        "--prefill-repeats",
        "2",
        "--decode-output-tokens",
        "12",
        "--cold-start-seconds",
        "42",
    )
    assert done.returncode == 0, done.stderr
    return out, json.loads(out.read_text())


def test_calibrate_measures_prefill_decode_and_kv_capacity_of_a_real_engine(engine, calibrated):
    _, doc = calibrated
    model = doc["fleet_model"]
    assert model["prefill_tokens_per_second"] > 0
    assert model["decode_step_seconds"] > 0
    assert model["decode_step_seconds_per_seq"] >= 0
    assert model["decode_step_seconds_per_token"] >= 0
    assert model["cold_start_seconds"] == 42
    (measured,) = doc["engines"]
    assert {p["batch"] for p in measured["decode_points"]} == {1, 4, 8}
    assert len(measured["prefill_points"]) == 6
    # Measured, not assumed: a batch of 8 long streams steps slower than one
    # short stream, on the engine and in the fitted model.
    points = {
        (p["batch"], p["context_tokens"]): p["step_seconds"] for p in measured["decode_points"]
    }
    small, large = min(points), max(points)

    def fitted(batch: float, context: float) -> float:
        return (
            model["decode_step_seconds"]
            + model["decode_step_seconds_per_seq"] * batch
            + model["decode_step_seconds_per_token"] * context
        )

    assert points[large] > points[small], points
    assert fitted(*large) > fitted(*small), (model, points)
    # KV capacity is the engine's own cache configuration.
    text = httpx.get(engine.url + "/metrics", headers=fleet_headers(), timeout=10).text
    labels = names.parse_metrics(text).labels(names.ENGINE_CACHE_CONFIG.name)
    assert model["kv_capacity_tokens"] == int(labels["block_size"]) * int(labels["num_gpu_blocks"])


def test_sim_reads_the_calibrated_fleet_model_and_flags_still_win(calibrated):
    path, doc = calibrated
    done = pdfleet(
        "sim",
        "--fleet-model",
        str(path),
        "--duration",
        "60",
        "--rate",
        "2",
        "--strategies",
        "pdfleet",
        "--cold-start",
        "7",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    model = json.loads(done.stdout)["model"]
    for key in ("prefill_tokens_per_second", "decode_step_seconds", "kv_capacity_tokens"):
        assert model[key] == pytest.approx(doc["fleet_model"][key])
    assert model["cold_start_seconds"] == 7  # the flag, not the file's 42


def test_calibrate_names_an_unreachable_url(tmp_path):
    done = pdfleet(
        "sim", "calibrate", "--url", "http://127.0.0.1:9", "--out-file", str(tmp_path / "m.json")
    )
    assert done.returncode == 2
    assert "--url http://127.0.0.1:9" in done.stderr
    assert not (tmp_path / "m.json").exists()


def test_fleet_model_file_with_an_unknown_field_is_refused(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"fleet_model": {"prefill_tokens_per_sec": 1000}}))
    with pytest.raises(ValueError, match="unknown field prefill_tokens_per_sec"):
        load_fleet_model(str(path))


def test_least_squares_recovers_exact_coefficients():
    rows = [(1.0, b, c) for b in (1, 4, 8) for c in (10.0, 500.0)]
    ys = [0.002 + 0.0005 * b + 3e-6 * c for _, b, c in rows]
    a, b, c = least_squares(rows, ys)
    assert (a, b, c) == pytest.approx((0.002, 0.0005, 3e-6), rel=1e-6)


def test_a_real_engine_exports_the_request_rate_and_prompt_mix_the_policy_sizes_prefill_on(
    engine,
):
    # The policy sizes prefill on request arrivals times prompt tokens per
    # request (PolicyTuning.prefill_mix_seconds); both come from a real
    # engine's /metrics through the same parser and sample builder.
    def scrape(t: float):
        text = httpx.get(engine.url + "/metrics", headers=fleet_headers(), timeout=10).text
        return parse_engine_metrics(text, t)

    before = scrape(0.0)
    for i in range(6):
        prompt = [(97 * i + 13 * k) % 500 + 5 for k in range(40)]  # distinct: no cache hits
        r = httpx.post(
            engine.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
            headers=fleet_headers(),
            timeout=60,
        )
        assert r.status_code == 200, r.text
    after = scrape(10.0)
    sample = sample_from_snapshots("e0", after, before)
    assert sample.request_arrivals_per_second is not None
    assert sample.prompt_token_arrivals_per_second is not None
    assert sample.request_arrivals_per_second * 10.0 == pytest.approx(6)
    tokens_per_request = (
        sample.prompt_token_arrivals_per_second / sample.request_arrivals_per_second
    )
    assert tokens_per_request == pytest.approx(40)
