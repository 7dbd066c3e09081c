"""Sending the workload: one streamed request, and the arrival schedule.

Every request streams (``stream: true`` with ``include_usage``) so the client
sees each token's arrival: TTFT is the first event with output (choices), ITL
the gaps between such events, TPOT ``(E2E − TTFT) / (output tokens − 1)``. Token
counts come from the server's usage report when it sends one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..contracts.security import fleet_secret_from_env, fleet_token
from .config import BenchConfig
from .dataset import BenchRequest, Workload


@dataclass
class RequestResult:
    ok: bool
    start: float
    """Seconds since the run started."""
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(config: BenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


async def send_one(
    client: httpx.AsyncClient,
    config: BenchConfig,
    path: str,
    body: dict[str, Any],
    t0: float,
) -> RequestResult:
    """One streamed request, timed from the moment it is sent."""
    start = time.perf_counter()
    result = RequestResult(ok=False, start=start - t0)
    last = start
    chunks = 0
    try:
        async with asyncio.timeout(config.timeout):
            async with client.stream("POST", config.base_url + path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"stream error: {event['error'].get('message')}"
                        return result
                    now = time.perf_counter()
                    # An event with choices carries output (a token may decode to no
                    # text yet, e.g. half a UTF-8 character), as vLLM's benchmark counts.
                    if event.get("choices"):
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                        chunks += 1
                    usage = event.get("usage")
                    if usage:
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
    except TimeoutError:
        result.error = f"timed out after {config.timeout}s"
        return result
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    if result.ttft is None:
        result.error = "no output in the stream"
        return result
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


async def resolve_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    if config.model:
        return config.model
    try:
        resp = await client.get(config.base_url + "/v1/models", timeout=30)
        resp.raise_for_status()
        model: str = resp.json()["data"][0]["id"]
        return model
    except Exception as e:
        raise ValueError(
            f"cannot list models at {config.base_url}/v1/models ({e}); pass --model"
        ) from None


async def run_load(
    config: BenchConfig, stop: threading.Event | None = None
) -> tuple[list[RequestResult], float]:
    """Send the workload; (results in send order, wall seconds of the run).
    Once ``stop`` is set no new request is sent (those in flight finish)."""
    workload = Workload(
        config.input_len,
        config.output_len,
        config.seed,
        config.endpoint == "chat",
        config.shared_prefix_len,
        config.tokenizer,
        config.dataset,
    )
    key = config.api_key or os.environ.get("OPENAI_API_KEY") or _fleet_token()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    limit = config.concurrency or (1 if config.request_rate is None else 10_000)
    client = httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.timeout),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    async with client:
        model = await resolve_model(client, config)
        t0 = time.perf_counter()
        deadline = t0 + config.duration if config.duration else float("inf")
        total = config.num_requests if config.num_requests is not None else 1 << 62

        def over() -> bool:
            return time.perf_counter() >= deadline or (stop is not None and stop.is_set())

        results: dict[int, RequestResult] = {}

        async def one(i: int) -> None:
            body = request_body(config, model, workload.get(i))
            results[i] = await send_one(client, config, path, body, t0)

        if config.request_rate is None:
            counter = iter(range(total))

            async def worker() -> None:
                for i in counter:
                    if over():
                        return
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(limit)))
        else:
            rng = random.Random(f"{config.seed}-arrivals")
            gate = asyncio.Semaphore(limit)
            tasks = []

            async def gated(i: int) -> None:
                async with gate:
                    await one(i)

            next_at = t0
            for i in range(total):
                next_at += rng.expovariate(config.request_rate)
                if next_at >= deadline:
                    break
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                if over():
                    break
                tasks.append(asyncio.create_task(gated(i)))
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return [results[i] for i in sorted(results)], elapsed


def _fleet_token() -> str | None:
    """The fleet token when this shell holds the fleet secret: lets the benchmark
    call an engine directly, as the gateway does (docs/security.md)."""
    secret = fleet_secret_from_env()
    return fleet_token(secret) if secret else None
