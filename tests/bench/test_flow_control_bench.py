"""The flow-control benchmark's n=64 vs n=1 count: tokens by arrival in a window."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys

import pytest
from helpers.scripts import BENCHMARKS, benchmark_module


@pytest.fixture(scope="module")
def bench():
    yield from benchmark_module("flow_control")


def chunk(index: int, prompt: int, done: int, text: str = "x") -> bytes:
    """A streamed completion chunk as the engine writes it (compact JSON, vLLM's
    continuous usage: the choice's own prompt and tokens so far)."""
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
        },
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode()


def test_a_chunk_gives_its_choice_and_counts(bench):
    m = bench._CHUNK_USAGE.search(chunk(37, 11, 5, text='"index":9 "prompt_tokens":1'))
    assert m is not None and (int(m[1]), int(m[2]), int(m[3])) == (37, 11, 5)
    final = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 9}}
    assert bench._CHUNK_USAGE.search(json.dumps(final).encode()) is None


def test_tokens_count_by_arrival_within_the_window(bench):
    # A wide request: two choices, 4 tokens each, one a second from t=0; the
    # window [1.5, 3.5) holds the chunks at 2 and 3: 2 tokens of each choice.
    wide = [(float(t), c, 10, t + 1) for t in range(4) for c in (0, 1)]
    # Whole inside it: its 3 tokens and its prompt (first chunk inside).
    inside = [(2.0, 0, 7, 1), (2.5, 0, 7, 2), (3.0, 0, 7, 3)]
    # Started before it: its tokens inside, not its prompt; one ending after it.
    before = [(1.0, 0, 5, 1), (2.0, 0, 5, 2)]
    after = [(3.0, 0, 6, 1), (4.0, 0, 6, 2)]
    assert bench.in_window([wide], 1.5, 3.5) == (4, 0)
    assert bench.in_window([inside], 1.5, 3.5) == (3, 7)
    assert bench.in_window([before, after, []], 1.5, 3.5) == (2, 6)
    assert bench.in_window([wide, inside, before, after], 0.0, 10.0) == (8 + 3 + 2 + 2, 28)


def test_the_flood_is_sent_from_a_process_of_lower_priority(monkeypatch):
    # The benchmark by its own name, which the spawned process imports too.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "flow_control", raising=False)
    bench = importlib.import_module("flow_control")
    # Nothing listens on port 1: each request fails at once; what matters is
    # where they were sent from.
    args = argparse.Namespace(flood_nice=3, phase_seconds=0.2, timeout=5.0)
    try:
        outcomes, _, niceness = asyncio.run(
            bench.flood_load(args, "http://127.0.0.1:1", "k", {"model": "tiny"}, 20.0)
        )
    finally:
        if bench._FLOOD_POOL is not None:
            bench._FLOOD_POOL.shutdown()
    assert niceness == min(19, os.nice(0) + 3)
    assert outcomes and {o for o, _, _ in outcomes} == {"ConnectError"}
