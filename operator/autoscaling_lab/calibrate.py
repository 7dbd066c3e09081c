"""``pdfleet sim calibrate``: measure the simulator's fleet model on real engines.

Against each running engine (an OpenAI-compatible pdfleet or vLLM server) it
measures, in bounded time:

* **prefill**: requests with ``max_tokens: 1`` at a few prompt lengths, one
  at a time; the wall time ``t = overhead + prompt / rate`` fitted by least
  squares gives ``prefill_tokens_per_second`` and ``prefill_overhead_seconds``;
* **decode step time** over a small grid of batch sizes and prompt lengths:
  a batch of concurrent streams (``ignore_eos``), the step time read in the
  window where every stream of the batch is decoding (after the last first
  token, before the first finish), fitted to ``a + b * batch + c * context``
  (``decode_step_seconds``, ``..._per_seq``, ``..._per_token``);
* **KV capacity** from the engine's ``/metrics`` cache-config series
  (``block_size`` x ``num_gpu_blocks``);
* **cold start**, optionally, by starting ``--cold-start-command`` and timing
  it to a healthy ``--cold-start-url``, or as given by ``--cold-start-seconds``.

Prompts are random token ids so that prefix caching cannot shorten them (the
tokens a response reports as cached are subtracted anyway). The result is a
fleet-model JSON that ``pdfleet sim --fleet-model FILE`` reads
(docs/autoscaling.md, "Calibrating the fleet model").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ...engine.config.dataclass_cli import add_dataclass_arguments, dataclass_from_arguments
from ...engine.contracts import metrics as names
from ...engine.contracts import security
from ...engine.contracts.model_card import decode_list
from .sim_fleet import FleetModel


@dataclass(frozen=True)
class CalibrateOptions:
    """What ``pdfleet sim calibrate`` measures and where it writes the model."""

    out_file: str = "fleet_model.json"
    """Where to write the fleet-model JSON (``pdfleet sim --fleet-model``)."""
    prefill_prompt_tokens: tuple[int, int, int] = (32, 128, 384)
    """Prompt lengths of the prefill measurement (clamped to the model's length)."""
    prefill_repeats: int = 3
    """Requests per prefill prompt length."""
    decode_batches: tuple[int, int, int] = (1, 4, 8)
    """Batch sizes of the decode grid."""
    decode_prompt_tokens: tuple[int, int] = (32, 256)
    """Prompt lengths of the decode grid (the batch's context grows with them)."""
    decode_output_tokens: int = 24
    """Tokens each decode stream generates."""
    request_timeout_seconds: float = 60.0
    """Bound on one request."""
    time_budget_seconds: float = 300.0
    """Bound on the whole measurement of one engine; points left are skipped."""
    api_key: str | None = None
    """Bearer token for the engines. Default: the fleet token of
    PDFLEET_FLEET_SECRET, else the first of PDFLEET_API_KEYS, else none."""
    cold_start_seconds: float | None = None
    """Cold start to write when not measured (default: the model's default)."""
    cold_start_command: str | None = None
    """Command that starts one engine (e.g. ``pdfleet serve MODEL --port 8123``);
    timed from its start to a healthy ``--cold-start-url``, then stopped."""
    cold_start_url: str | None = None
    """Base URL the cold-start command's engine answers ``/health`` on."""
    cold_start_timeout_seconds: float = 600.0
    """Bound on the timed cold start."""
    seed: int = 0
    """Seed of the random prompt token ids."""


def _bearer(options: CalibrateOptions) -> dict[str, str]:
    token = options.api_key
    if token is None:
        secret = security.fleet_secret_from_env()
        if secret is not None:
            token = security.fleet_token(secret)
        else:
            keys = security.api_keys_from_env()
            token = next(iter(keys), None) if keys else None
    return {"authorization": f"Bearer {token}"} if token else {}


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Coefficients x minimizing |rows @ x - ys| (normal equations, Gaussian
    elimination with partial pivoting; a few unknowns only)."""
    n = len(rows[0])
    if len(rows) < n:
        raise ValueError(f"a fit of {n} coefficients needs at least {n} points, got {len(rows)}")
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("the calibration points do not determine the fit (all alike)")
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for k in range(col + 1, n):
            f = a[k][col] / a[col][col]
            for j in range(col, n):
                a[k][j] -= f * a[col][j]
            b[k] -= f * b[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


class _Engine:
    """One engine's HTTP surface, every call bounded."""

    def __init__(self, url: str, options: CalibrateOptions) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self.headers = _bearer(options)
        self.client = httpx.Client(
            base_url=self.url, headers=self.headers, timeout=options.request_timeout_seconds
        )
        self.rng = random.Random(options.seed)
        self.model, self.max_model_len = self._model()

    def close(self) -> None:
        self.client.close()

    def _model(self) -> tuple[str, int | None]:
        try:
            r = self.client.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"--url {self.url}: no engine answers ({e})") from None
        if r.status_code != 200:
            raise ValueError(
                f"--url {self.url}: /v1/models answered {r.status_code}: {r.text[:200]}"
            )
        try:
            cards = decode_list(r.json())
        except ValueError as e:
            raise ValueError(f"--url {self.url}: {e}") from None
        if not cards:
            raise ValueError(f"--url {self.url}: /v1/models lists no model")
        return cards[0].id, cards[0].max_model_len

    def prompt(self, tokens: int) -> list[int]:
        # Ids low enough for any vocabulary; random so no prefix is cached.
        return [self.rng.randrange(5, 250) for _ in range(tokens)]

    def clamp(self, prompt: int, output: int) -> int:
        if self.max_model_len is None:
            return prompt
        return max(1, min(prompt, self.max_model_len - output - 1))

    def prefill_once(self, tokens: int) -> tuple[float, int]:
        """(wall seconds, prompt tokens computed) of one max_tokens=1 request."""
        body = {"model": self.model, "prompt": self.prompt(tokens), "max_tokens": 1}
        started = time.perf_counter()
        r = self.client.post("/v1/completions", json=body)
        took = time.perf_counter() - started
        if r.status_code != 200:
            raise ValueError(
                f"{self.url}: a prefill request answered {r.status_code}: {r.text[:200]}"
            )
        usage = r.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return took, int(usage.get("prompt_tokens", tokens)) - int(cached)

    def stream(self, tokens: int, output: int, times: list[float], errors: list[str]) -> None:
        """One streaming request; appends each output token's arrival time."""
        body = {
            "model": self.model,
            "prompt": self.prompt(tokens),
            "max_tokens": output,
            "min_tokens": output,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"status {r.status_code}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if any(c.get("text") is not None for c in chunk.get("choices", [])):
                            times.append(time.perf_counter())
        except httpx.HTTPError as e:
            errors.append(str(e))

    def decode_point(self, batch: int, tokens: int, output: int) -> float | None:
        """Seconds per step while all ``batch`` streams decode together."""
        per: list[list[float]] = [[] for _ in range(batch)]
        errors: list[str] = []
        threads = [
            threading.Thread(target=self.stream, args=(tokens, output, per[i], errors), daemon=True)
            for i in range(batch)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.options.request_timeout_seconds)
        if errors or any(t.is_alive() for t in threads):
            raise ValueError(
                f"{self.url}: a decode stream of batch {batch} failed: "
                f"{errors[0] if errors else 'timed out'}"
            )
        if any(len(ts) < 3 for ts in per):
            return None
        start = max(ts[0] for ts in per)
        end = min(ts[-1] for ts in per)
        steps = []
        for ts in per:
            inside = [t for t in ts if start <= t <= end]
            if len(inside) >= 3:
                steps.append((inside[-1] - inside[0]) / (len(inside) - 1))
        if not steps:
            # Streams barely overlapped: take each one's own mean gap.
            steps = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in per]
        return statistics.mean(steps)

    def kv_capacity_tokens(self) -> int | None:
        r = self.client.get("/metrics")
        if r.status_code != 200:
            return None
        scrape = names.parse_metrics(r.text)
        labels = scrape.labels(names.ENGINE_CACHE_CONFIG.name, names.VLLM_CACHE_CONFIG_INFO.name)
        if not labels:
            return None
        try:
            return int(labels[names.BLOCK_SIZE]) * int(labels[names.NUM_GPU_BLOCKS])
        except (KeyError, ValueError):
            return None


def calibrate_engine(url: str, options: CalibrateOptions) -> dict[str, Any]:
    """Every measurement against one engine (raw points and fitted values)."""
    engine = _Engine(url, options)
    deadline = time.monotonic() + options.time_budget_seconds
    try:
        engine.prefill_once(8)  # warm-up: first-request costs are not the model's
        prefill: list[tuple[int, float]] = []
        for tokens in options.prefill_prompt_tokens:
            n = engine.clamp(tokens, 1)
            for _ in range(options.prefill_repeats):
                if time.monotonic() > deadline:
                    break
                took, computed = engine.prefill_once(n)
                prefill.append((computed, took))
        if len({p for p, _ in prefill}) < 2:
            raise ValueError(f"{url}: too few prefill points in the time budget ({prefill})")
        overhead, per_token = least_squares([(1.0, p) for p, _ in prefill], [t for _, t in prefill])
        if per_token <= 0:
            # Noise swamped the length's effect: the longest prompts' mean rate.
            longest = max(p for p, _ in prefill)
            per_token = statistics.mean(t for p, t in prefill if p == longest) / longest
            overhead = 0.0
        output = options.decode_output_tokens
        decode: list[tuple[int, float, float]] = []  # (batch, context tokens, step s)
        for tokens in options.decode_prompt_tokens:
            n = engine.clamp(tokens, output)
            for batch in options.decode_batches:
                if time.monotonic() > deadline:
                    break
                step = engine.decode_point(batch, n, output)
                if step is not None:
                    decode.append((batch, batch * (n + output / 2), step))
        fit = _fit_steps(decode)
        return {
            "url": engine.url,
            "model": engine.model,
            "prefill_points": [{"prompt_tokens": p, "seconds": t} for p, t in prefill],
            "decode_points": [
                {"batch": b, "context_tokens": c, "step_seconds": s} for b, c, s in decode
            ],
            "prefill_tokens_per_second": 1.0 / per_token,
            "prefill_overhead_seconds": max(overhead, 0.0),
            **fit,
            "kv_capacity_tokens": engine.kv_capacity_tokens(),
        }
    finally:
        engine.close()


def _fit_steps(points: Sequence[tuple[int, float, float]]) -> dict[str, float]:
    """step = a + b * batch + c * context, each coefficient >= 0 (a > 0)."""
    if not points:
        raise ValueError("no decode point was measured in the time budget")
    steps = [s for _, _, s in points]
    fit = [min(steps), 0.0, 0.0]
    if len(points) >= 3:
        with contextlib.suppress(ValueError):  # points all alike: keep the constant
            fit = least_squares([(1.0, b, c) for b, c, _ in points], steps)
    a, b, c = fit
    if b < 0 or c < 0:
        # A negative slope is noise: refit without it.
        keep = 1 if b >= 0 else 2
        cols = [(1.0, (b_ if keep == 1 else c_)) for b_, c_, _ in points]
        try:
            a, s = least_squares(cols, steps)
        except ValueError:
            a, s = min(steps), 0.0
        s = max(s, 0.0)
        b, c = (s, 0.0) if keep == 1 else (0.0, s)
    if a <= 0:
        a = min(steps)
    return {
        "decode_step_seconds": a,
        "decode_step_seconds_per_seq": b,
        "decode_step_seconds_per_token": c,
    }


def time_cold_start(command: str, url: str, timeout: float) -> float:
    """Seconds from starting ``command`` to ``url``/health answering 200; the
    process (group) is stopped afterwards."""
    started = time.monotonic()
    proc = subprocess.Popen(
        shlex.split(command),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = started + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ValueError(f"--cold-start-command exited with {proc.returncode}: {command}")
            try:
                if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ValueError(f"--cold-start-command not healthy at {url} within {timeout:g} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def calibrate(urls: Sequence[str], options: CalibrateOptions) -> dict[str, Any]:
    """Measure every engine and combine them (median per value) into a fleet model."""
    if not urls:
        raise ValueError("give at least one --url of a running engine")
    if (options.cold_start_command is None) != (options.cold_start_url is None):
        raise ValueError("--cold-start-command and --cold-start-url go together")
    for name in ("prefill_prompt_tokens", "decode_batches", "decode_prompt_tokens"):
        if any(v < 1 for v in getattr(options, name)):
            raise ValueError(f"--{name.replace('_', '-')} values must be >= 1")
    if options.decode_output_tokens < 4:
        raise ValueError("--decode-output-tokens must be >= 4")
    started = time.monotonic()
    engines = [calibrate_engine(url, options) for url in urls]
    model: dict[str, Any] = {}
    for key in (
        "prefill_tokens_per_second",
        "prefill_overhead_seconds",
        "decode_step_seconds",
        "decode_step_seconds_per_seq",
        "decode_step_seconds_per_token",
    ):
        model[key] = statistics.median(e[key] for e in engines)
    capacities = [e["kv_capacity_tokens"] for e in engines if e["kv_capacity_tokens"]]
    if capacities:
        model["kv_capacity_tokens"] = int(statistics.median(capacities))
    cold = options.cold_start_seconds
    cold_source = "flag" if cold is not None else "default"
    if options.cold_start_command is not None and options.cold_start_url is not None:
        cold = time_cold_start(
            options.cold_start_command, options.cold_start_url, options.cold_start_timeout_seconds
        )
        cold_source = "measured"
    if cold is not None:
        model["cold_start_seconds"] = cold
    FleetModel(**model)  # the values must make a valid model
    return {
        "fleet_model": model,
        "cold_start_source": cold_source,
        "engines": engines,
        "seconds": time.monotonic() - started,
    }


def load_fleet_model(path: str) -> dict[str, Any]:
    """The FleetModel fields of a ``calibrate`` JSON (or of a flat mapping)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"--fleet-model: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--fleet-model: {path} is not JSON: {e}") from None
    values = doc.get("fleet_model", doc) if isinstance(doc, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"--fleet-model: {path} must hold a mapping of fleet-model fields")
    known = {f.name for f in dataclasses.fields(FleetModel)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"--fleet-model: {path}: unknown field {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    return values


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="measure the simulator's fleet model against running engines",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of a running engine (repeat for several; values are medians)",
    )
    add_dataclass_arguments(
        parser,
        CalibrateOptions,
        metavars={
            "prefill_prompt_tokens": ("SHORT", "MID", "LONG"),
            "decode_batches": ("B1", "B2", "B3"),
            "decode_prompt_tokens": ("SHORT", "LONG"),
        },
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    options = dataclass_from_arguments(CalibrateOptions, args)
    result = calibrate(args.url, options)
    with open(options.out_file, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    m = result["fleet_model"]
    print(
        f"prefill {m['prefill_tokens_per_second']:.0f} tok/s + "
        f"{m['prefill_overhead_seconds'] * 1000:.1f} ms; decode step "
        f"{m['decode_step_seconds'] * 1000:.2f} ms + {m['decode_step_seconds_per_seq'] * 1e6:.1f} "
        f"us/seq + {m['decode_step_seconds_per_token'] * 1e9:.2f} ns/token; KV "
        f"{m.get('kv_capacity_tokens', 'default')} tokens; cold start "
        f"{m.get('cold_start_seconds', 'default')} ({result['cold_start_source']}); "
        f"{result['seconds']:.0f} s; wrote {options.out_file}"
    )
    return 0
