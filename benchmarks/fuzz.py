"""Schema-driven fuzzing of a pdfleet server's OpenAPI routes: no input may give a 5xx.

schemathesis generates requests from the server's own ``/openapi.json``, both
valid ones (positive) and ones that break the schema (negative: wrong types,
missing fields, out-of-range values), for every operation, and this script
sends them and counts the answers by status. Any 5xx is a failure: bad input
must be a 4xx, and a valid request must be served. At the end the server must
still be healthy.

By default it starts its own ``pdfleet serve`` on the tiny model with a fleet
secret and fuzzes it with the fleet token; ``--url`` (and ``--token``) fuzzes
a running engine or gateway instead. Generated ``max_tokens`` are capped
(``--max-tokens``) so that a run of a few thousand requests stays short on a
CPU; everything else is as schemathesis generates it.

    python benchmarks/fuzz.py --requests 2000 --json benchmarks/results/fuzz_engine_cpu.json

Needs the ``fuzz`` extra (schemathesis).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from pdfleet.engine.contracts.launch import python_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(secret: str) -> tuple[subprocess.Popen, str]:
    import httpx

    from pdfleet.engine.tiny.builder import ensure_tiny_model

    model = ensure_tiny_model()
    port = free_port()
    log = open(os.path.join(tempfile.gettempdir(), "pdfleet-fuzz-engine.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *python_module("pdfleet.engine.cli"),
            "serve",
            model,
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--disable-log-stats",
            "--uvicorn-log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PDFLEET_FLEET_SECRET": secret, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("the engine did not become healthy within 180s")


def cap_lengths(body: Any, cap: int) -> None:
    """Keep generation short: a fuzz run measures admission, not decoding speed."""
    if not isinstance(body, dict):
        return
    names = ("max_tokens", "max_completion_tokens")
    for name in names:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if not any(name in body for name in names) and ("prompt" in body or "messages" in body):
        body["max_tokens"] = cap


def fuzz_operation(
    op: Any,
    mode: Any,
    num_cases: int,
    round_seed: int,
    args: argparse.Namespace,
    url: str,
    headers: dict[str, str],
    statuses: Counter[int],
    by_operation: dict[str, Counter[int]],
    server_errors: list[dict[str, Any]],
) -> None:
    """Send ``num_cases`` generated requests for one operation in one generation mode."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis.errors import Unsatisfiable

    counts = by_operation.setdefault(op.label, Counter())

    @seed(round_seed)
    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(op.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        cap_lengths(case.body, args.max_tokens)
        try:
            response = case.call(base_url=url, headers=headers, timeout=60)
            status, text = response.status_code, response.text[:300]
        except Exception as e:  # the server dropped the connection
            status, text = 599, f"{type(e).__name__}: {e}"
        statuses[status] += 1
        counts[status] += 1
        if status >= 500 and len(server_errors) < 20:
            server_errors.append(
                {
                    "operation": op.label,
                    "mode": mode.value,
                    "body": case.body if isinstance(case.body, dict | list) else None,
                    "query": case.query,
                    "status": status,
                    "response": text,
                }
            )

    # Unsatisfiable: nothing to break in this mode (negative cases of a route without inputs).
    with contextlib.suppress(Unsatisfiable):
        send()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="fuzz this server instead of starting an engine")
    parser.add_argument("--token", help="bearer token for --url (default: none)")
    parser.add_argument(
        "--schema-url",
        help="server whose /openapi.json drives the run (default: --url); a gateway serves "
        "none, so fuzz it with an engine's schema",
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests to send in all")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()

    import httpx
    import schemathesis
    from schemathesis import GenerationMode

    from pdfleet.engine.contracts import security

    proc = None
    if args.url:
        url, token = args.url.rstrip("/"), args.token
    else:
        secret = security.generate_secret()
        proc, url = start_engine(secret)
        token = security.fleet_token(secret.encode())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        config = schemathesis.Config()
        schema_url = (args.schema_url or url).rstrip("/")
        schema = schemathesis.openapi.from_url(
            schema_url + "/openapi.json", headers=headers, config=config
        )
        operations = [r.ok() for r in schema.get_all_operations()]
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        with_inputs = [op for op in operations if op.method.upper() == "POST"]
        per_case = max(1, args.requests // (2 * len(with_inputs) * 2))
        statuses: Counter[int] = Counter()
        by_operation: dict[str, Counter[int]] = {}
        server_errors: list[dict[str, Any]] = []
        start = time.monotonic()
        rounds = 0
        # Rounds with fresh seeds until enough requests went out (routes without
        # inputs give one distinct request per round).
        while sum(statuses.values()) < args.requests:
            for op in operations:
                for mode in modes:
                    fuzz_operation(
                        op,
                        mode,
                        per_case,
                        args.seed + rounds,
                        args,
                        url,
                        headers,
                        statuses,
                        by_operation,
                        server_errors,
                    )
            rounds += 1
        elapsed = time.monotonic() - start
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    total = sum(statuses.values())
    num_5xx = sum(n for s, n in statuses.items() if s >= 500)
    summary = {
        "target": "engine (tiny model, CPU)" if proc is not None else url,
        "requests": total,
        "seconds": round(elapsed, 1),
        "num_5xx": num_5xx,
        "healthy_after": healthy,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "by_operation": {
            k: {str(s): n for s, n in sorted(v.items())} for k, v in by_operation.items()
        },
        "server_errors": server_errors,
        "schemathesis": schemathesis.SCHEMATHESIS_VERSION,
        "max_tokens_cap": args.max_tokens,
        "rounds": rounds,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 0 if num_5xx == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
