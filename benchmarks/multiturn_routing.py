"""Multi-turn chat behind two gateway replicas: round-robin vs approximate vs exact routing.

N users each hold a conversation; every turn appends the previous answer and
a new question, so most of each prompt repeats. Three aggregated engines
publish KV events; for each policy, fresh conversations run against them with
the users spread over two gateway replicas, a user's turns alternating
between them (as behind a load balancer), one turn per user at a time:

* ``round_robin`` — the client sends each request to the next engine directly;
* ``approximate`` — two gateways guessing prefixes from their own routing
  history (no KV events);
* ``exact`` — two gateways routing from the engines' KV events
  (docs/gateway.md, "Exact prefix routing");
* ``oracle`` — each conversation always goes to the engine that holds it
  (the engine it started on): the best hit rate any router could reach here.

Reported per policy: prefix hit rate (prompt tokens served from the engines'
prefix caches / prompt tokens, from the engines' own counters), TTFT p50/p99
(streamed, as the client sees it) and requests/s, in one JSON.

The CPU offload policy of the issue (exact routing with ``--kv-offload-bytes``)
is not run: the offload tier is not built yet.

    .venv/bin/python benchmarks/multiturn_routing.py [--users 12] [--turns 4]
        [--json benchmarks/results/multiturn_routing_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
from fleet import Fleet, engine_env, free_port, metric, tiny_model

ENGINES = 3
POLICIES = ("round_robin", "approximate", "exact", "oracle")


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def stream_ttft(client: httpx.AsyncClient, url: str, messages: list[dict], n: int):
    """(TTFT seconds, reply text) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts)


def hit_counters(engines: list[str]) -> tuple[float, float]:
    hits = sum(metric(e, "pdfleet_engine_prefix_cache_hits_total") for e in engines)
    queries = sum(metric(e, "pdfleet_engine_prefix_cache_queries_total") for e in engines)
    return hits, queries


def served(engines: list[str]) -> list[float]:
    return [metric(e, "pdfleet_engine_request_success_total") for e in engines]


async def run_policy(policy: str, engines: list[str], gateways: list[str], args, seed: int):
    convs = [
        [
            {
                "role": "system",
                "content": f"User {seed}-{u}. " + "You are a helpful and concise assistant. " * 8,
            }
        ]
        for u in range(args.users)
    ]
    home: dict[int, str] = {}
    ttfts: list[float] = []
    h0, q0 = hit_counters(engines)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        for turn in range(args.turns):

            async def one(u: int, url: str, turn: int = turn) -> None:
                convs[u].append(
                    {"role": "user", "content": f"Turn {turn}: tell me about topic {u}. " * 4}
                )
                ttft, reply = await stream_ttft(client, url, convs[u], args.max_tokens)
                ttfts.append(ttft)
                convs[u].append({"role": "assistant", "content": reply})

            targets = []
            for u in range(args.users):
                if policy == "round_robin":
                    # Rotating: a user's next turn goes to the next engine.
                    targets.append(engines[(u + turn) % len(engines)])
                elif policy == "oracle":
                    targets.append(home.setdefault(u, engines[u % len(engines)]))
                else:
                    targets.append(gateways[(u + turn) % len(gateways)])
            sem = asyncio.Semaphore(args.concurrency)

            async def limited(u: int, url: str, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await one(u, url)

            await asyncio.gather(*(limited(u, url) for u, url in enumerate(targets)))
    elapsed = time.perf_counter() - t0
    h1, q1 = hit_counters(engines)
    requests = args.users * args.turns
    return {
        "prefix_hit_rate": round((h1 - h0) / max(1.0, q1 - q0), 4),
        "ttft_p50_s": round(quantile(ttfts, 0.5), 4),
        "ttft_p99_s": round(quantile(ttfts, 0.99), 4),
        "requests_per_s": round(requests / elapsed, 3),
        "requests": requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default="benchmarks/results/multiturn_routing_cpu.json")
    args = ap.parse_args()
    model = args.model or tiny_model()
    log_dir = Path(tempfile.mkdtemp(prefix="pdfleet-multiturn-"))
    results: dict[str, object] = {"config": vars(args) | {"engines": ENGINES, "gateways": 2}}
    with Fleet(log_dir) as fleet:
        ports = [(free_port(), free_port()) for _ in range(ENGINES)]
        engines = []
        for i, (pub, rep) in enumerate(ports):
            events = {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{rep}",
            }
            engines.append(
                fleet.start(
                    f"engine{i}",
                    [
                        "serve",
                        model,
                        "--served-model-name",
                        "tiny",
                        "--max-model-len",
                        "2048",
                        "--disable-log-stats",
                        "--kv-events-config",
                        json.dumps(events),
                    ],
                    engine_env(args.threads),
                )
            )
        files = {}
        for kind in ("approximate", "exact"):
            entries = []
            for url, (pub, rep) in zip(engines, ports, strict=True):
                entry = {"url": url, "role": "decode"}
                if kind == "exact":
                    entry |= {
                        "kv_events": f"tcp://127.0.0.1:{pub}",
                        "kv_events_replay": f"tcp://127.0.0.1:{rep}",
                    }
                entries.append(entry)
            files[kind] = log_dir / f"engines-{kind}.json"
            files[kind].write_text(json.dumps({"engines": entries}))
        gateways = {
            kind: [
                fleet.start(
                    f"gateway-{kind}-{r}",
                    [
                        "gateway",
                        "--host",
                        "127.0.0.1",
                        "--engines-file",
                        str(files[kind]),
                        "--disaggregation-mode",
                        "Disabled",
                        "--tokenizer",
                        model,
                        "--scrape-interval",
                        "0.5",
                    ],
                )
                for r in range(2)
            ]
            for kind in ("approximate", "exact")
        }
        fleet.wait_healthy(engines + [g for gs in gateways.values() for g in gs])
        for seed, policy in enumerate(POLICIES):
            gws = gateways.get(policy, [])
            results[policy] = asyncio.run(run_policy(policy, engines, gws, args, seed))
            print(policy, results[policy], flush=True)
    oracle = results["oracle"]["prefix_hit_rate"]  # type: ignore[index]
    exact = results["exact"]["prefix_hit_rate"]  # type: ignore[index]
    results["exact_vs_oracle_hit_rate"] = round(exact / oracle, 4) if oracle else None
    print(json.dumps(results, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
