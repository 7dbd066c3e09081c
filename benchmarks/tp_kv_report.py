"""Per-step cost of a KV consumer's ranks reporting their ended reads.

Since engines may span nodes (docs/parallelism.md, "P/D with engines that span
nodes") every rank of a consumer reports the reads that ended in one gather
over the control group (gloo; the main process is its root), instead of a
message on its pipe to the main process (which only ranks on the leader's
node have). This measures both ways on one host, in this script: the main
process broadcasts a step header, each of ``--ranks`` rank processes answers
(one pipe message with an msgpack list, or its part of the gather: the
fixed-size tensor of ``worker/tp_rank.ended_tensor``) and the main process
waits for all of them. Reported: the round trip per step of each, and their
difference (what the gather costs over the pipe, per step). The numbers move
with the host's load (minimum over ``--repeats``). Rerun:

    .venv/bin/python benchmarks/tp_kv_report.py --json benchmarks/results/tp_kv_report_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import time

import msgpack
import torch
import torch.distributed as dist

from pdfleet.engine.distributed import rendezvous
from pdfleet.engine.worker.tp_rank import KV_REPORT_SLOTS, ended_of, ended_tensor

ENDED = [[7, "DONE", 1 << 20]]  # one read ended this step


def _rank(rank: int, size: int, port: int, mode: str, steps: int, conn) -> None:
    torch.set_num_threads(1)
    store = rendezvous.client_store("127.0.0.1", port, size + 1, 60)
    ctl = rendezvous.control_group(store, rank + 1, size + 1, datetime.timedelta(seconds=60))
    opts, gather = dist.BroadcastOptions(), dist.GatherOptions()
    opts.rootRank = gather.rootRank = 0
    header = torch.zeros(2, dtype=torch.int64)
    for _ in range(steps):
        ctl.broadcast([header], opts).wait()
        if mode == "pipe":
            conn.send_bytes(b"K" + msgpack.packb(ENDED))
        else:
            ctl.gather([], [ended_tensor(ENDED)], gather).wait()


def measure(mode: str, size: int, steps: int) -> float:
    """Seconds per step: broadcast a header, wait for every rank's report."""
    torch.set_num_threads(1)
    store = rendezvous.master_store("127.0.0.1", 0, size + 1, 60)
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank, args=(rank, size, store.port, mode, steps, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    ctl = rendezvous.control_group(store, 0, size + 1, datetime.timedelta(seconds=60))
    opts, gather = dist.BroadcastOptions(), dist.GatherOptions()
    opts.rootRank = gather.rootRank = 0
    header = torch.zeros(2, dtype=torch.int64)
    warm = min(50, steps // 5)
    start = 0.0
    for step in range(steps):
        if step == warm:
            start = time.perf_counter()
        ctl.broadcast([header], opts).wait()
        if mode == "pipe":
            for conn in pipes:
                assert msgpack.unpackb(conn.recv_bytes()[1:], raw=False) == ENDED
        else:
            tensors = [
                torch.zeros(1 + 3 * KV_REPORT_SLOTS, dtype=torch.int64) for _ in range(size + 1)
            ]
            ctl.gather([tensors], [tensors[0].clone()], gather).wait()
            assert all(ended_of(t) == ENDED for t in tensors[1:])
    seconds = (time.perf_counter() - start) / (steps - warm)
    for proc in procs:
        proc.join(30)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    best = {
        mode: min(measure(mode, args.ranks, args.steps) for _ in range(args.repeats))
        for mode in ("pipe", "gather")
    }
    result = {
        "benchmark": "tp_kv_report",
        "ranks": args.ranks,
        "steps": args.steps,
        "repeats": args.repeats,
        "host": platform.node(),
        "cpus": multiprocessing.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "step_roundtrip_ms": {mode: round(s * 1e3, 4) for mode, s in best.items()},
        "gather_minus_pipe_ms": round((best["gather"] - best["pipe"]) * 1e3, 4),
        "gather_over_pipe": round(best["gather"] / best["pipe"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
