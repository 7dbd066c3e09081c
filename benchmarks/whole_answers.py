"""An engine under a flood of requests answered whole (not streamed): the
server process's CPU per output token, throughput, mean step, and a probe's
TTFT, for this checkout and for other trees, interleaved.

A request answered whole gets one output at its end from the engine thread;
before that it got a delta each step, which woke the event loop (and took the
GIL from the stepping thread) for every running request every step. This
measures what that saves: ``--concurrency`` closed-loop clients send
``--max-tokens``-token requests to one engine on one torch thread for
``--seconds``, while a probe sends a 2-token streamed request every 0.2 s.

    .venv/bin/python benchmarks/whole_answers.py [--rounds 3] [--json OUT] [TREE ...]

A TREE is a directory holding a ``pdfleet/`` copy of another commit's packages
(``git archive REV engine kernels operator | tar -x -C TREE/pdfleet``), put
first on the engine's PYTHONPATH; ``.`` is this checkout (the default). The
CPU per token is the figure a loaded machine moves least; the load average is
printed with each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from fleet import Fleet, engine_env, metric, tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


async def load(url: str, concurrency: int, seconds: float, max_tokens: int) -> tuple[float, list]:
    """(output tokens a second, the probe's TTFTs)."""
    tokens = 0
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]
        stop = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal tokens
            body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
            while time.monotonic() < stop:
                r = await c.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                if time.monotonic() < stop:
                    tokens += r.json()["usage"]["completion_tokens"]

        async def probe() -> None:
            body = {"model": model, "prompt": "Hi there", "max_tokens": 2, "stream": True}
            await asyncio.sleep(1.0)
            while time.monotonic() < stop - 1:
                t0 = time.monotonic()
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"text"' in line:
                            ttfts.append(time.monotonic() - t0)
                            break
                await asyncio.sleep(0.2)

        await asyncio.gather(*(worker() for _ in range(concurrency)), probe())
    return tokens / seconds, ttfts


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(tree: str, model: str, args: argparse.Namespace) -> dict:
    env = engine_env(1)
    if tree != ".":
        env["PYTHONPATH"] = str(Path(tree).resolve())
    with Fleet(Path(tempfile.mkdtemp(prefix="whole-answers-"))) as fleet:
        url = fleet.start("engine", ["serve", model, "--disable-log-stats"], env=env)
        fleet.wait_healthy([url])
        pid = fleet.procs[0][0].pid
        asyncio.run(load(url, 8, 3, args.max_tokens))  # warm
        step = "pdfleet_engine_step_duration_seconds"
        s0, n0, c0 = metric(url, step + "_sum"), metric(url, step + "_count"), cpu_seconds(pid)
        rate, ttfts = asyncio.run(load(url, args.concurrency, args.seconds, args.max_tokens))
        s1, n1, c1 = metric(url, step + "_sum"), metric(url, step + "_count"), cpu_seconds(pid)
    q = statistics.quantiles(ttfts, n=10)
    return {
        "tree": tree,
        "cpu_ms_per_100_tokens": round((c1 - c0) / (rate * args.seconds) * 1e5, 2),
        "tokens_per_s": round(rate),
        "mean_step_ms": round((s1 - s0) / max(1.0, n1 - n0) * 1e3, 2),
        "probe_ttft_p50_ms": round(q[4] * 1e3, 1),
        "probe_ttft_p90_ms": round(q[8] * 1e3, 1),
        "probes": len(ttfts),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trees", nargs="*", default=["."])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json", help="write the runs to this file")
    args = ap.parse_args()
    model = tiny_model()
    runs = []
    for _ in range(args.rounds):
        for tree in args.trees:
            runs.append(one(tree, model, args))
            print(json.dumps(runs[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": vars(args), "runs": runs}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
