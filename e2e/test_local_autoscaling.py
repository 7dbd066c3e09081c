"""`pdfleet up` with decode autoscaling: load raises decode replicas, quiet brings them
back after the window, and no request fails while engines drain."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.server import wait_until
from helpers.up import Up, fleet_spec

from pdfleet.engine.bench import BenchConfig, run_benchmark


def decode_count(up: Up) -> int:
    return sum(1 for e in up.engines() if e["role"] == "decode")


@pytest.fixture(scope="module")
def scaled_fleet(tiny_model, tmp_path_factory):
    spec = fleet_spec(
        tiny_model,
        # A small decode engine: 4 sequences at once, 48 blocks of 16 tokens.
        decode={"replicas": 1, "engine": {"maxNumSeqs": 4, "numGpuBlocksOverride": 48}},
        disaggregation={"mode": "Disabled"},
        kvTransfer={},
        autoscaling={
            "periodSeconds": 2,
            "metricsStaleSeconds": 10,
            "decode": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "targetWaitingPerReplica": 2,
                "scaleDownStabilizationSeconds": 12,
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

    def load(name: str, **kw) -> None:
        results[name] = run_benchmark(
            BenchConfig(
                url=up.url, model="tiny", input_len=48, output_len=120, quiet=True, seed=1, **kw
            )
        )

    heavy = threading.Thread(
        target=load,
        args=("heavy",),
        kwargs={"concurrency": 16, "duration": 20.0, "num_requests": None},
    )
    heavy.start()
    try:
        assert wait_until(lambda: decode_count(up) >= 2, 60, 0.5), up.output()[-3000:]
    finally:
        heavy.join(120)
    assert "autoscaler" in up.output() or "starting decode-1" in up.output()
    # A trickle keeps flowing while the extra engines drain and stop.
    trickle = threading.Thread(
        target=load,
        args=("trickle",),
        kwargs={"concurrency": 1, "duration": 20.0, "num_requests": None},
    )
    trickle.start()
    started = time.monotonic()
    try:
        assert wait_until(lambda: decode_count(up) == 1, 120, 0.5), up.output()[-3000:]
    finally:
        trickle.join(120)
    # Not before the down window (12 s) has passed since the load stopped.
    assert time.monotonic() - started >= 8
    assert "draining decode" in up.output()
    for name, result in results.items():
        assert result.failed == 0, (name, result.errors)
        assert result.completed > 0
