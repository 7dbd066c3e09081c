"""Gateway overhead: latency via the gateway minus direct to the same engine.

One engine and one gateway in front of it with decode-only routing
(``--disaggregation-mode Disabled``: the gateway still parses the body,
analyzes the prompt, scores engines and relays every event). Requests go one
at a time (queueing would hide the gateway's own cost), alternately direct and
via the gateway, each with a fresh prompt of the same length (prefix caching
is off): every gateway request has a direct twin sent a moment before or
after it, so machine drift hits both alike. Prints TTFT and ITL p50/p99 of
both paths, their difference, and the median of the per-pair TTFT
differences (target: ≤ 2 ms added at p50).

    .venv/bin/python benchmarks/gateway_overhead.py [--pairs 200] [--model DIR]
        [--tokenizer] [--engine-threads 1] [--json PATH]

``--tokenizer`` gives the gateway the model's tokenizer (exact token counts,
as Conditional mode uses) instead of its character estimate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import httpx
from fleet import Fleet, engine_env, tiny_model

from pdfleet.engine.bench import BenchConfig
from pdfleet.engine.bench.dataset import Workload
from pdfleet.engine.bench.report import distribution_ms
from pdfleet.engine.bench.runner import RequestResult, request_body, send_one


async def measure(engine: str, gateway: str, args: argparse.Namespace) -> dict:
    configs = {
        side: BenchConfig(
            url=url, num_requests=1, input_len=args.input_len, output_len=args.output_len
        )
        for side, url in (("direct", engine), ("gateway", gateway))
    }
    workload = Workload(args.input_len, args.output_len, seed=0, chat=False, tokenizer=args.model)
    model = httpx.get(engine + "/v1/models", timeout=10).json()["data"][0]["id"]  # noqa: ASYNC210 (once, before the timed loop starts)
    results: dict[str, list[RequestResult]] = {"direct": [], "gateway": []}
    async with httpx.AsyncClient(timeout=60) as direct, httpx.AsyncClient(timeout=60) as via:
        clients = {"direct": direct, "gateway": via}
        for i in range(-args.warmup, args.pairs):
            order = ("direct", "gateway") if i % 2 else ("gateway", "direct")
            for k, side in enumerate(order):
                body = request_body(configs[side], model, workload.get(2 * (i + args.warmup) + k))
                r = await send_one(clients[side], configs[side], "/v1/completions", body, 0.0)
                if not r.ok:
                    raise RuntimeError(f"{side} request failed: {r.error}")
                if i >= 0:  # the first requests warm connections and shapes
                    results[side].append(r)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tokenizer", action="store_true", help="gateway counts with --tokenizer")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of the engine (0: unset)"
    )
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    model = args.model = args.model or tiny_model()
    log_dir = Path(tempfile.mkdtemp(prefix="pdfleet-overhead-"))
    with Fleet(log_dir) as fleet:
        engine = fleet.start(
            "engine",
            ["serve", model, "--disable-log-stats", "--no-enable-prefix-caching"],
            env=engine_env(args.engine_threads),
        )
        fleet.wait_healthy([engine])
        gw_args = ["gateway", "--host", "127.0.0.1", "--decode", engine]
        gw_args += ["--disaggregation-mode", "Disabled"]
        if args.tokenizer:
            gw_args += ["--tokenizer", model]
        gateway = fleet.start("gateway", gw_args)
        fleet.wait_healthy([gateway])
        sides = asyncio.run(measure(engine, gateway, args))
    out: dict = {"config": vars(args), "logs": str(log_dir)}
    for side, results in sides.items():
        out[side] = {
            "ttft_ms": distribution_ms([x.ttft for x in results]),
            "itl_ms": distribution_ms([i for x in results for i in x.itls]),
        }
    out["added_ms"] = {
        m: {p: out["gateway"][m][p] - out["direct"][m][p] for p in ("p50", "p99")}
        for m in ("ttft_ms", "itl_ms")
    }
    pair_diffs = [
        1000 * (g.ttft - d.ttft) for g, d in zip(sides["gateway"], sides["direct"], strict=True)
    ]
    out["added_ttft_ms_median_of_pairs"] = statistics.median(pair_diffs)
    print(
        f"{'(ms)':<6}{'direct p50':>12}{'gateway p50':>13}{'added':>8}"
        f"{'direct p99':>12}{'gateway p99':>13}{'added':>8}"
    )
    for m in ("ttft_ms", "itl_ms"):
        d, g, a = out["direct"][m], out["gateway"][m], out["added_ms"][m]
        print(
            f"{m[:-3].upper():<6}{d['p50']:>12.2f}{g['p50']:>13.2f}{a['p50']:>8.2f}"
            f"{d['p99']:>12.2f}{g['p99']:>13.2f}{a['p99']:>8.2f}"
        )
    print(
        f"TTFT added, median of {args.pairs} paired requests: "
        f"{out['added_ttft_ms_median_of_pairs']:.2f} ms (target <= 2 ms at p50)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
