"""Engines and gateways as real processes, and labelled metric reads (all bounded)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx

from .server import ServerProcess, fleet_headers

MAX_LEN = 512
ENGINE_ARGS = [
    "--max-model-len",
    str(MAX_LEN),
    "--served-model-name",
    "tiny",
    "--disable-log-stats",
]


def start_engines(
    model: str, log_dir: Path, names: list[str], extra: list[str] | None = None
) -> list[ServerProcess]:
    """Start engines in parallel and wait for all of them (stopping all on failure)."""
    # One torch thread per engine: several engines share the machine's cores, and
    # OpenMP threads spinning at barriers on shared cores make every step slower.
    env = {"OMP_NUM_THREADS": "1"}
    procs = [
        ServerProcess(["serve", model, *ENGINE_ARGS, *(extra or [])], log_dir, name, env=env)
        for name in names
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_healthy(180), procs))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def start_gateway(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None, healthy: bool = True
) -> ServerProcess:
    """A gateway process; by default waited for until it routes (a decode engine is up)."""
    proc = ServerProcess(["gateway", "--host", "127.0.0.1", *args], log_dir, "gateway", env=env)
    if not healthy:
        return proc
    try:
        return proc.wait_healthy(60)
    except BaseException:
        proc.stop()
        raise


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5, headers=fleet_headers()).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
