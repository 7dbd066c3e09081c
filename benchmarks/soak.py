"""Gateway soak: steady mixed load for a while; does the gateway's memory or fd count grow?

One prefill and one decode engine (the built-in tiny model, joined by NIXL)
behind a gateway in ``Conditional`` mode, all sharing a fleet secret
generated for the run, and ``--concurrency`` clients sending, in a loop,
every kind of request the gateway handles: short streams (decode-only), long
JSON requests (P/D), requests refused before any leg (``min_tokens >
max_tokens``), requests with client ``kv_transfer_params`` (dropped), and
streams the client abandons after the first event. Every prompt is new, so
the prefix-affinity table fills to its bound during the run.

The gateway's RSS (``/proc/PID/status`` VmRSS) and open fds are sampled every
``--sample`` seconds; the report compares the end with the start of the
measured window (after ``--warmup`` seconds) and prints the growth. Target:
both within 10% of the start. Rerun:

    .venv/bin/python benchmarks/soak.py --duration 600 --json benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import httpx
from fleet import Fleet, engine_env, free_port, tiny_model

from pdfleet.engine.contracts.metrics import GATEWAY_FALLBACKS, GATEWAY_REQUESTS
from pdfleet.engine.contracts.security import fleet_token, generate_secret

WORDS = ["the", "harbor", "was", "quiet", "before", "dawn", "and", "fishing", "boats", "rocked"]


def rss_and_fds(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def prompt(rng: random.Random, words: int) -> str:
    return f"{rng.getrandbits(64):x} " + " ".join(rng.choice(WORDS) for _ in range(words))


async def client_loop(url: str, stop: float, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < stop:
            kind = rng.choices(
                ["short_stream", "long_json", "refused", "client_params", "abandoned"],
                [50, 30, 8, 6, 6],
            )[0]
            body: dict = {"model": "tiny", "max_tokens": 8, "temperature": 0}
            try:
                if kind == "short_stream":
                    body |= {"prompt": prompt(rng, 8), "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                        ok = r.status_code == 200
                elif kind == "long_json":
                    r = await client.post(
                        "/v1/completions", json=body | {"prompt": prompt(rng, 120)}
                    )
                    ok = r.status_code == 200
                elif kind == "refused":
                    body |= {"prompt": prompt(rng, 120), "max_tokens": 5, "min_tokens": 10}
                    ok = (await client.post("/v1/completions", json=body)).status_code == 400
                elif kind == "client_params":
                    body |= {"prompt": prompt(rng, 8), "kv_transfer_params": {"remote_port": 1}}
                    ok = (await client.post("/v1/completions", json=body)).status_code == 200
                else:
                    body |= {"prompt": prompt(rng, 8), "stream": True, "max_tokens": 64}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            break
                    ok = True
            except httpx.HTTPError as e:
                ok, kind = False, f"{kind}:{type(e).__name__}"
            key = kind if ok else f"unexpected:{kind}"
            counts[key] = counts.get(key, 0) + 1


async def run(url: str, pid: int, args: argparse.Namespace) -> dict:
    counts: dict[str, int] = {}
    start = time.monotonic()
    stop = start + args.warmup + args.duration
    clients = [
        asyncio.create_task(client_loop(url, stop, seed, counts))
        for seed in range(args.concurrency)
    ]
    samples = []
    while time.monotonic() < stop:
        await asyncio.sleep(args.sample)
        rss, fds = rss_and_fds(pid)
        samples.append({"t": round(time.monotonic() - start, 1), "rss_mb": rss, "fds": fds})
        print(f"t={samples[-1]['t']:>6}s rss={rss:.1f} MB fds={fds} {counts}", flush=True)
    await asyncio.wait_for(asyncio.gather(*clients), 120)
    measured = [s for s in samples if s["t"] >= args.warmup]
    first, last = measured[0], measured[-1]
    return {
        "requests": counts,
        "samples": samples,
        "start": first,
        "end": last,
        "rss_growth": last["rss_mb"] / first["rss_mb"] - 1,
        "fds_growth": last["fds"] / first["fds"] - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--duration", type=float, default=600, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=60, help="seconds before measuring")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample", type=float, default=10, help="seconds between samples")
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    model = args.model or tiny_model()
    secret = generate_secret()
    env = {**engine_env(1), "PDFLEET_FLEET_SECRET": secret}
    log_dir = Path(tempfile.mkdtemp(prefix="pdfleet-soak-"))
    engine_args = ["serve", model, "--disable-log-stats", "--max-model-len", "1024"]
    engine_args += ["--served-model-name", "tiny"]
    with Fleet(log_dir) as fleet:
        urls = {}
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            kv = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_port": free_port()}
            urls[role] = fleet.start(
                role, [*engine_args, "--kv-transfer-config", json.dumps(kv)], env=env
            )
        fleet.wait_healthy(list(urls.values()))
        gateway = fleet.start(
            "gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--prefill",
                urls["prefill"],
                "--decode",
                urls["decode"],
                "--min-prompt-tokens",
                "64",
            ],
            env={"PDFLEET_FLEET_SECRET": secret},
        )
        fleet.wait_healthy([gateway])
        pid = fleet.procs[-1][0].pid
        out = asyncio.run(run(gateway, pid, args))
        headers = {"authorization": f"Bearer {fleet_token(secret.encode())}"}
        out["gateway_metrics_tail"] = [
            line
            for line in httpx.get(
                gateway + "/metrics", headers=headers, timeout=5
            ).text.splitlines()
            if line.startswith((GATEWAY_REQUESTS.name, GATEWAY_FALLBACKS.name))
        ]
    out["config"] = vars(args)
    out["logs"] = str(log_dir)
    print(
        f"gateway RSS {out['start']['rss_mb']:.1f} -> {out['end']['rss_mb']:.1f} MB "
        f"({100 * out['rss_growth']:+.1f}%), fds {out['start']['fds']} -> {out['end']['fds']} "
        f"({100 * out['fds_growth']:+.1f}%) over {args.duration:.0f}s (target: within 10%)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
