"""Per-step overhead of tensor parallelism on CPU: TP=2 against TP=1 at equal
total threads, with the collectives' own time beside it.

One tiny random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads) runs the
same greedy decode batch in one process at TP=1 with ``--threads`` threads
and at TP=2 (two gloo rank processes with ``--threads / 2`` threads each).
Reported per decode step: both step times, their difference (the overhead),
what the main process spends packing and broadcasting the step, and the
collectives a TP=2 step runs (one all-reduce per o/down projection and for
the embedding, one all-gather of the logits), each timed alone between two
gloo processes of the same sizes. On a loaded host the numbers move with the
load (they are the minimum over ``--repeats`` runs). Rerun:

    .venv/bin/python benchmarks/tp_overhead.py --json benchmarks/results/tp_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

# OpenMP threads that spin while they wait steal a shared core from the other
# process's threads; both sides wait passively (set before torch starts OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPEC = dict(
    arch="llama",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2048,
)


def _collective_worker(rank: int, port: int, shapes: dict, iters: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.randn(*shapes["all_reduce"])
    g = torch.randn(*shapes["all_gather"])
    parts = [torch.empty_like(g) for _ in range(2)]
    for _ in range(20):
        dist.all_reduce(x)
        dist.all_gather(parts, g)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    for _ in range(iters):
        dist.all_gather(parts, g)
    t2 = time.perf_counter()
    if rank == 0:
        out.put(((t1 - t0) / iters, (t2 - t1) / iters))
    dist.destroy_process_group()


def time_collectives(batch: int, hidden: int, vocab: int, iters: int) -> tuple[float, float]:
    """Seconds per all-reduce of [batch, hidden] and per all-gather of the logits."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shapes = {"all_reduce": (batch, hidden), "all_gather": (batch, vocab // 2)}
    procs = [
        ctx.Process(target=_collective_worker, args=(r, store.port, shapes, iters, q))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    result = q.get(timeout=300)
    for p in procs:
        p.join(30)
    return result


def decode_step_seconds(llm, batch: int, prompt_len: int, max_tokens: int, repeats: int):
    from pdfleet.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [8 + (i * 7 + j) % 2000 for j in range(prompt_len)]}
        for i in range(batch)
    ]
    llm.generate(prompts, sp)  # warm-up
    best = float("inf")
    core = llm.engine.core
    for _ in range(repeats):
        steps0 = core.num_steps
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        best = min(best, (time.perf_counter() - t0) / (core.num_steps - steps0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--threads", type=int, default=2, help="total threads (TP=1: all; TP=2: half each)"
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    from pdfleet.engine import LLM
    from pdfleet.engine.tiny.builder import TinyModelSpec, build_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(os.path.join(tmp, "m"), TinyModelSpec(**SPEC))
        engine = dict(max_model_len=256, max_num_seqs=args.batch)
        tp1 = LLM(path, **engine)
        step1 = decode_step_seconds(tp1, args.batch, 16, args.max_tokens, args.repeats)
        del tp1
        tp2 = LLM(path, tensor_parallel_size=2, **engine)
        try:
            step2 = decode_step_seconds(tp2, args.batch, 16, args.max_tokens, args.repeats)
            runner = tp2.engine.core.runner
            broadcast = runner.broadcast_seconds / runner.num_steps
        finally:
            tp2.engine.shutdown()
    all_reduce, all_gather = time_collectives(
        args.batch, SPEC["hidden_size"], SPEC["vocab_size"], 500
    )
    num_all_reduces = 2 * SPEC["num_hidden_layers"] + 1
    collectives = num_all_reduces * all_reduce + all_gather
    overhead = step2 - step1
    result = {
        "benchmark": "tp_overhead",
        "device": "cpu",
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_1m": round(os.getloadavg()[0], 2),
        },
        "model": SPEC,
        "threads_total": args.threads,
        "batch": args.batch,
        "decode_step_ms": {"tp1": round(step1 * 1e3, 3), "tp2": round(step2 * 1e3, 3)},
        "overhead_ms": round(overhead * 1e3, 3),
        "overhead_ratio": round(step2 / step1, 3),
        "step_broadcast_us": round(broadcast * 1e6, 1),
        "all_reduce_us": round(all_reduce * 1e6, 1),
        "all_gather_logits_us": round(all_gather * 1e6, 1),
        "collectives_per_step": {"all_reduce": num_all_reduces, "all_gather": 1},
        "collectives_ms_per_step": round(collectives * 1e3, 3),
        "overhead_beyond_collectives_and_broadcast_ms": round(
            (overhead - collectives - broadcast) * 1e3, 3
        ),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
