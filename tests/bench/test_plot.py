"""`pdfleet bench --plot`: latency percentiles and throughput over time."""

from __future__ import annotations

import random

from helpers.pictures import assert_picture

from pdfleet.engine.bench.plot import bin_seconds, plot_bench
from pdfleet.engine.bench.runner import RequestResult


def test_bench_plot_draws_percentiles_and_throughput_per_time_bin(tmp_path):
    rng = random.Random(0)
    results = [
        RequestResult(
            ok=i % 17 != 0,
            start=i * 0.1,
            ttft=0.05 + rng.random() * 0.02 * (1 + i // 100),
            e2e=0.5 + rng.random() * 0.2,
            output_tokens=32,
        )
        for i in range(400)
    ]
    out = tmp_path / "bench.png"
    plot_bench(results, 40.5, str(out))
    assert_picture(out, (640, 520))


def test_bench_plot_bins_stay_few_on_long_runs():
    assert bin_seconds(30) == 1.0
    assert 3600 / bin_seconds(3600) <= 60
