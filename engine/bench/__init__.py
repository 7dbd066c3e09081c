"""``pdfleet bench``: a serving benchmark for any OpenAI-compatible endpoint.

Also a library (the autoscaling end-to-end test and the benchmark scripts use
it)::

    from pdfleet.engine.bench import BenchConfig, run_benchmark

    result = run_benchmark(BenchConfig(url="http://127.0.0.1:8000", num_requests=50,
                                       concurrency=8, input_len=256, output_len=32))
    print(result.ttft_ms["p50"], result.request_throughput)

``arun_benchmark`` is the same coroutine for callers already in an event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from .config import BenchConfig
from .report import BenchResult, format_report, summarize
from .runner import RequestResult, run_load

__all__ = [
    "BenchConfig",
    "BenchResult",
    "RequestResult",
    "arun_benchmark",
    "format_report",
    "run_benchmark",
]


async def arun_benchmark(config: BenchConfig, stop: threading.Event | None = None) -> BenchResult:
    results, elapsed = await run_load(config, stop)
    result = summarize(results, elapsed, config)
    if config.plot:
        from .plot import plot_bench

        plot_bench(results, elapsed, config.plot)
    if config.json:
        Path(config.json).write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True))  # noqa: ASYNC240 (one small write after the run)
    return result


def run_benchmark(config: BenchConfig, stop: threading.Event | None = None) -> BenchResult:
    """Run one benchmark to completion (bounded by its request count/duration),
    or until ``stop`` is set (from another thread): then no new request is sent
    and the result covers those sent."""
    return asyncio.run(arun_benchmark(config, stop))
