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

Then the offload comparison, on fresh engines whose device KV cache holds half
of the working set (``--num-gpu-blocks-override``; the working set is the
conversations' final length in blocks, per engine), running a real model
(``--offload-model``, SmolLM2-135M by default: the tiny model's prefill costs
next to nothing, so its TTFT is the fixed HTTP and scheduling path) with
longer system prompts (``--offload-system-repeat``) so prefill is a real part
of TTFT:

* ``exact_small_cache`` — exact routing, that small device cache, no host tier;
* ``exact_offload`` — the same with ``--kv-offload-bytes`` (docs/kv_offload.md):
  blocks the small device cache evicts are loaded back from host memory.

Both fleets run side by side and take turns (A B, B A, ...), so a shared
machine's load falls on both alike; their assistant turns are a fixed text
(a random-weight model's replies re-tokenize to any length), which keeps the
working set known before the engines start.

Reported per policy: prefix hit rate (prompt tokens served from the engines'
prefix caches, either tier / prompt tokens, from the engines' own counters),
TTFT p50/p99 (streamed, as the client sees it) and requests/s, in one JSON;
for the offload rows also the TTFT p50 of a one-line chat (the fixed path).
The gateways run with ``--stall-timeout`` 120 s: at the 3 s default they eject
a CPU engine busy with one long prefill step (docs/gateway.md, "Stalls").

    .venv/bin/python benchmarks/multiturn_routing.py [--users 12] [--turns 4]
        [--json benchmarks/results/multiturn_routing_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def resolve_model(name: str) -> str:
    """A model directory: ``builtin://NAME`` prepared once (docs/models.md), else ``name``."""
    if name.startswith("builtin://"):
        from pdfleet.engine.tiny.registry import builtin_model_dir

        return builtin_model_dir(name.removeprefix("builtin://"), print)
    return name


async def short_ttft(gateways: list[str], n: int) -> float:
    """TTFT p50 of ``n`` fresh one-line chats through ``gateways``, one at a time:
    the fixed path (HTTP, gateway, tokenizing, scheduling, one decode step) with
    next to no prefill."""
    ttfts = []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(n):
            msgs = [{"role": "user", "content": f"Hi {i}."}]
            ttfts.append((await stream_ttft(client, gateways[i % len(gateways)], msgs, 1))[0])
    return quantile(ttfts, 0.5)


def first_messages(users: int, seed: int, system_repeat: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "system",
                "content": f"User {seed}-{u}. "
                + "You are a helpful and concise assistant. " * system_repeat,
            }
        ]
        for u in range(users)
    ]


def user_message(turn: int, u: int) -> dict:
    return {"role": "user", "content": f"Turn {turn}: tell me about topic {u}. " * 4}


def fixed_reply(u: int) -> dict:
    """The offload rows' assistant turns: a known text, so the working set is
    known before the engines start (a random-weight model's replies re-tokenize
    to any length)."""
    return {"role": "assistant", "content": f"Here is more about topic {u}."}


def working_set_blocks(
    model: str, args, users: int, system_repeat: int, turns: int, block_size: int = 16
) -> tuple[int, int]:
    """(blocks of every conversation at its last turn, tokens of the longest
    one), as the engines' chat template renders them (with fixed replies)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    total = longest = 0
    for u, conv in enumerate(first_messages(users, len(POLICIES) + 1, system_repeat)):
        for turn in range(turns):
            conv += [user_message(turn, u), fixed_reply(u)]
        text = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False)
        n = len(tok(text, add_special_tokens=False)["input_ids"]) + args.max_tokens
        total += -(-n // block_size)
        longest = max(longest, n)
    return total, longest


class PolicyRun:
    """One policy's conversations, played a turn at a time (so two policies can
    take turns in the same time window and see the same machine load)."""

    def __init__(
        self,
        policy: str,
        engines: list[str],
        gateways: list[str],
        args,
        seed: int,
        system_repeat: int = 8,
        fixed_replies: bool = False,
        users: int | None = None,
    ) -> None:
        self.policy, self.engines, self.gateways, self.args = policy, engines, gateways, args
        self.fixed_replies = fixed_replies
        self.users = args.users if users is None else users
        self.convs = first_messages(self.users, seed, system_repeat)
        self.home: dict[int, str] = {}
        self.ttfts: list[float] = []
        self.warm_ttfts: list[float] = []  # turns after the first (the prefix repeats)
        self.cold_ttfts: list[float] = []  # first turns: a miss with any cache
        self.elapsed = 0.0
        self.h0, self.q0 = hit_counters(engines)

    async def turn(self, client: httpx.AsyncClient, turn: int) -> None:
        args, convs = self.args, self.convs
        start = time.perf_counter()

        async def one(u: int, url: str) -> None:
            convs[u].append(user_message(turn, u))
            ttft, reply = await stream_ttft(client, url, convs[u], args.max_tokens)
            self.ttfts.append(ttft)
            (self.warm_ttfts if turn else self.cold_ttfts).append(ttft)
            convs[u].append(
                fixed_reply(u) if self.fixed_replies else {"role": "assistant", "content": reply}
            )

        targets = []
        for u in range(self.users):
            if self.policy == "round_robin":
                # Rotating: a user's next turn goes to the next engine.
                targets.append(self.engines[(u + turn) % len(self.engines)])
            elif self.policy == "oracle":
                targets.append(self.home.setdefault(u, self.engines[u % len(self.engines)]))
            else:
                targets.append(self.gateways[(u + turn) % len(self.gateways)])
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(u: int, url: str) -> None:
            async with sem:
                await one(u, url)

        await asyncio.gather(*(limited(u, url) for u, url in enumerate(targets)))
        self.elapsed += time.perf_counter() - start

    def result(self) -> dict[str, float]:
        h1, q1 = hit_counters(self.engines)
        queries = max(1.0, q1 - self.q0)
        host = sum(metric(e, "pdfleet_engine_kv_offload_hit_tokens_total") for e in self.engines)
        requests = len(self.ttfts)
        return {
            "prefix_hit_rate": round((h1 - self.h0) / queries, 4),
            "host_tier_hit_rate": round(host / queries, 4),
            "ttft_p50_s": round(quantile(self.ttfts, 0.5), 4),
            "ttft_p99_s": round(quantile(self.ttfts, 0.99), 4),
            "ttft_p50_after_first_turn_s": round(quantile(self.warm_ttfts, 0.5), 4),
            "ttft_p50_first_turn_s": round(quantile(self.cold_ttfts, 0.5), 4),
            "requests_per_s": round(requests / self.elapsed, 3),
            "requests": requests,
        }


async def run_policy(policy: str, engines: list[str], gateways: list[str], args, seed: int):
    run = PolicyRun(policy, engines, gateways, args, seed)
    async with httpx.AsyncClient(timeout=300) as client:
        for turn in range(args.turns):
            await run.turn(client, turn)
    return run.result()


async def run_alternating(runs: list[PolicyRun], turns: int) -> list[dict[str, float]]:
    """Turn by turn, the policies one after the other, in A B, B A, ... order."""
    async with httpx.AsyncClient(timeout=300) as client:
        for turn in range(turns):
            for run in runs if turn % 2 == 0 else runs[::-1]:
                await run.turn(client, turn)
    return [run.result() for run in runs]


def start_engines(
    fleet: Fleet,
    model: str,
    args,
    extra: list[str],
    max_model_len: int = 2048,
    name: str = "engine",
) -> tuple[list[str], list[tuple[int, int]]]:
    """Three aggregated engines publishing KV events; their URLs and event ports."""
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
                f"{name}{i}",
                [
                    "serve",
                    model,
                    "--served-model-name",
                    "tiny",
                    "--max-model-len",
                    str(max_model_len),
                    "--disable-log-stats",
                    "--kv-events-config",
                    json.dumps(events),
                    *extra,
                ],
                engine_env(args.threads),
            )
        )
    return engines, ports


def start_gateways(
    fleet: Fleet,
    model: str,
    engines: list[str],
    ports: list[tuple[int, int]],
    kind: str,
    stall_timeout: float,
) -> list[str]:
    """Two gateway replicas over ``engines``: ``exact`` follows their KV events,
    ``approximate`` guesses from its own routing history. ``stall_timeout``:
    the gateway's --stall-timeout (its 3 s default ejects a CPU engine busy with
    one long prefill step while another engine answers: a 504)."""
    entries = []
    for url, (pub, rep) in zip(engines, ports, strict=True):
        entry = {"url": url, "role": "decode"}
        if kind == "exact":
            entry |= {
                "kv_events": f"tcp://127.0.0.1:{pub}",
                "kv_events_replay": f"tcp://127.0.0.1:{rep}",
            }
        entries.append(entry)
    path = fleet.log_dir / f"engines-{kind}-{ports[0][0]}.json"
    path.write_text(json.dumps({"engines": entries}))
    return [
        fleet.start(
            f"gateway-{kind}-{ports[0][0]}-{r}",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--engines-file",
                str(path),
                "--disaggregation-mode",
                "Disabled",
                "--tokenizer",
                model,
                "--scrape-interval",
                "0.5",
                "--stall-timeout",
                str(stall_timeout),
            ],
        )
        for r in range(2)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--model", default=None, help="the routing rows' model (default: tiny)")
    ap.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="the gateways' --stall-timeout: long enough for one CPU prefill step",
    )
    ap.add_argument(
        "--offload-model",
        default="builtin://smollm2-135m-instruct",
        help="the offload rows' model: one whose prefill costs what a real one does",
    )
    ap.add_argument("--offload-users", type=int, default=9, help="users of the offload rows")
    ap.add_argument(
        "--offload-system-repeat",
        type=int,
        default=48,
        help="system prompt length of the offload comparison (repeats of one sentence)",
    )
    ap.add_argument("--offload-turns", type=int, default=6, help="turns of the offload rows")
    ap.add_argument(
        "--offload-bytes", default="256M", help="--kv-offload-bytes of the offload engines"
    )
    ap.add_argument("--skip-routing", action="store_true", help="run the offload rows only")
    ap.add_argument("--json", default="benchmarks/results/multiturn_routing_cpu.json")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="pdfleet-multiturn-"))
    out = Path(args.json)
    results: dict[str, object] = {}
    if args.skip_routing and out.exists():
        # Only the offload rows are new: keep the routing rows already there
        # (their config; the offload rows' is offload_config).
        results = json.loads(out.read_text())
        config = results.get("config", {})
        results["config"] = {k: v for k, v in config.items() if not k.startswith("offload")}
    if not args.skip_routing:
        model = resolve_model(args.model) if args.model else tiny_model()
        results["config"] = {k: v for k, v in vars(args).items() if not k.startswith("offload")} | {
            "engines": ENGINES,
            "gateways": 2,
        }
        with Fleet(log_dir / "routing") as fleet:
            engines, ports = start_engines(fleet, model, args, [])
            gateways = {
                kind: start_gateways(fleet, model, engines, ports, kind, args.stall_timeout)
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

    # Row 4: a device cache of half the working set, with and without the host tier.
    model = resolve_model(args.offload_model)
    repeat, users, turns = args.offload_system_repeat, args.offload_users, args.offload_turns
    total, longest = working_set_blocks(model, args, users, repeat, turns)
    working_set = -(-total // ENGINES)
    device_blocks = -(-working_set // 2)
    # One request must fit the small cache (and the cache holds max_model_len).
    max_len = device_blocks * 16
    if max_len < longest:
        raise SystemExit(
            f"the longest conversation ({longest} tokens) does not fit half the "
            f"working set ({max_len}); use more --offload-users"
        )
    results["offload_config"] = {
        "model": args.offload_model,
        "users": users,
        "turns": turns,
        "system_repeat": repeat,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "gateway_stall_timeout_s": args.stall_timeout,
        "working_set_blocks_per_engine": working_set,
        "device_blocks_per_engine": device_blocks,
        "kv_offload_bytes": args.offload_bytes,
        "longest_conversation_tokens": longest,
        "load_average_before": round(os.getloadavg()[0], 2),
    }
    small = ["--num-gpu-blocks-override", str(device_blocks)]
    rows = {
        "exact_small_cache": small,
        "exact_offload": [*small, "--kv-offload-bytes", args.offload_bytes],
    }
    with Fleet(log_dir / "offload") as fleet:
        fleets = {}
        for policy, extra in rows.items():
            engines, ports = start_engines(fleet, model, args, extra, max_len, policy)
            gws = start_gateways(fleet, model, engines, ports, "exact", args.stall_timeout)
            fleets[policy] = (engines, gws)
        fleet.wait_healthy([u for engines, gws in fleets.values() for u in engines + gws])
        # The fixed path, measured on the same fleets before the conversations.
        fixed = {p: asyncio.run(short_ttft(gws, 6)) for p, (_e, gws) in fleets.items()}
        runs = [
            PolicyRun("exact", engines, gws, args, len(POLICIES) + 1, repeat, True, users)
            for engines, gws in fleets.values()
        ]
        played = asyncio.run(run_alternating(runs, turns))
        for policy, row in zip(rows, played, strict=True):
            results[policy] = row | {"ttft_p50_short_prompt_s": round(fixed[policy], 4)}
            print(policy, results[policy], flush=True)
    results["offload_config"]["load_average_after"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    for key, field in (
        ("offload_ttft_p50_reduction", "ttft_p50_s"),
        ("offload_ttft_p50_after_first_turn_reduction", "ttft_p50_after_first_turn_s"),
    ):
        base = results["exact_small_cache"][field]  # type: ignore[index]
        off = results["exact_offload"][field]  # type: ignore[index]
        results[key] = round(1 - off / base, 4) if base else None
    print(json.dumps(results, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
