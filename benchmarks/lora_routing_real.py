"""Adapter routing through real processes: a gateway routing by residency vs
requests spread over the engines by load alone, same engines, same trace.

Two tiny-model engines (``--enable-lora --max-loras 1 --max-cpu-loras 2``)
both serve the same 6 adapters (loaded on each, as the operator and ``pdfleet
up`` do); one gateway in front of them (``--scrape-interval`` 1 s, the
default). A trace of requests (Zipf popularity s = 1.1 over the adapters,
short prompts, 8 tokens each) is sent by ``--concurrency`` client workers,
in rounds that alternate two policies so a shared machine's load falls on
both alike:

* ``residency``: through the gateway, which prefers the engine whose device
  slot (then host cache) holds the adapter, weighed against load;
* ``load``: to the engine with fewer of the client's own requests in flight
  (ties alternate): what routing by registration amounts to when every
  engine serves every adapter.

Measured from the engines' own counters, per request: device-slot evictions
(``pdfleet_engine_lora_evictions_total{tier="device"}``: a request that
found its adapter in a slot evicts nothing) and reads from disk
(``pdfleet_engine_lora_loads_total``: a request that found it in host memory
reads nothing). Both are costs a hit avoids, so lower is better; the ratio
residency / load is printed with them.

    .venv/bin/python -P benchmarks/lora_routing_real.py [--requests 240]
        [--json benchmarks/results/lora_routing_real_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fleet import Fleet, engine_env, tiny_model
from lora import write_adapter

ADAPTERS = 6
COUNTERS = {
    "device_evictions": ("pdfleet_engine_lora_evictions_total", {"tier": "device"}),
    "disk_reads": ("pdfleet_engine_lora_loads_total", {}),
}


def counters(engines: list[str]) -> dict[str, float]:
    """The engines' counters summed (their /metrics need the fleet token here)."""
    from pdfleet.engine.contracts.metrics import parse_metrics

    headers = {"Authorization": f"Bearer {os.environ['PDFLEET_BENCH_TOKEN']}"}
    out = dict.fromkeys(COUNTERS, 0.0)
    for url in engines:
        r = httpx.get(url + "/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        scrape = parse_metrics(r.text, only=[name for name, _ in COUNTERS.values()])
        for key, (name, labels) in COUNTERS.items():
            out[key] += sum(
                value
                for have, value in scrape.samples.get(name, ())
                if all(have.get(k) == v for k, v in labels.items())
            )
    return out


async def run_round(
    policy: str, trace: list[str], engines: list[str], gateway: str, concurrency: int
) -> None:
    """Send ``trace`` (adapter names, in order) with ``concurrency`` workers."""
    queue = list(reversed(trace))
    inflight = dict.fromkeys(engines, 0)
    turn = 0
    headers = {"Authorization": f"Bearer {os.environ['PDFLEET_BENCH_TOKEN']}"}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal turn
        while queue:
            adapter = queue.pop()
            if policy == "residency":
                url = gateway
            else:
                low = min(inflight.values())
                least = [u for u in engines if inflight[u] == low]
                url = least[turn % len(least)]
                turn += 1
            inflight[url] = inflight.get(url, 0) + 1
            try:
                body = {"model": adapter, "prompt": "hello there", "max_tokens": 8}
                body |= {"temperature": 0, "ignore_eos": True}
                r = await client.post(url + "/v1/completions", json=body, headers=headers)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
            finally:
                inflight[url] -= 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=240, help="per policy, over all rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from pdfleet.engine.config.model import ModelConfig

    model = tiny_model()
    tmp = Path(tempfile.mkdtemp(prefix="pdfleet-lora-routing-"))
    m = ModelConfig.from_model_dir("cpu", model)
    names = [f"a{i}" for i in range(ADAPTERS)]
    paths = {n: write_adapter(str(tmp / n), m, 8, i) for i, n in enumerate(names)}
    from pdfleet.engine.contracts import security

    # One fleet secret for the engines and the gateway; the client presents
    # its engine token (loads need it; completions accept it).
    os.environ[security.FLEET_SECRET_ENV] = os.urandom(16).hex()
    token = security.fleet_token(security.fleet_secret_from_env(dict(os.environ)) or b"")
    os.environ["PDFLEET_BENCH_TOKEN"] = token
    env = engine_env(args.threads)
    flags = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "8"]
    rng = random.Random(args.seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(ADAPTERS)]
    per_round = args.requests // args.rounds
    with Fleet(tmp / "logs") as fleet:
        engines = [
            fleet.start(
                f"engine{i}",
                ["serve", model, "--served-model-name", "tiny", "--disable-log-stats", *flags],
                env,
            )
            for i in range(2)
        ]
        fleet.wait_healthy(engines)
        headers = {"Authorization": f"Bearer {token}"}
        for url in engines:
            for name, path in paths.items():
                load = {"lora_name": name, "lora_path": path}
                r = httpx.post(url + "/v1/load_lora_adapter", json=load, headers=headers)
                r.raise_for_status()
        decode = [a for url in engines for a in ("--decode", url)]
        gateway = fleet.start(
            "gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                *decode,
                "--disaggregation-mode",
                "Disabled",
                "--tokenizer",
                model,
            ],
            env,
        )
        fleet.wait_healthy([gateway])
        totals = {policy: dict.fromkeys(COUNTERS, 0.0) for policy in ("residency", "load")}
        seconds = dict.fromkeys(totals, 0.0)
        for i in range(args.rounds):
            trace = rng.choices(names, weights, k=per_round)
            order = ("residency", "load") if i % 2 == 0 else ("load", "residency")
            for policy in order:
                before = counters(engines)
                start = time.perf_counter()
                asyncio.run(run_round(policy, trace, engines, gateway, args.concurrency))
                seconds[policy] += time.perf_counter() - start
                after = counters(engines)
                for key in COUNTERS:
                    totals[policy][key] += after[key] - before[key]
        load_avg = os.getloadavg()
    sent = per_round * args.rounds
    result: dict = {
        "engines": 2,
        "max_loras": 1,
        "max_cpu_loras": 2,
        "adapters": ADAPTERS,
        "requests_per_policy": sent,
        "concurrency": args.concurrency,
        "load_average": [round(x, 2) for x in load_avg],
    }
    for policy, got in totals.items():
        result[policy] = {key: round(value / sent, 3) for key, value in got.items()}
        result[policy]["seconds"] = round(seconds[policy], 1)
    result["ratio_residency_to_load"] = {
        key: round(totals["residency"][key] / totals["load"][key], 3)
        if totals["load"][key]
        else None
        for key in COUNTERS
    }
    shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
