"""Peer pulls: a fleet-wide prefix cache against exact routing and holder-only routing.

Three ``pdfleet up`` fleets of N aggregated engines (the same resource file but
for ``spec.decode.peerPull``) run the same three traces, built from a seed so
every setup sends the same requests (token-id prompts, streamed completions,
TTFT measured at the client):

* ``multiturn`` — users in conversation: each turn is the previous prompt plus
  an answer and a new question, one turn per user at a time;
* ``forks`` — agent forks: families start every ``--family-gap`` seconds with a
  parent request holding a long prefix; once it is answered a burst of
  ``--forks`` requests sharing that prefix (each with its own tail) arrives at
  once, while other families' parents and bursts keep engines busy;
* ``tenants`` — tenants' shared system prompts: requests arrive at random
  (Poisson, ``--rate`` per second), each a tenant's long system prompt plus a
  short user message.

Setups:

* ``exact`` — the gateway's exact prefix routing (KV events), no peer pulls:
  a burst beyond the holder's share goes to engines that recompute the prefix;
* ``pull`` — the same with ``spec.decode.peerPull: true``: per request the
  gateway serves on the holder, pulls the prefix into another engine, or
  recomputes, by measured cost (docs/peer-pull.md);
* ``holder`` — holder-only routing: the client sends every request to the
  engine that first computed its prefix (directly, with the fleet token), on
  the ``exact`` fleet's engines with prompts of its own (same shape);
* ``exact_aa`` — an A/A control: ``exact`` once more, on the same fleet, with
  prompts of its own of the same shape. Set against ``exact`` it shows how far
  one request's TTFT moves between two runs of the same setup, which is the
  resolution of any request-by-request comparison here.

With ``--pd`` the ``exact`` and ``pull`` fleets disaggregate (``mode: Always``):
N prefill engines (``spec.prefill.peerPull`` for ``pull``) and one decode engine;
the decision then picks the engine of each prefill leg, which may pull the prefix
from the prefill engine holding it before it leases the whole prompt to decode.
``holder`` has no P/D counterpart (a client cannot send a prefill leg itself) and
is refused with ``--pd``; so is the ``vs_recompute`` comparison below (the decode
leg's usage counts the whole prompt it pulled as cached, so the client cannot tell
which prefill legs recomputed): it is reported as null.

Both fleets are up for the whole run. After ``--warm-rounds`` unrecorded rounds
(every trace once per fleet, on prompts of its own), each of ``--rounds`` rounds runs every
trace once per setup, one setup right after the other (the order rotates
between rounds), on the round's own prompts, so the setups of a round share
the machine's load and see the same requests (``holder`` the same shape).

Reported per trace and setup, over all rounds: TTFT p50/p90/max, prompt
tokens the engines computed (``pdfleet_engine_prompt_tokens_total``), KV bytes
pulled (``pdfleet_engine_kv_peer_pull_bytes_total``), the gateway's decisions
and its measured crossover; per trace and round the ratio of the ``pull`` p90
to the ``exact`` p90 and, request by request, how many were more than 10%
slower with pulls than without; the load average at the start of every run.
Over all rounds, ``per_request_median`` compares each trace position (the
same request shape in every round: a family's parent, its third fork) by its
median TTFT over the rounds, for pulls and for the A/A control alike.

    .venv/bin/python benchmarks/peer_pull.py [--engines 3] [--rounds 3] [--traces forks]
        [--pd] [--json benchmarks/results/peer_pull_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fleet import free_port

from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.contracts.metrics import parse_metrics
from pdfleet.engine.contracts.security import fleet_token
from pdfleet.engine.reports.stats import percentile as _percentile

SETUPS = ("exact", "pull", "holder", "exact_aa")
TRACES = ("multiturn", "forks", "tenants")
PROMPT_TOKENS = "pdfleet_engine_prompt_tokens_total"
PULL_BYTES = "pdfleet_engine_kv_peer_pull_bytes_total"
DECISIONS = "pdfleet_gateway_peer_pull_decisions_total"
CROSSOVER = "pdfleet_gateway_peer_pull_fleet_crossover_tokens"


def percentile(xs: list[float], p: float) -> float:
    return _percentile(sorted(xs), p)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(20, 1700) for _ in range(n)]


# -- traces: lists of (start offset s, key, prefix key, prompt, after) ---------------
# ``after``: the index of the request this one waits for (a conversation's previous
# turn, a fork's parent), or None. ``prefix``: what holder-only routing keys on.


def multiturn(args, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for user in range(args.users):
        prompt = tokens(rng, args.system_tokens)
        prev = None
        for turn in range(args.turns):
            prompt = prompt + tokens(rng, args.turn_tokens)
            out.append(
                {
                    "at": user * 0.4 if turn == 0 else 0.2,
                    "prefix": f"user{user}",
                    "prompt": list(prompt),
                    "after": prev,
                }
            )
            prev = len(out) - 1
    return out


def forks(args, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for family in range(args.families):
        prefix = tokens(rng, args.fork_prefix)
        out.append(
            {
                "at": family * args.family_gap,
                "prefix": f"family{family}",
                "prompt": prefix + tokens(rng, 16),
                "after": None,
            }
        )
        parent = len(out) - 1
        for _ in range(args.forks):
            out.append(
                {
                    "at": 0.0,
                    "prefix": f"family{family}",
                    "prompt": prefix + tokens(rng, args.fork_tail),
                    "after": parent,
                }
            )
    return out


def tenants(args, rng: random.Random) -> list[dict[str, Any]]:
    systems = [tokens(rng, args.tenant_prompt) for _ in range(args.tenants)]
    out = []
    t = 0.0
    for _ in range(args.tenant_requests):
        t += rng.expovariate(args.rate)
        tenant = min(int(rng.paretovariate(1.2)) - 1, args.tenants - 1)
        out.append(
            {
                "at": t,
                "prefix": f"tenant{tenant}",
                "prompt": systems[tenant] + tokens(rng, 60),
                "after": None,
            }
        )
    return out


# -- a fleet --------------------------------------------------------------------------


def resource(args, peer_pull: bool) -> str:
    roles: dict[str, Any] = {
        "decode": {"replicas": args.engines, "peerPull": peer_pull},
        "disaggregation": {"mode": "Disabled"},
    }
    if args.pd:
        roles = {
            "prefill": {"replicas": args.engines, "peerPull": peer_pull},
            "decode": {"replicas": 1},
            "disaggregation": {"mode": "Always"},
        }
    return json.dumps(
        {
            "apiVersion": "pdfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "peerpull"},
            "spec": {
                "model": {"name": "tiny", "uri": args.model},
                "engine": {
                    "device": "cpu",
                    "dtype": "float32",
                    "maxModelLen": args.max_model_len,
                    "maxNumSeqs": 16,
                    **(
                        {"kvCacheMemoryBytes": args.kv_cache_memory_bytes}
                        if args.kv_cache_memory_bytes
                        else {}
                    ),
                },
                "kvTransfer": {"connector": "NixlConnector", "identity": "Disabled"},
                **roles,
                "gateway": {"kvEvents": True},
            },
        }
    )


class UpFleet:
    def __init__(self, args, name: str, peer_pull: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"pdfleet-peerpull-{name}-"))
        spec = self.dir / "service.json"
        spec.write_text(resource(args, peer_pull))
        self.port = free_port()
        self.log = open(self.dir / "up.log", "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [
                *python_module("pdfleet.engine.cli"),
                "up",
                str(spec),
                "--port",
                str(self.port),
                "--run-dir",
                str(self.dir / "runs"),
                "--threads-per-engine",
                "1",
                "--stall-timeout",
                "120",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            text = (self.dir / "up.log").read_text(errors="replace")
            if "ready: " in text:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(text[-3000:])
            time.sleep(0.5)
        else:
            self.stop()
            raise TimeoutError("pdfleet up did not become ready in 900 s")
        run = max((self.dir / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        self.run = run
        secret = (run / "fleet-secret").read_bytes().strip()
        self.headers = {"authorization": f"Bearer {fleet_token(secret)}"}
        state = json.loads((run / "fleet.json").read_text())
        # The engines that compute prompts and lend them to each other: the decode
        # engines of an aggregated fleet, the prefill engines of a P/D one (its
        # decode engine's pulls are the P/D legs', not peer pulls).
        role = "prefill" if args.pd else "decode"
        self.engines = [e["url"] for e in state["engines"] if e["role"] == role]
        self.all_engines = [e["url"] for e in state["engines"]]

    def metric(self, url: str, name: str, **labels: str) -> float:
        text = httpx.get(url + "/metrics", headers=self.headers, timeout=10).text
        series = parse_metrics(text, only=[name]).samples.get(name, ())
        return sum(v for found, v in series if all(found.get(k) == x for k, x in labels.items()))

    def engines_total(self, name: str, every: bool = False) -> float:
        """``name`` summed over the lending engines (``every``: all of them)."""
        return sum(self.metric(u, name) for u in (self.all_engines if every else self.engines))

    def status_line(self) -> str:
        out = subprocess.run(
            [*python_module("pdfleet.engine.cli"), "status", "--run-dir", str(self.dir / "runs")],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return next((line for line in out.splitlines() if line.startswith("peer pulls")), "")

    def stop(self) -> None:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


# -- running a trace ---------------------------------------------------------------------


async def ttft(
    client: httpx.AsyncClient, url: str, headers: dict, prompt: list[int]
) -> tuple[float, int]:
    """Time to the first token at the client, and the prompt tokens the engine
    did not compute (``usage.prompt_tokens_details.cached_tokens``: its own
    prefix cache, or blocks pulled from a peer)."""
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    cached = -1
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            usage = json.loads(line[6:]).get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if first is None or cached < 0:
        raise RuntimeError("no token" if first is None else "no usage in the stream")
    return first, cached


async def run_trace(
    fleet: UpFleet, setup: str, reqs: list[dict[str, Any]]
) -> tuple[list[float], list[int]]:
    done = [asyncio.Event() for _ in reqs]
    out = [0.0] * len(reqs)
    cached = [0] * len(reqs)
    holder: dict[str, str] = {}
    inflight = dict.fromkeys(fleet.engines, 0)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            r = reqs[i]
            if r["after"] is not None:
                await done[r["after"]].wait()
                await asyncio.sleep(r["at"])
            else:
                await asyncio.sleep(max(0.0, start + r["at"] - time.perf_counter()))
            if setup == "holder":
                # Holder-only: the engine that first computed this prefix, always.
                url = holder.get(r["prefix"])
                if url is None:
                    url = holder[r["prefix"]] = min(inflight, key=inflight.__getitem__)
                headers = fleet.headers
            else:
                url, headers = fleet.url, {}
            inflight[url] = inflight.get(url, 0) + 1
            try:
                out[i], cached[i] = await ttft(client, url, headers, r["prompt"])
            finally:
                inflight[url] -= 1
                done[i].set()

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return out, cached


def summarize(xs: list[float]) -> dict[str, float]:
    return {
        "ttft_p50_s": round(percentile(xs, 50), 4),
        "ttft_p90_s": round(percentile(xs, 90), 4),
        "ttft_max_s": round(max(xs), 4),
    }


def warm(fleet: UpFleet, engines: int) -> None:
    """The same warm-up for every setup: each engine computes something, so the
    gateway's figures (and the engines' first-step costs) are in place."""
    asyncio.run(
        run_trace(
            fleet,
            "exact",
            [
                {"at": 0.0, "prefix": f"w{i}", "prompt": tokens(random.Random(i), 600)}
                | {"after": None}
                for i in range(2 * engines)
            ],
        )
    )


def one_run(
    fleet: UpFleet, setup: str, reqs: list[dict[str, Any]]
) -> tuple[dict, list[float], list[int]]:
    """One trace on one fleet: its TTFTs and what the engines and gateway counted."""
    before_tokens = fleet.engines_total(PROMPT_TOKENS, every=True)
    before_bytes = fleet.engines_total(PULL_BYTES)
    before_dec = {
        d: fleet.metric(fleet.url, DECISIONS, decision=d) for d in ("holder", "pull", "recompute")
    }
    t0 = time.perf_counter()
    xs, cached = asyncio.run(run_trace(fleet, setup, reqs))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # the engines' counters of the last steps
    row: dict[str, Any] = {
        "wall_s": round(wall, 2),
        "prefill_tokens_computed": int(
            fleet.engines_total(PROMPT_TOKENS, every=True) - before_tokens
        ),
        "prompt_tokens_sent": sum(len(r["prompt"]) for r in reqs),
        "bytes_pulled": int(fleet.engines_total(PULL_BYTES) - before_bytes),
    }
    if setup == "pull":
        row["decisions"] = {
            d: int(fleet.metric(fleet.url, DECISIONS, decision=d) - before_dec[d])
            for d in before_dec
        }
        row["crossover_tokens"] = round(fleet.metric(fleet.url, CROSSOVER), 1)
    return row, xs, cached


def compare(
    exact: list[float],
    pull: list[float],
    exact_cached: list[int] | None,
    prompt_tokens: list[int],
) -> dict[str, Any]:
    """Pull against exact routing over the same requests.

    ``vs_recompute`` holds the requests that exact routing computed (at least
    half the prompt not from a cache: the parents, and the forks it sent away
    from the holder): the target's "no request slower than recomputing by
    more than 10%" compares each of them, served with peer pulls, against the
    same request recomputed in the same round (None: ``exact_cached`` unknown,
    as in P/D)."""
    ratios = [b / a for a, b in zip(exact, pull, strict=True) if a > 0]
    vs_recompute: dict[str, Any] | None = None
    if exact_cached is not None:
        recomputed = [
            i for i, (c, n) in enumerate(zip(exact_cached, prompt_tokens, strict=True)) if c < n / 2
        ]
        vs_recompute = slower([pull[i] / exact[i] for i in recomputed if exact[i] > 0])
    return {
        "p90_ratio": round(percentile(pull, 90) / percentile(exact, 90), 3),
        "p90_reduction_pct": round(100 * (1 - percentile(pull, 90) / percentile(exact, 90)), 1),
        "p50_ratio": round(percentile(pull, 50) / percentile(exact, 50), 3),
        "requests_over_10pct_slower": sum(1 for r in ratios if r > 1.1),
        "worst_request_ratio": round(max(ratios), 3),
        "vs_recompute": vs_recompute,
    }


def per_request_median(
    exact: list[list[float]],
    other: list[list[float]],
    exact_cached: list[list[int]],
    lengths: list[list[int]],
) -> dict[str, Any]:
    """Each trace position by its median TTFT over the rounds, ``other`` against
    ``exact``: over the positions exact routing computed (at least half the
    prompt not from a cache) in most rounds, how many are more than 10% slower,
    and the worst and median ratios. A round's prompts are its own, but a
    position is the same request in every round (its length, its arrival, its
    parent), so the median over rounds is that request's typical TTFT, where one
    round's single sample carries the machine's noise of that moment."""
    positions = len(exact[0])
    ratios: list[float] = []
    for i in range(positions):
        computed = sum(1 for cs, ns in zip(exact_cached, lengths, strict=True) if cs[i] < ns[i] / 2)
        if 2 * computed <= len(exact):
            continue
        e = percentile([xs[i] for xs in exact], 50)
        o = percentile([xs[i] for xs in other], 50)
        if e > 0:
            ratios.append(o / e)
    return {"rounds": len(exact), **slower(ratios)}


def slower(ratios: list[float]) -> dict[str, Any]:
    """Per-request TTFT ratios (a setup over exact routing): how many, how many
    more than 10% slower, the worst and the median."""
    return {
        "requests": len(ratios),
        "over_10pct_slower": sum(1 for r in ratios if r > 1.1),
        "worst_ratio": round(max(ratios), 3) if ratios else None,
        "median_ratio": round(percentile(ratios, 50), 3) if ratios else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--model", default="builtin://tiny")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="each engine's KV cache (spec.engine.kvCacheMemoryBytes; the CPU default "
        "holds one max-model-len sequence of SmolLM2)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warm-rounds",
        type=int,
        default=1,
        help="unrecorded rounds first, every trace once per fleet on its own prompts",
    )
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=800)
    p.add_argument("--turn-tokens", type=int, default=400)
    p.add_argument("--families", type=int, default=6)
    p.add_argument("--forks", type=int, default=8)
    p.add_argument("--fork-prefix", type=int, default=3000)
    p.add_argument("--fork-tail", type=int, default=64)
    p.add_argument("--family-gap", type=float, default=1.0)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--tenant-prompt", type=int, default=2000)
    p.add_argument("--tenant-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument(
        "--pd",
        action="store_true",
        help="P/D fleets: --engines prefill engines (peer pulls on them) and one decode",
    )
    p.add_argument("--setups", default=None, help="default: exact,pull,holder (--pd: exact,pull)")
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument(
        "--json",
        default=None,
        help="default: benchmarks/results/peer_pull_cpu.json (--pd: peer_pull_pd_cpu.json)",
    )
    args = p.parse_args()
    builders = {"multiturn": multiturn, "forks": forks, "tenants": tenants}
    traces = [t for t in args.traces.split(",") if t]
    if args.json is None:
        name = "peer_pull_pd_cpu.json" if args.pd else "peer_pull_cpu.json"
        args.json = f"benchmarks/results/{name}"
    if args.setups is None:
        args.setups = "exact,pull,exact_aa" if args.pd else ",".join(SETUPS)
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or (args.pd and "holder" in setups):
        p.error(
            f"--setups: {', '.join(unknown)} unknown (one of {', '.join(SETUPS)})"
            if unknown
            else "--setups: holder has no P/D form (a client cannot send a prefill leg); "
            "use exact,pull with --pd"
        )
    # Every setup's fleet is up for the whole run, and each round runs each trace
    # once per setup, one setup after the other in an order that rotates between
    # rounds, with the round's own prompts (a new seed: no setup finds them cached
    # from an earlier round). So the setups share the machine's load minute by
    # minute, and each round's ratios compare runs seconds apart on the same requests.
    fleets: dict[str, UpFleet] = {}
    load = [os.getloadavg()[0]]
    rows: dict[str, dict[str, list[dict]]] = {t: {s: [] for s in setups} for t in traces}
    ttfts: dict[str, dict[str, list[list[float]]]] = {t: {s: [] for s in setups} for t in traces}
    cacheds: dict[str, dict[str, list[list[int]]]] = {t: {s: [] for s in setups} for t in traces}
    lengths: dict[str, list[list[int]]] = {t: [] for t in traces}
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in traces}
    try:
        # Holder-only routing goes straight to the engines of the exact-routing
        # fleet (it uses none of its gateway), with prompts of its own: two fleets
        # of engines at once, not three, on this machine's memory.
        for name in dict.fromkeys("pull" if s == "pull" else "exact" for s in setups):
            fleets[name] = UpFleet(args, name, peer_pull=name == "pull")
            warm(fleets[name], args.engines)
        time.sleep(2.5)  # two scrapes of the gateways: their rates are measured
        # Unrecorded rounds first, the same for every fleet: each runs every trace
        # once on prompts of its own, so the measured rounds see fleets that have
        # served this traffic before (a pull fleet's pairs measured), not ones
        # just started.
        for w in range(args.warm_rounds):
            for trace in traces:
                for name, fleet in fleets.items():
                    seed = f"{args.seed}-{trace}-warm{w}-{name}"
                    one_run(fleet, name, builders[trace](args, random.Random(seed)))
        for r in range(args.rounds):
            order = setups[r % len(setups) :] + setups[: r % len(setups)]
            for trace in traces:
                reqs = builders[trace](args, random.Random(f"{args.seed}-{trace}-{r}"))
                entry: dict[str, Any] = {"round": r, "order": order}
                for setup in order:
                    start_load = os.getloadavg()[0]
                    if setup in ("holder", "exact_aa"):
                        # The same trace shape, other tokens: the fleet's caches
                        # hold nothing of it from the exact run of this round.
                        mine = builders[trace](
                            args, random.Random(f"{args.seed}-{trace}-{r}-{setup}")
                        )
                        row, xs, cached = one_run(fleets["exact"], setup, mine)
                    else:
                        row, xs, cached = one_run(fleets[setup], setup, reqs)
                    row.update(summarize(xs), load_average=round(start_load, 2))
                    rows[trace][setup].append(row)
                    ttfts[trace][setup].append(xs)
                    cacheds[trace][setup].append(cached)
                    entry[setup] = {
                        **{k: row[k] for k in ("ttft_p50_s", "ttft_p90_s", "load_average")},
                        # Request by request, in trace order (for a fork family: the
                        # parent, then its forks).
                        "ttft_s": [round(x, 4) for x in xs],
                        "cached_tokens": cached,
                    }
                    load.append(os.getloadavg()[0])
                    print(trace, r, setup, json.dumps(row), flush=True)
                lengths[trace].append([len(q["prompt"]) for q in reqs])
                for other in ("pull", "exact_aa"):
                    if other in entry and "exact" in entry:
                        entry[f"{other}_vs_exact"] = compare(
                            ttfts[trace]["exact"][-1],
                            ttfts[trace][other][-1],
                            None if args.pd else cacheds[trace]["exact"][-1],
                            lengths[trace][-1],
                        )
                rounds[trace].append(entry)
        status = fleets["pull"].status_line() if "pull" in fleets else ""
    finally:
        for fleet in fleets.values():
            fleet.stop()
    results: dict[str, Any] = {}
    for trace in traces:
        out: dict[str, Any] = {"rounds": rounds[trace]}
        for setup in setups:
            pooled = [x for xs in ttfts[trace][setup] for x in xs]
            got = rows[trace][setup]
            summary: dict[str, Any] = {
                **summarize(pooled),
                "requests": len(pooled),
                **{
                    k: sum(row[k] for row in got)
                    for k in ("prefill_tokens_computed", "prompt_tokens_sent", "bytes_pulled")
                },
            }
            if setup == "pull":
                summary["decisions"] = {
                    d: sum(row["decisions"][d] for row in got)
                    for d in ("holder", "pull", "recompute")
                }
                summary["crossover_tokens"] = [row["crossover_tokens"] for row in got]
            out[setup] = summary
        if "pull" in setups and "exact" in setups:
            pooled_exact = [x for xs in ttfts[trace]["exact"] for x in xs]
            pooled_pull = [x for xs in ttfts[trace]["pull"] for x in xs]
            per_round = [e["pull_vs_exact"]["p90_ratio"] for e in rounds[trace]]
            pooled_cached = [c for cs in cacheds[trace]["exact"] for c in cs]
            pooled_len = [n for ns in lengths[trace] for n in ns]
            out["pull_vs_exact"] = {
                **compare(
                    pooled_exact, pooled_pull, None if args.pd else pooled_cached, pooled_len
                ),
                "p90_ratio_per_round": per_round,
            }
            if not args.pd:
                out["per_request_median"] = {
                    other: per_request_median(
                        ttfts[trace]["exact"],
                        ttfts[trace][other],
                        cacheds[trace]["exact"],
                        lengths[trace],
                    )
                    for other in ("pull", "exact_aa")
                    if other in setups
                }
        results[trace] = out
    out_doc = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{os.cpu_count()} CPU cores, shared with other work; load average "
        f"{min(load):.1f}-{max(load):.1f} during the run",
        "engines": args.engines,
        "fleet": f"P/D: {args.engines} prefill engines, 1 decode (mode Always)"
        if args.pd
        else f"aggregated: {args.engines} engines",
        "model": args.model,
        "rounds": args.rounds,
        "status_line": status,
        "results": results,
    }
    text = json.dumps(out_doc, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
