"""Structured-output overhead: decode step time at batch 32, every request
JSON-schema constrained, against the same batch unconstrained, in one run.

The built-in tiny model at its default size (what `pdfleet up` serves with no
model given), one torch thread, greedy. Both batches decode the same 32
prompts for the same number of steps; the constrained schema (an array of at
least 40 small objects) cannot finish within them, so all 32 rows stay
constrained for every measured step. Runs alternate (free, constrained) and
the median step time of each is compared. The first request's grammar compile
time (importing the library and indexing the tokenizer, then compiling the
schema; with the compile worker processes starting) is reported separately.
Target: <= 10% per step. Rerun:

    .venv/bin/python benchmarks/structured_overhead.py --json benchmarks/results/structured_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

BATCH = 32
STEPS = 48
SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "ok"],
        "additionalProperties": False,
    },
}


def decode_steps(engine, params, tag: str) -> list[float]:
    """Wall time of each decode step of a batch of BATCH requests."""
    for i in range(BATCH):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": [1, 10 + i, 20 + i, 30]}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        stats_before = engine.core.num_steps
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        running = engine.stats.num_running_reqs
        # Count only full-batch decode steps (the first step prefills).
        if stats_before > 0 and running == BATCH and len(times) < STEPS:
            times.append(elapsed)
    return times[1:]  # the first decode step still carries prefill-shaped work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from pdfleet.engine import LLM, SamplingParams
    from pdfleet.engine.sample.grammar import GrammarCompiler
    from pdfleet.engine.sampling_params import StructuredOutputsParams
    from pdfleet.engine.tiny.builder import ensure_tiny_model

    model = ensure_tiny_model()
    llm = LLM(model, max_model_len=512, max_num_seqs=BATCH, enforce_eager=True)
    engine = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA)

    # First-request compile cost, on a fresh compiler.
    start = time.perf_counter()
    fresh = GrammarCompiler(engine.tokenizer, engine.config.model_config.vocab_size, (1,))
    setup_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    fresh.compile(spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    fresh.compile(StructuredOutputsParams(json=SCHEMA))  # a new request: the cache's hit
    cached_ms = (time.perf_counter() - start) * 1e3
    fresh.close()

    free = SamplingParams(temperature=0.0, max_tokens=STEPS + 4, ignore_eos=True)
    constrained = free.clone(ignore_eos=False, structured_outputs=spec)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, free.clone(max_tokens=4))  # warm up
    engine.grammars.compile(spec)  # the server compiles before admission too
    free_runs, constrained_runs = [], []
    for r in range(args.repeats):
        free_runs += decode_steps(engine, free, f"free{r}")
        constrained_runs += decode_steps(engine, constrained, f"json{r}")
    free_ms = statistics.median(free_runs) * 1e3
    json_ms = statistics.median(constrained_runs) * 1e3
    result = {
        "benchmark": "structured_overhead",
        "model": "built-in tiny (default size)",
        "batch": BATCH,
        "decode_steps_measured": {"free": len(free_runs), "json_schema": len(constrained_runs)},
        "step_ms_median": {"free": round(free_ms, 3), "json_schema": round(json_ms, 3)},
        "overhead_per_step": round(json_ms / free_ms - 1, 4),
        "target_overhead": 0.10,
        "first_request": {
            "import_and_tokenizer_setup_ms": round(setup_ms, 2),
            "schema_compile_ms": round(compile_ms, 2),
            "cached_compile_ms": round(cached_ms, 4),
        },
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
