"""Engines and gateways as real processes, and labelled metric reads (all bounded)."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import httpx

from .server import ServerProcess, fleet_headers, free_port, stop_all

MAX_LEN = 512
ENGINE_ARGS = [
    "--max-model-len",
    str(MAX_LEN),
    "--served-model-name",
    "tiny",
    "--disable-log-stats",
]


def kv_transfer_args(connector: str, role: str, **extra: object) -> list[str]:
    """``--kv-transfer-config`` of one engine of a P/D pair (a fresh KV port)."""
    cfg: dict[str, object] = {"kv_connector": connector, "kv_role": role, "kv_port": free_port()}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


def start_engines(
    model: str,
    log_dir: Path,
    names: list[str],
    extra: list[str] | None = None,
    per_engine: list[list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> list[ServerProcess]:
    """Start engines in parallel and wait for all of them (stopping all on failure);
    ``per_engine[i]`` are more flags of engine ``i`` (its KV connector); ``env``:
    more environment for every engine."""
    # One torch thread per engine: several engines share the machine's cores, and
    # OpenMP threads spinning at barriers on shared cores make every step slower.
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    own = per_engine or [[] for _ in names]
    procs = [
        ServerProcess(
            ["serve", model, *ENGINE_ARGS, *(extra or []), *flags], log_dir, name, env=env
        )
        for name, flags in zip(names, own, strict=True)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_healthy(180), procs))
    except BaseException:
        stop_all(procs)
        raise
    return procs


def start_gateway(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None, healthy: bool = True
) -> ServerProcess:
    """A gateway process; by default waited for until it routes (a decode engine is up).

    ``$PDFLEET_TEST_GATEWAY_WORKERS=N`` runs every such gateway with ``--workers N``
    (unless the test gives its own), so the gateway tests prove both modes."""
    workers = os.environ.get("PDFLEET_TEST_GATEWAY_WORKERS")
    if workers and "--workers" not in args:
        args = [*args, "--workers", workers]
    proc = ServerProcess(["gateway", "--host", "127.0.0.1", *args], log_dir, "gateway", env=env)
    if not healthy:
        return proc
    try:
        return proc.wait_healthy(60)
    except BaseException:
        proc.stop()
        raise


def metric(url: str, name: str, key: str | None = None, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none);
    ``key``: the bearer credential (default: the fleet token, which engines and
    gateways of the test fleet accept on /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=auth_headers(key), timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def auth_headers(key: str | None = None) -> dict[str, str]:
    """``Authorization`` with ``key``, else with the fleet token of
    $PDFLEET_FLEET_SECRET (none when neither is set)."""
    if key is None:
        return fleet_headers()
    return {"authorization": f"Bearer {key}"} if key else {}


def engines_view(gateway_url: str, key: str | None = None) -> dict:
    """The gateway's /engines: routable counts, each engine's state, open KV pairs."""
    resp = httpx.get(gateway_url + "/engines", headers=auth_headers(key), timeout=5)
    resp.raise_for_status()
    return resp.json()
