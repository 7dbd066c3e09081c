"""The pull-versus-recompute crossover, measured end to end on two engines.

Two aggregated ``kv_both`` engines (a holder and a puller, NIXL in host memory).
For each prefix length, with a prompt of that prefix and a short tail, cached
on the holder only, the puller serves it two ways, one right after the other
(the order alternates between repetitions):

* ``pull``: the gateway's path without the gateway: a lend request to the
  holder (``pdfleet_lend_blocks``), then the request on the puller with the
  signed params it returned (the puller pulls the blocks, computes the tail);
* ``recompute``: the same request on the puller, computed from scratch (a
  ``cache_salt`` of its own).

Each is timed from the first byte sent to the end of a one-token answer (the
time to the first token). Reported per length: the median of each, their ratio,
and the first length at which pulling was faster (the measured crossover);
next to it, the crossover the gateway's formula predicts from the same run's
measured figures: the lend time, the puller's prefill rate (prompt tokens over
prefill forward time) and the pull bandwidth (bytes over the pulls' seconds),
``lend / (1 / rate − bytes_per_token / bandwidth)`` (docs/peer-pull.md).

    .venv/bin/python benchmarks/peer_pull_crossover.py [--model builtin://smollm2-135m-instruct]
        [--lengths 64,128,256,512,1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fleet import Fleet, engine_env, free_port

from pdfleet.engine.contracts.metrics import parse_metrics
from pdfleet.engine.contracts.security import fleet_token

BLOCK = 16
PROMPT_TOKENS = "pdfleet_engine_prompt_tokens_total"
PREFILL_BUSY = "pdfleet_engine_prefill_busy_seconds_total"
PULL_BYTES = "pdfleet_engine_kv_peer_pull_bytes_total"
PULL_SECONDS = "pdfleet_engine_kv_peer_pull_seconds_total"


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    names = [PROMPT_TOKENS, PREFILL_BUSY, PULL_BYTES, PULL_SECONDS]
    scrape = parse_metrics(client.get(url + "/metrics").text, only=names)
    return {n: sum(v for _, v in scrape.samples.get(n, ())) for n in names}


def timed(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    return elapsed, r.json()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m-instruct")
    p.add_argument("--lengths", default="64,128,256,512,1024")
    p.add_argument("--tail", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", default="benchmarks/results/peer_pull_crossover_cpu.json")
    args = p.parse_args()
    model = args.model
    if model.startswith("builtin://"):
        # `pdfleet serve` takes a directory; `pdfleet up` resolves these itself.
        from pdfleet.engine.tiny.registry import builtin_model_dir

        model = builtin_model_dir(model.removeprefix("builtin://"))
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n % BLOCK for n in lengths):
        p.error(f"--lengths must be multiples of {BLOCK} (whole blocks)")
    max_len = max(lengths) + args.tail + 16
    secret = os.environ.get("PDFLEET_FLEET_SECRET") or "peer-pull-crossover-" + "0" * 32
    env = {**engine_env(args.threads), "PDFLEET_FLEET_SECRET": secret}
    headers = {"authorization": f"Bearer {fleet_token(secret.encode())}"}
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    with (
        Fleet(Path(tempfile.mkdtemp(prefix="pdfleet-crossover-"))) as fleet,
        httpx.Client(headers=headers, timeout=900) as client,
    ):
        urls = {}
        for name in ("holder", "puller"):
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": free_port()}
            urls[name] = fleet.start(
                name,
                [
                    "serve",
                    model,
                    "--max-model-len",
                    str(max_len),
                    "--disable-log-stats",
                    "--kv-transfer-config",
                    json.dumps(kv),
                ],
                env,
            )
        fleet.wait_healthy(list(urls.values()), timeout=900)
        holder, puller = urls["holder"], urls["puller"]
        # The first steps of a process are slower than the rest (allocation, caches).
        for url in (holder, puller):
            for i in range(2):
                warm = [rng.randrange(20, 20000) for _ in range(min(256, max(lengths)))]
                timed(client, url, {"prompt": warm, "max_tokens": 1, "cache_salt": f"w{i}"})
        lends: list[float] = []
        start = counters(client, puller)
        for n in lengths:
            got: dict[str, list[float]] = {"pull": [], "recompute": []}
            for rep in range(args.reps):
                prefix = [rng.randrange(20, 20000) for _ in range(n)]
                tail = [rng.randrange(20, 20000) for _ in range(args.tail)]
                body = {"prompt": prefix + tail, "max_tokens": 1, "temperature": 0}
                timed(client, holder, {"prompt": prefix, "max_tokens": 1})  # cached there
                for way in ("pull", "recompute") if rep % 2 == 0 else ("recompute", "pull"):
                    if way == "recompute":
                        s, _ = timed(client, puller, {**body, "cache_salt": f"r{n}-{rep}"})
                    else:
                        lend = {
                            **body,
                            "kv_transfer_params": {
                                "do_remote_decode": True,
                                "pdfleet_lend_blocks": n // BLOCK,
                            },
                        }
                        s_lend, answer = timed(client, holder, lend)
                        params = answer["kv_transfer_params"]
                        s_pull, _ = timed(client, puller, {**body, "kv_transfer_params": params})
                        lends.append(s_lend)
                        s = s_lend + s_pull
                    got[way].append(s)
                load.append(os.getloadavg()[0])
            pull, recompute = statistics.median(got["pull"]), statistics.median(got["recompute"])
            rows.append(
                {
                    "prefix_tokens": n,
                    "pull_s": round(pull, 4),
                    "recompute_s": round(recompute, 4),
                    "pull_over_recompute": round(pull / recompute, 3),
                    "pull_s_all": [round(x, 4) for x in got["pull"]],
                    "recompute_s_all": [round(x, 4) for x in got["recompute"]],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        end = counters(client, puller)
        block_bytes = parse_metrics(
            client.get(puller + "/metrics").text, only=["pdfleet_engine_kv_block_bytes"]
        ).samples.get("pdfleet_engine_kv_block_bytes", [({}, 0.0)])[0][1]
    rate = (end[PROMPT_TOKENS] - start[PROMPT_TOKENS]) / (end[PREFILL_BUSY] - start[PREFILL_BUSY])
    bandwidth = (end[PULL_BYTES] - start[PULL_BYTES]) / (end[PULL_SECONDS] - start[PULL_SECONDS])
    lend_s = statistics.median(lends)
    margin = 1 / rate - block_bytes / BLOCK / bandwidth
    predicted = lend_s / margin if margin > 0 else float("inf")
    measured = next((r["prefix_tokens"] for r in rows if r["pull_over_recompute"] < 1), None)
    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{os.cpu_count()} CPU cores, shared with other work; load average "
        f"{min(load):.1f}-{max(load):.1f} during the run",
        "model": args.model,
        "tail_tokens": args.tail,
        "reps": args.reps,
        "rows": rows,
        "measured_crossover_tokens": measured,
        "figures": {
            "prefill_tokens_per_s": round(rate, 1),
            "lend_s_median": round(lend_s, 4),
            "pull_bytes_per_s": round(bandwidth, 1),
            "kv_bytes_per_token": block_bytes / BLOCK,
        },
        "formula_crossover_tokens": round(predicted, 1),
    }
    text = json.dumps(out, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
