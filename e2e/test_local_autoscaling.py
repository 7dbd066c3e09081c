"""`pdfleet up` with decode autoscaling: load raises decode replicas, quiet brings them
back after the window, and no request fails while engines drain."""

from __future__ import annotations

import re
import threading
import time

import pytest
from helpers.server import wait_until
from helpers.up import Up, fleet_spec

from pdfleet.engine.bench import BenchConfig, run_benchmark


def decode_count(up: Up) -> int:
    return sum(1 for e in up.engines() if e["role"] == "decode")


def drains_finished(up: Up) -> bool:
    """Whether some decode engine was drained and every drained one has stopped."""
    out = up.output()
    drained = set(re.findall(r"draining (decode-\d+)", out))
    stopped = set(re.findall(r"(decode-\d+) stopped \(exit", out))
    return bool(drained) and drained <= stopped


@pytest.fixture(scope="module")
def scaled_fleet(tiny_model, tmp_path_factory):
    spec = fleet_spec(
        tiny_model,
        # A small decode engine: 4 sequences at once, 48 blocks of 16 tokens.
        decode={"replicas": 1, "engine": {"maxNumSeqs": 4, "numGpuBlocksOverride": 48}},
        disaggregation={"mode": "Disabled"},
        kvTransfer={},
        autoscaling={
            "periodSeconds": 1,
            "metricsStaleSeconds": 10,
            "decode": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "targetWaitingPerReplica": 2,
                # 6 s while the load falls decisively, else 20 s (the policy's
                # steady factor, 10/3).
                "scaleDownStabilizationSeconds": 6,
                "maxScaleUpStep": 2,
            },
            "prefill": {"minReplicas": 1, "maxReplicas": 1},
        },
    )
    up = Up(spec, tmp_path_factory.mktemp("autoscale"), "autoscale")
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()[-3000:]


def test_load_scales_decode_up_and_quiet_scales_it_back_without_failures(scaled_fleet):
    up = scaled_fleet
    assert decode_count(up) == 1
    results = {}

    def load(name: str, stop: threading.Event, concurrency: int) -> None:
        # Sends until ``stop`` is set (the duration only bounds a run gone wrong).
        config = BenchConfig(
            url=up.url,
            model="tiny",
            input_len=48,
            output_len=120,
            quiet=True,
            seed=1,
            concurrency=concurrency,
            duration=180.0,
            num_requests=None,
        )
        results[name] = run_benchmark(config, stop)

    # Heavy load until a second decode engine serves.
    heavy_done = threading.Event()
    heavy = threading.Thread(target=load, args=("heavy", heavy_done, 16))
    heavy.start()
    try:
        assert wait_until(lambda: decode_count(up) >= 2, 60, 0.5), up.output()[-3000:]
    finally:
        heavy_done.set()
        heavy.join(120)
    assert "autoscaler" in up.output() or "starting decode-1" in up.output()
    # A trickle keeps flowing while the extra engines drain and stop.
    trickle_done = threading.Event()
    trickle = threading.Thread(target=load, args=("trickle", trickle_done, 1))
    trickle.start()
    started = time.monotonic()
    try:
        assert wait_until(lambda: decode_count(up) == 1, 120, 0.5), up.output()[-3000:]
        quiet_for = time.monotonic() - started
        # ... and the trickle runs on until every drained engine has stopped.
        assert wait_until(lambda: drains_finished(up), 60, 0.5), up.output()[-3000:]
    finally:
        trickle_done.set()
        trickle.join(120)
    # Not before the down window (at least 6 s) has passed since the load
    # stopped (less two periods: the last busy sample may precede the stop).
    assert quiet_for >= 4
    assert set(results) == {"heavy", "trickle"}
    for name, result in results.items():
        assert result.failed == 0, (name, result.errors)
        assert result.completed > 0
