"""Flow control on a ``pdfleet up`` fleet: protected TTFT under a flood, fair
share by tokens between keys, and a batch on idle capacity.

The fleet: the built-in tiny model, one aggregated engine (``Disabled``
mode) scheduling by priority, the gateway passing each request's band to it,
and a tenants file with two tenants: ``protected`` (band 0) and ``noisy``
(band 1, at most ``--noisy-max-queued`` requests queued). Other keys are
their own tenants (weight 1, band 1). Measured, in this order:

1. **capacity**: completions per second of the noisy request shape with
   ``--capacity-concurrency`` requests in flight (closed loop);
2. **unloaded**: the protected tenant's TTFT p90 alone (streamed, one
   request per ``--protected-interval`` seconds);
3. **flood without flow control**: the noisy load at ``--flood`` × capacity
   (open loop) and the protected load, both with one shared key (one tenant:
   the gateway cannot tell them apart, so they queue together, first come
   first served): the protected TTFT p90 and the noisy outcomes;
4. **flood with flow control**: the same, each with its own key; the ratio
   of the protected TTFT p90 to its unloaded value is the figure (target
   1.5x), and the noisy requests' outcomes (429s, not timeouts); then the
   same flood from the ``noisy-bounded`` tenant, whose
   ``max_inflight_requests`` (``--noisy-max-inflight``) bounds the flood's
   share of the engine's decode batch (so of each step's time). Each flood
   also reports the engine's steps in it (count, mean, quantiles from its
   step-duration histogram, output tokens a step: the decode batch);
5. **n=64 vs n=1**: two equal keys, closed loops, one sending ``n=64``
   requests, the other ``n=1``, streamed; their completion-token throughputs
   and ratio (target within 20%), and their prompt-plus-output throughputs
   (the gateway's cost, what its fair share equalizes) and ratio, counted
   over the phase after ``--fair-warmup`` as the tokens arrive; besides,
   the gateway's admitted cost by tenant, each key's cost of the requests
   that ended by the phase's end, the engine's preemptions, and the
   gateway's view (the engine's capacity and slots, each key's queued and
   in-flight requests) with the engine's running and waiting sequences
   every ``--fair-sample`` seconds;
6. **batch**: ``--batch-requests`` requests through the Batch API (the
   official ``openai`` client), while the protected tenant's light load
   runs: the batch's wall time and the protected TTFT p90 meanwhile, against
   its unloaded value.

The noisy requests are long (``--noisy-tokens``, 256 output tokens): with
an engine on one torch thread the tiny model serves about 88 completions a
second of 32 tokens, and no client sharing the fleet's 2 cores sends 5x that,
so a flood of short requests would not flood the engine.

    .venv/bin/python benchmarks/flow_control.py [--flood 5] [--phase-seconds 20]
        [--batch-requests 1000] [--json benchmarks/results/flow_control_cpu.json]

The protected tenant's client runs in a process of its own (the flood's
generator, thousands of requests on one event loop, would otherwise delay
its reads and count that as TTFT; the flood phases report that loop's own
lag), and so does the flood's generator, at a lower CPU priority than the
fleet's (``--flood-nice``, 10 by default: a noisy tenant's clients do not
share the fleet's cores; 0 measures as before); each protected phase also reports the gateway's view of the protected
TTFT (its streamed-TTFT histogram, which only the protected load feeds
there: the bucket holding p50 and p90).

Numbers from a shared 2-core VM are noisy: the load average is printed with
them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import openai
import yaml

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.launch import python_module

SECRET = "flow-control-benchmark-secret-0123456789"
PROTECTED, NOISY, SHARED, KEY_A, KEY_B = "k-protected", "k-noisy", "k-shared", "k-a", "k-b"
NOISY_BOUNDED = "k-noisy-bounded"
PROMPT = "The harbor was quiet before dawn, and the boats"


def service(max_num_seqs: int) -> dict:
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "flow"},
        "spec": {
            "model": {"name": "tiny", "uri": "builtin://tiny"},
            "engine": {
                "device": "cpu",
                "dtype": "float32",
                "maxModelLen": 512,
                "maxNumSeqs": max_num_seqs,
                "schedulingPolicy": "priority",
            },
            "prefill": {"replicas": 0},
            "decode": {"replicas": 1},
            "disaggregation": {"mode": "Disabled"},
            "gateway": {"enginePriority": True, "queueTimeoutSeconds": 20},
        },
    }


def tenants(noisy_max_queued: int, prompt_token_weight: float, noisy_max_inflight: int) -> dict:
    noisy = {"name": "noisy", "keys": [NOISY], "priority": 1, "max_queued": noisy_max_queued}
    bounded = {
        **noisy,
        "name": "noisy-bounded",
        "keys": [NOISY_BOUNDED],
        "max_inflight_requests": noisy_max_inflight,
    }
    return {
        "prompt_token_weight": prompt_token_weight,
        "default": {"priority": 1},
        "tenants": [{"name": "protected", "keys": [PROTECTED], "priority": 0}, noisy, bounded],
    }


def p50(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class Fleet:
    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        (tmp / "flow.yaml").write_text(yaml.safe_dump(service(args.max_num_seqs)))
        (tmp / "tenants.yaml").write_text(
            yaml.safe_dump(
                tenants(args.noisy_max_queued, args.prompt_token_weight, args.noisy_max_inflight)
            )
        )
        env = {
            **os.environ,
            security.FLEET_SECRET_ENV: SECRET,
            "PDFLEET_API_KEY": ",".join((SHARED, KEY_A, KEY_B)),
        }
        env.pop("PDFLEET_API_KEY_FILE", None)
        self.log_path = tmp / "up.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(
            [
                *python_module("pdfleet.engine.cli"),
                "up",
                str(tmp / "flow.yaml"),
                "--run-dir",
                str(tmp / "runs"),
                "--tenants-file",
                str(tmp / "tenants.yaml"),
                *(
                    ["--threads-per-engine", str(args.threads_per_engine)]
                    if args.threads_per_engine
                    else []
                ),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 600
        while True:
            text = self.log_path.read_text(errors="replace")
            if "Ctrl-C stops" in text:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdfleet up did not become ready:\n{text[-3000:]}")
            time.sleep(0.5)
        found = re.search(r"ready: (http://[\d.:]+)/v1", text)
        assert found is not None
        self.url = found.group(1)
        self.admin = {"authorization": f"Bearer {security.fleet_token(SECRET.encode())}"}

    def view(self) -> dict:
        return httpx.get(self.url + "/engines", headers=self.admin, timeout=10).json()

    def refusals(self) -> dict[str, float]:
        """The gateway's refusals so far, by tenant and outcome, and by reason."""
        text = httpx.get(self.url + "/metrics", headers=self.admin, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(
                (
                    "pdfleet_gateway_tenant_requests_total{",
                    "pdfleet_gateway_rejected_requests_total{",
                    "pdfleet_gateway_tenant_tokens_total{",
                )
            ):
                name, value = line.rsplit(" ", 1)
                out[name.replace("pdfleet_gateway_", "")] = float(value)
        return out

    def gateway_ttft(self) -> dict[float, float]:
        """The gateway's streamed-TTFT histogram: cumulative count by upper bound.

        Only streamed requests are observed in it, and in the flood phases
        only the protected load streams, so its change over a phase is the
        protected requests' TTFT as the gateway saw it (arrival to the first
        relayed event), free of the benchmark client's own delays.
        """
        text = httpx.get(self.url + "/metrics", headers=self.admin, timeout=10).text
        out: dict[float, float] = {}
        for line in text.splitlines():
            if line.startswith("pdfleet_gateway_time_to_first_token_seconds_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def engine_steps(self) -> dict[str, float]:
        """The engine's step counters: steps, seconds in steps, output tokens."""
        url = self.view()["engines"][0]["url"]
        text = httpx.get(url + "/metrics", headers=self.admin, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pdfleet_engine_step_duration_seconds_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                key = f"le:{le}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            for name in (
                "pdfleet_engine_step_duration_seconds_sum",
                "pdfleet_engine_step_duration_seconds_count",
                "pdfleet_engine_generation_tokens_total",
                "pdfleet_engine_num_preemptions_total",
            ):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def drained(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.view()
            if not v["queued"] and not any(e["admitted"] for e in v["engines"]):
                return
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


async def one(
    client: httpx.AsyncClient, url: str, key: str, body: dict, timeout: float
) -> tuple[str, float | None, int]:
    """(outcome, TTFT of a streamed request, completion tokens of a JSON one)."""
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key}"}
    try:
        if body.get("stream"):
            async with client.stream(
                "POST", url + "/v1/completions", json=body, headers=headers, timeout=timeout
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return str(resp.status_code), None, 0
                first = None
                async for chunk in resp.aiter_lines():
                    if chunk.startswith("data: ") and first is None and '"text"' in chunk:
                        first = time.perf_counter() - start
                return "200", first, 0
        resp = await client.post(
            url + "/v1/completions", json=body, headers=headers, timeout=timeout
        )
        if resp.status_code != 200:
            return str(resp.status_code), None, 0
        usage = resp.json()["usage"]
        return "200", None, int(usage["completion_tokens"])
    except httpx.TimeoutException:
        return "timeout", None, 0
    except httpx.HTTPError as e:
        return type(e).__name__, None, 0


def small(max_tokens: int = 8) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip


def noisy_body(max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}


async def open_loop(
    client, url, key, body, rate: float, seconds: float, timeout: float
) -> list[tuple[str, float | None, int]]:
    tasks = []
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        tasks.append(asyncio.create_task(one(client, url, key, body, timeout)))
        i += 1
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
    return list(await asyncio.gather(*tasks))


async def closed_loop(client, url, key, body, concurrency: int, seconds: float, timeout: float):
    deadline = time.monotonic() + seconds
    results: list[tuple[str, float | None, int]] = []

    async def worker() -> None:
        while time.monotonic() < deadline:
            results.append(await one(client, url, key, body, timeout))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _protected_loop(
    url: str, key: str, rate: float, seconds: float, timeout: float
) -> list[tuple[str, float | None, int]]:
    async def go() -> list[tuple[str, float | None, int]]:
        async with httpx.AsyncClient() as client:
            return await open_loop(client, url, key, small(), rate, seconds, timeout)

    return asyncio.run(go())


# The protected tenant's client runs in a process of its own, as another
# user's client would: the flood's generator (thousands of requests a phase
# on one event loop) would otherwise delay the protected client's reads and
# count its own lag as TTFT. Spawned, so it shares nothing with this loop.
_PROTECTED_POOL: ProcessPoolExecutor | None = None


async def protected_load(
    url: str, key: str, rate: float, seconds: float, timeout: float
) -> list[tuple[str, float | None, int]]:
    global _PROTECTED_POOL
    if _PROTECTED_POOL is None:
        _PROTECTED_POOL = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        _PROTECTED_POOL, _protected_loop, url, key, rate, seconds, timeout
    )


def _flood_loop(
    url: str, key: str, body: dict, rate: float, seconds: float, timeout: float
) -> tuple[list[tuple[str, float | None, int]], list[float], int]:
    """The noisy open loop, its event loop's lag samples and its process's niceness."""

    async def go() -> tuple[list[tuple[str, float | None, int]], list[float], int]:
        lags: list[float] = []
        lagger = asyncio.create_task(loop_lag(lags))
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4096)) as client:
            out = await open_loop(client, url, key, body, rate, seconds, timeout)
        lagger.cancel()
        return out, lags, os.nice(0)

    return asyncio.run(go())


# The flood's generator runs in a process of its own too, at a lower CPU
# priority than the fleet and the protected client (``--flood-nice``): a
# noisy tenant's clients run on their own machines, and on a 2-core machine
# shared with the fleet, a generator sending thousands of requests a phase at
# the fleet's priority takes CPU from the gateway and the engine's front end
# that no deployment would lose to it.
_FLOOD_POOL: ProcessPoolExecutor | None = None


async def flood_load(
    args: argparse.Namespace, url: str, key: str, body: dict, rate: float
) -> tuple[list[tuple[str, float | None, int]], list[float], int]:
    global _FLOOD_POOL
    if _FLOOD_POOL is None:
        _FLOOD_POOL = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=os.nice,
            initargs=(args.flood_nice,),
        )
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        _FLOOD_POOL, _flood_loop, url, key, body, rate, args.phase_seconds, args.timeout
    )


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float):
    """The upper bound of the bucket holding quantile ``q`` of the change."""
    bounds = sorted(after)
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    if total <= 0:
        return None
    for b in bounds:
        if after[b] - before.get(b, 0.0) >= q * total:
            return None if b == float("inf") else b
    return None


async def loop_lag(samples: list[float], period: float = 0.01) -> None:
    """How late this event loop wakes from a ``period`` sleep, each time."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append(time.perf_counter() - t - period)


def tenant_view(fleet: Fleet, name: str) -> dict:
    return next((t for t in fleet.view()["tenants"] if t["tenant"] == name), {})


def step_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The engine's steps and mean step seconds between two ``engine_steps``."""

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = d("pdfleet_engine_step_duration_seconds_count")
    # Step-time quantiles from the histogram's buckets (upper bounds).
    buckets = sorted((float(k[3:]), d(k)) for k in after if k.startswith("le:") and k != "le:+Inf")

    def quantile(q: float) -> float | None:
        return next((le for le, n in buckets if steps and n >= q * steps), None)

    return {
        "engine_step_p50_le_s": quantile(0.5),
        "engine_step_p90_le_s": quantile(0.9),
        "engine_step_p99_le_s": quantile(0.99),
        "engine_steps": steps,
        "engine_step_mean_s": round(d("pdfleet_engine_step_duration_seconds_sum") / steps, 4)
        if steps
        else None,
        # Output tokens per step: the mean decode batch.
        "engine_tokens_per_step": round(d("pdfleet_engine_generation_tokens_total") / steps, 1)
        if steps
        else None,
    }


async def flood(fleet: Fleet, args, capacity: float, noisy_key: str, protected_key: str) -> dict:
    before = fleet.refusals()
    steps_before = fleet.engine_steps()
    waited_before = tenant_view(fleet, "protected").get("waited", 0)
    async with httpx.AsyncClient() as client:
        noisy = asyncio.create_task(
            flood_load(
                args, fleet.url, noisy_key, noisy_body(args.noisy_tokens), args.flood * capacity
            )
        )
        await asyncio.sleep(2.0)  # the flood first builds its queue
        seen: list[dict] = []

        async def watch() -> None:
            """The gateway's view each second: its queue, the engine's slots."""
            while True:
                view = (await client.get(fleet.url + "/engines", headers=fleet.admin)).json()
                e = view["engines"][0]
                seen.append(
                    {"queued": view["queued"], "admitted": e["admitted"], "capacity": e["capacity"]}
                )
                await asyncio.sleep(1.0)

        watcher = asyncio.create_task(watch())
        gw_before = await asyncio.to_thread(fleet.gateway_ttft)
        protected = await protected_load(
            fleet.url,
            protected_key,
            1 / args.protected_interval,
            args.phase_seconds - 2.0,
            args.timeout,
        )
        gw_after = await asyncio.to_thread(fleet.gateway_ttft)
        noisy_results, lags, flood_nice = await noisy
        watcher.cancel()
    ttfts = [t for o, t, _ in protected if o == "200" and t is not None]
    after = fleet.refusals()
    steps = step_stats(steps_before, fleet.engine_steps())
    # Where the protected requests waited: in the gateway's queue (how many of
    # them, and the recent mean wait); the rest of their TTFT is the engine's.
    mine = tenant_view(fleet, "protected")
    capacities = [x["capacity"] for x in seen if x["capacity"] is not None]
    return {
        "engine_capacity_min_max": [min(capacities), max(capacities)] if capacities else None,
        "gateway_queued_max": max((x["queued"] for x in seen), default=0),
        "gateway_counts": {
            k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)
        },
        "protected_ttft_p90_s": p90(ttfts),
        "protected_ttft_p50_s": p50(ttfts),
        "protected_gateway_ttft_p50_le_s": histogram_quantile(gw_before, gw_after, 0.5),
        "protected_gateway_ttft_p90_le_s": histogram_quantile(gw_before, gw_after, 0.9),
        "flood_client_loop_lag_p90_s": p90(lags),
        "flood_client_niceness": flood_nice,
        "protected_waited_in_gateway_queue": mine.get("waited", 0) - waited_before
        if protected_key == PROTECTED
        else None,
        "protected_gateway_queue_s_recent_mean": mine.get("queue_s")
        if protected_key == PROTECTED
        else None,
        "protected_outcomes": dict(Counter(o for o, _, _ in protected)),
        "noisy_outcomes": dict(Counter(o for o, _, _ in noisy_results)),
        "noisy_requests_per_s": round(len(noisy_results) / args.phase_seconds, 1),
        **steps,
    }


async def run(args: argparse.Namespace, fleet: Fleet) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4096)) as client:
        # 1. capacity
        done = await closed_loop(
            client,
            fleet.url,
            KEY_A,
            noisy_body(args.noisy_tokens),
            args.capacity_concurrency,
            args.phase_seconds / 2,
            args.timeout,
        )
        ok = sum(1 for o, _, _ in done if o == "200")
        capacity = ok / (args.phase_seconds / 2)
        out["capacity_rps"] = round(capacity, 2)
        print(f"capacity: {capacity:.2f} completions/s", flush=True)
        fleet.drained()
        # 2. unloaded (after a few requests that warm the path up, not counted)
        for _ in range(3):
            await one(client, fleet.url, PROTECTED, small(), args.timeout)
        await protected_load(fleet.url, PROTECTED, 3.0, 1.0, args.timeout)  # its process
        steps_before = fleet.engine_steps()
        gw_before = await asyncio.to_thread(fleet.gateway_ttft)
        alone = await protected_load(
            fleet.url,
            PROTECTED,
            1 / args.protected_interval,
            args.phase_seconds,
            args.timeout,
        )
        gw_after = await asyncio.to_thread(fleet.gateway_ttft)
        unloaded = p90([t for o, t, _ in alone if o == "200" and t is not None])
        out["unloaded_ttft_p90_s"] = unloaded
        out["unloaded_ttft_p50_s"] = p50([t for o, t, _ in alone if o == "200" and t])
        out["unloaded_gateway_ttft_p50_le_s"] = histogram_quantile(gw_before, gw_after, 0.5)
        out["unloaded_gateway_ttft_p90_le_s"] = histogram_quantile(gw_before, gw_after, 0.9)
        out["unloaded_engine"] = step_stats(steps_before, fleet.engine_steps())
        print(f"unloaded protected TTFT p90: {unloaded}", flush=True)
    # 3. and 4. the flood, without then with flow control
    floods = (
        ("without_flow_control", "with_flow_control", "with_flow_control_noisy_bounded")
        if "flood" in args.phases
        else ()
    )
    for key in floods:
        fleet.drained()
        keys = {
            "without_flow_control": (SHARED, SHARED),
            "with_flow_control": (NOISY, PROTECTED),
            "with_flow_control_noisy_bounded": (NOISY_BOUNDED, PROTECTED),
        }[key]
        out[key] = await flood(fleet, args, capacity, *keys)
        print(f"{key}:", out[key], flush=True)
    for key in floods:
        got = out[key]["protected_ttft_p90_s"]
        out[key]["ratio_to_unloaded"] = (
            round(got / unloaded, 2) if got is not None and unloaded else None
        )
        gw, gw0 = out[key]["protected_gateway_ttft_p90_le_s"], out["unloaded_gateway_ttft_p90_le_s"]
        out[key]["gateway_bucket_ratio_to_unloaded"] = round(gw / gw0, 2) if gw and gw0 else None
    fleet.drained()
    if "fair" in args.phases:
        out["fair_share"] = await fair_share(fleet, args)
        print("n=64 vs n=1:", out["fair_share"], flush=True)
        fleet.drained()
    if "batch" in args.phases:
        out["batch"] = await batch_beside_online(fleet, args, unloaded)
        print("batch:", out["batch"], flush=True)
    return out


# Each chunk of a streamed completion with vLLM's continuous usage stats
# carries its choice's index and the tokens that choice has generated so far.
_CHUNK_USAGE = re.compile(
    rb'"index":\s*(\d+).*"prompt_tokens":\s*(\d+).*"completion_tokens":\s*(\d+)'
)


async def counted(
    client: httpx.AsyncClient, url: str, key: str, body: dict, timeout: float, marks: list
) -> str:
    """One streamed request; appends (time, choice, prompt tokens, that
    choice's completion tokens so far) to ``marks`` for each chunk."""
    headers = {"authorization": f"Bearer {key}"}
    mine: list[tuple[float, int, int, int]] = []
    marks.append(mine)
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, headers=headers, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return str(resp.status_code)
            async for line in resp.aiter_lines():
                m = _CHUNK_USAGE.search(line.encode()) if line.startswith("data: {") else None
                if m:
                    mine.append((time.monotonic(), int(m[1]), int(m[2]), int(m[3])))
            return "200"
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as e:
        return type(e).__name__


def in_window(marks: list, start: float, end: float) -> tuple[int, int]:
    """(completion tokens, prompt tokens) the requests of ``marks`` received in
    [start, end): each choice's tokens by its chunks' arrival, a request's
    prompt when its first chunk arrives (its prefill is done)."""
    output = prompt = 0
    for request in marks:
        if request and start <= request[0][0] < end:
            prompt += request[0][2]
        before: dict[int, int] = {}
        upto: dict[int, int] = {}
        for t, choice, _, done in request:
            if t < start:
                before[choice] = done
            elif t < end:
                upto[choice] = done
        output += sum(done - before.get(choice, 0) for choice, done in upto.items())
    return output, prompt


async def fair_share(fleet: Fleet, args: argparse.Namespace) -> dict:
    """5. Two keys of equal weight, closed loops: n=64 requests and n=1 requests.

    Throughput is what each key receives within the phase, after a warm-up
    (``--fair-warmup``): tokens counted as their streamed chunks arrive, not
    whole requests at their end (an ``n=64`` request is thousands of tokens:
    one finishing just after the phase, counted whole, would move its key's
    figure by a share of the phase's requests)."""
    stream = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    big = {**noisy_body(args.fair_tokens), "n": 64, **stream}
    little = {**noisy_body(args.fair_tokens), **stream}
    marks_a: list = []
    marks_b: list = []
    deadline = time.monotonic() + args.phase_seconds
    start = deadline - args.phase_seconds + args.fair_warmup

    async def loop(
        client: httpx.AsyncClient, key: str, body: dict, n: int, marks: list
    ) -> list[str]:
        out: list[str] = []

        async def worker() -> None:
            while time.monotonic() < deadline:
                out.append(await counted(client, fleet.url, key, body, args.timeout, marks))

        await asyncio.gather(*(worker() for _ in range(n)))
        return out

    tenant_a, tenant_b = security.caller_id(KEY_A), security.caller_id(KEY_B)
    samples: list[dict] = []
    at_deadline: dict = {}

    async def sample(client: httpx.AsyncClient) -> None:
        """The gateway's view every ``--fair-sample`` seconds until the deadline,
        and once at it (what each key had admitted and not finished then)."""
        while True:
            now = time.monotonic()
            view = (await client.get(fleet.url + "/engines", headers=fleet.admin)).json()
            e = view["engines"][0]
            tenants = {t["tenant"]: t for t in view["tenants"]}
            row = {
                "t": round(now - (deadline - args.phase_seconds), 2),
                "admitted": e["admitted"],
                "capacity": e["capacity"],
            }
            # The engine's own count: sequences running and waiting there, and
            # of those waiting the ones beyond its free slots.
            text = (await client.get(e["url"] + "/metrics", headers=fleet.admin)).text
            for line in text.splitlines():
                series = line.split("{", 1)[0].split(" ", 1)[0]
                for name in ("running", "waiting", "waiting_for_slot"):
                    if series == f"pdfleet_engine_num_requests_{name}":
                        row[f"engine_{name}"] = float(line.rsplit(" ", 1)[1])
            for name, t in (("n64", tenant_a), ("n1", tenant_b)):
                got = tenants.get(t, {})
                row[f"{name}_queued"] = got.get("queued", 0)
                row[f"{name}_inflight"] = got.get("inflight", 0)
                row[f"{name}_inflight_tokens"] = got.get("inflight_tokens", 0)
            if now >= deadline:
                text = (await client.get(fleet.url + "/metrics", headers=fleet.admin)).text
                for line in text.splitlines():
                    if line.startswith("pdfleet_gateway_tenant_tokens_total{"):
                        name, value = line.rsplit(" ", 1)
                        at_deadline[name.replace("pdfleet_gateway_", "")] = float(value)
                at_deadline.update(row)
                return
            samples.append(row)
            await asyncio.sleep(min(args.fair_sample, max(0.0, deadline - time.monotonic())))

    steps_before, gate_before = fleet.engine_steps(), fleet.refusals()
    async with (
        httpx.AsyncClient(limits=httpx.Limits(max_connections=4096)) as client,
        httpx.AsyncClient() as watcher,
    ):
        sampler = asyncio.create_task(sample(watcher))
        a, b = await asyncio.gather(
            loop(client, KEY_A, big, args.n64_concurrency, marks_a),
            loop(client, KEY_B, little, args.n1_concurrency, marks_b),
        )
        await sampler
    steps_after, gate_after = fleet.engine_steps(), fleet.refusals()
    seconds = deadline - start
    out_a, prompt_a = in_window(marks_a, start, deadline)
    out_b, prompt_b = in_window(marks_b, start, deadline)
    # The same from the phase's first moment (the warm-up's start included).
    begin = deadline - args.phase_seconds
    whole_a, whole_b = in_window(marks_a, begin, deadline), in_window(marks_b, begin, deadline)
    tput_a, tput_b = out_a / seconds, out_b / seconds
    # What fair share equalizes: the gateway's cost, prompt plus output tokens
    # (a prompt counted once per request, whatever its n).
    cost_a, cost_b = (out_a + prompt_a) / seconds, (out_b + prompt_b) / seconds

    def ratio(x: float, y: float) -> float | None:
        return round(min(x, y) / max(x, y), 3) if max(x, y) else None

    admitted = {
        k.split('"')[1]: v - gate_before.get(k, 0.0)
        for k, v in gate_after.items()
        if k.startswith("tenant_tokens_total{") and v > gate_before.get(k, 0.0)
    }
    # The cost of each key's requests that ended by the deadline: what it had
    # admitted then less what it held then (read a moment apart: within a
    # request that came between).
    ended = {
        name: at_deadline.get(f'tenant_tokens_total{{tenant="{t}"}}', 0.0)
        - gate_before.get(f'tenant_tokens_total{{tenant="{t}"}}', 0.0)
        - at_deadline.get(f"{name}_inflight_tokens", 0)
        for name, t in (("n64", tenant_a), ("n1", tenant_b))
    }
    after_warmup = [x for x in samples if x["t"] >= args.fair_warmup]
    capacities = [x["capacity"] for x in samples if x["capacity"] is not None]

    return {
        "window_s": round(seconds, 1),
        "n64_tokens_per_s": round(tput_a, 1),
        "n1_tokens_per_s": round(tput_b, 1),
        "ratio_min_max": ratio(tput_a, tput_b),
        "n64_prompt_plus_output_tokens_per_s": round(cost_a, 1),
        "n1_prompt_plus_output_tokens_per_s": round(cost_b, 1),
        "ratio_prompt_plus_output_min_max": ratio(cost_a, cost_b),
        "n64_outcomes": dict(Counter(a)),
        "n1_outcomes": dict(Counter(b)),
        # The whole phase, warm-up and tail included: what the gateway
        # admitted by tenant (its cost) and the engine's preemptions.
        "admitted_tokens": admitted,
        "whole_phase_prompt_plus_output": {
            "n64": sum(whole_a),
            "n1": sum(whole_b),
            "ratio_min_max": ratio(sum(whole_a), sum(whole_b)),
        },
        "whole_phase_output_ratio_min_max": ratio(whole_a[0], whole_b[0]),
        "ended_cost_by_deadline": {k: round(v) for k, v in ended.items()},
        "ended_cost_ratio_min_max": ratio(ended["n64"], ended["n1"]),
        # The gateway's view sampled through the phase: the engine's learned
        # capacity, and (after the warm-up) how often the n=1 key had nothing
        # waiting in the gateway's queue and how full the engine's slots were.
        "capacity_min_max": [min(capacities), max(capacities)] if capacities else None,
        "samples_after_warmup": len(after_warmup),
        "n1_queued_mean": round(sum(x["n1_queued"] for x in after_warmup) / len(after_warmup), 1)
        if after_warmup
        else None,
        "n1_queued_zero_share": round(
            sum(1 for x in after_warmup if not x["n1_queued"]) / len(after_warmup), 3
        )
        if after_warmup
        else None,
        "admitted_slots_mean": round(
            sum(x["admitted"] for x in after_warmup) / len(after_warmup), 1
        )
        if after_warmup
        else None,
        "engine_running_mean": round(
            sum(x.get("engine_running", 0) for x in after_warmup) / len(after_warmup), 1
        )
        if after_warmup
        else None,
        "view_samples": samples,
        "engine_preemptions": steps_after.get("pdfleet_engine_num_preemptions_total", 0.0)
        - steps_before.get("pdfleet_engine_num_preemptions_total", 0.0),
    }


async def batch_beside_online(fleet: Fleet, args: argparse.Namespace, unloaded) -> dict:
    """6. A batch on idle capacity, with the protected light load beside it."""
    oc = openai.OpenAI(base_url=fleet.url + "/v1", api_key=KEY_B, max_retries=2, timeout=60)
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {**noisy_body(8), "prompt": f"{i} {PROMPT}"},
            }
        )
        for i in range(args.batch_requests)
    ]
    file_id = oc.files.create(
        file=("batch.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    ).id

    # The protected TTFT just before the batch, twice (the machine's load
    # drifts: the ratio compares it with the same minutes, and the two windows
    # before say how far it moves with no batch at all), sent the same way as
    # beside the batch: one request at a time, an interval apart.
    async def protected(client: httpx.AsyncClient, until) -> list[float]:
        ttfts: list[float] = []
        while not until():
            o, t, _ = await one(client, fleet.url, PROTECTED, small(), args.timeout)
            if o == "200" and t is not None:
                ttfts.append(t)
            await asyncio.sleep(args.protected_interval)
        return ttfts

    def for_seconds(seconds: float):
        end = time.monotonic() + seconds
        return lambda: time.monotonic() >= end

    async with httpx.AsyncClient() as client:
        before_a = await protected(client, for_seconds(args.phase_seconds / 2))
        before_b = await protected(client, for_seconds(args.phase_seconds / 2))
    ac = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key=KEY_B, max_retries=2, timeout=60)
    started = time.monotonic()
    batch = await ac.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    )
    done = asyncio.Event()
    status = batch

    async def watch() -> None:
        nonlocal status
        while True:
            status = await ac.batches.retrieve(batch.id)
            if status.status not in ("in_progress", "validating", "finalizing"):
                break
            if time.monotonic() - started > args.batch_timeout:
                await ac.batches.cancel(batch.id)
                break
            await asyncio.sleep(0.5)
        done.set()

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient() as client:
        ttfts = await protected(client, done.is_set)
    await watcher
    wall = time.monotonic() - started
    during, just_before = p90(ttfts), p90(before_a + before_b)
    pa, pb = p90(before_a), p90(before_b)
    return {
        "requests": args.batch_requests,
        "status": status.status,
        "completed": status.request_counts.completed if status.request_counts else None,
        "failed": status.request_counts.failed if status.request_counts else None,
        "wall_s": round(wall, 1),
        "protected_ttft_p90_during_s": during,
        "protected_ttft_p50_during_s": p50(ttfts),
        "protected_samples": len(ttfts),
        "ratio_to_unloaded": round(during / unloaded, 2) if during and unloaded else None,
        "protected_ttft_p90_just_before_s": just_before,
        "ratio_to_just_before": round(during / just_before, 2) if during and just_before else None,
        "protected_ttft_p90_before_windows_s": [pa, pb],
        "a_a_ratio_before_windows": round(pb / pa, 2) if pa and pb else None,
        "protected_samples_before": len(before_a) + len(before_b),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood", type=float, default=5.0, help="noisy load, × the capacity")
    ap.add_argument("--phase-seconds", type=float, default=20.0)
    ap.add_argument(
        "--protected-interval",
        type=float,
        default=0.25,
        help="seconds between the protected tenant's requests (light: 8 output tokens each)",
    )
    ap.add_argument(
        "--noisy-tokens",
        type=int,
        default=256,
        help="output tokens of each noisy request: long enough that 5x the capacity in "
        "requests a second is a rate one Python client can send beside the fleet",
    )
    ap.add_argument("--noisy-max-queued", type=int, default=8)
    ap.add_argument("--fair-tokens", type=int, default=16)
    ap.add_argument(
        "--noisy-max-inflight",
        type=int,
        default=8,
        help="max_inflight_requests of the noisy-bounded tenant (its flood is the last one)",
    )
    ap.add_argument(
        "--prompt-token-weight",
        type=float,
        default=1.0,
        help="the tenants file's prompt_token_weight (what fair share counts a prompt token for)",
    )
    ap.add_argument("--n64-concurrency", type=int, default=4)
    ap.add_argument(
        "--fair-sample",
        type=float,
        default=0.25,
        help="seconds between samples of the gateway's view in the n=64 vs n=1 phase",
    )
    ap.add_argument(
        "--fair-warmup",
        type=float,
        default=5.0,
        help="seconds of the n=64 vs n=1 phase before its throughputs are counted",
    )
    ap.add_argument(
        "--n1-concurrency",
        type=int,
        default=128,
        help="the n=1 key's requests in flight: enough to want its share (the n=64 key has 4)",
    )
    ap.add_argument("--capacity-concurrency", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--batch-requests", type=int, default=1000)
    ap.add_argument("--batch-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout per request")
    ap.add_argument(
        "--phases",
        default="flood,fair,batch",
        help="which of flood, fair, batch to run (capacity and unloaded always run)",
    )
    ap.add_argument(
        "--threads-per-engine",
        type=int,
        default=0,
        help="the engine's torch threads (0: pdfleet up's default)",
    )
    ap.add_argument(
        "--flood-nice",
        type=int,
        default=10,
        help="niceness the flood's generator process adds to this one's (0: the fleet's "
        "priority, as before; the flood's clients would run on machines of their own)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdfleet-flow-") as tmp:
        fleet = Fleet(Path(tmp), args)
        try:
            result = asyncio.run(run(args, fleet))
        finally:
            fleet.stop()
            for pool in (_PROTECTED_POOL, _FLOOD_POOL):
                if pool is not None:
                    pool.shutdown()
    result["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average_start": [round(x, 1) for x in load_start],
        "load_average_end": [round(x, 1) for x in os.getloadavg()],
    }
    result["args"] = vars(args)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
