"""`make run` on a fresh cache: time to the first answer, and decode speed of the real model.

Runs what `make run` runs (`pdfleet up`, no file: SmolLM2-135M-Instruct, one
prefill and one decode engine, the gateway) with an empty pdfleet cache, and
splits the time to the first chat answer into

* model preparation: `pdfleet fetch-model builtin://smollm2-135m-instruct`
  (sha256 check, config and tokenizer from the GGUF metadata, tensor index);
* engine start: `pdfleet up` until it prints `ready:` (dequantizing weights,
  KV cache, gateway), the model already prepared;
* the first answer: one chat request through the gateway.

Then it streams greedy chat answers through the gateway and reports decode
tokens/s (tokens after the first over the time after the first), one request
at a time and four at once. Install time is not measured here (it is pip's).

    .venv/bin/python benchmarks/real_model.py [--out benchmarks/results/real_model_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdfleet.engine.contracts.launch import python_module

QUESTION = "What is the capital of France?"
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how rain forms, step by step.",
    "Describe a day in the life of a lighthouse keeper.",
    "Give five tips for a good night's sleep and explain each.",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


async def stream_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and not first:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "decode_s": end - (first or end), "tokens": tokens}


async def decode_rate(url: str, concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_chat(client, url, QUESTION, 8)  # warm-up
        results = await asyncio.gather(
            *(
                stream_chat(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)
                for i in range(concurrency)
            )
        )
    per_request = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0]
    return {
        "concurrency": concurrency,
        "completion_tokens": [r["tokens"] for r in results],
        "decode_tokens_per_s_per_request": round(sum(per_request) / len(per_request), 1),
        "decode_tokens_per_s_total": round(
            sum(r["tokens"] - 1 for r in results) / max(r["decode_s"] for r in results), 1
        ),
        "ttft_s": [round(r["ttft_s"], 2) for r in results],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/real_model_cpu.json")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="pdfleet-cache-")
    env = {**os.environ, "PDFLEET_CACHE_DIR": cache}
    cli = python_module("pdfleet.engine.cli")

    t0 = time.perf_counter()
    subprocess.run(
        [*cli, "fetch-model", "builtin://smollm2-135m-instruct"],
        env=env,
        check=True,
        capture_output=True,
        timeout=1800,
    )
    prepare_s = time.perf_counter() - t0

    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="pdfleet-runs-"))
    log = open(run_dir / "up.log", "wb")  # noqa: SIM115 (closed below)
    t1 = time.perf_counter()
    up = subprocess.Popen(
        [*cli, "up", "--port", str(port), "--run-dir", str(run_dir), "--timeout", "1800"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: (
                "ready: " in (run_dir / "up.log").read_text(errors="replace")
                or up.poll() is not None
            ),
            1800,
            "pdfleet up",
        )
        if up.poll() is not None:
            raise RuntimeError((run_dir / "up.log").read_text(errors="replace")[-3000:])
        start_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0,
                "max_tokens": 48,
            },
            timeout=600,
        ).json()
        answer_s = time.perf_counter() - t2
        single = asyncio.run(decode_rate(url, 1, args.max_tokens))
        four = asyncio.run(decode_rate(url, 4, args.max_tokens))
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        log.close()
    result = {
        "machine": f"{os.cpu_count()} CPU cores, shared with other work (load average "
        f"{os.getloadavg()[0]:.1f} at the end)",
        "model": "builtin://smollm2-135m-instruct (Q4_1 GGUF, float32 engine dtype)",
        "model_preparation_s": round(prepare_s, 1),
        "engine_start_s": round(start_s, 1),
        "first_answer_s": round(answer_s, 2),
        "time_to_first_answer_s": round(prepare_s + start_s + answer_s, 1),
        "first_answer": answer["choices"][0]["message"]["content"],
        "first_answer_finish_reason": answer["choices"][0]["finish_reason"],
        "decode_single": single,
        "decode_concurrent_4": four,
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
