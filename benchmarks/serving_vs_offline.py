"""Generated tokens/s through HTTP streaming vs offline ``LLM.generate``.

The same model and workload (prompts of random token ids, fixed output
length, greedy, ignore_eos) runs once offline in this process and once through
a `pdfleet serve` subprocess with every request streamed concurrently (SSE
read with httpx in this process: on a small machine the reader's CPU is taken
from the server, see docs/serving.md). Rounds alternate offline and served
runs (both kept loaded, each warmed up once) so that a change in the
machine's load hits both sides; prints each round and the median ratio
(target >= 0.85). The default model is a toy (4 layers, width 256), where
per-token HTTP work weighs most; ``--hidden-size 1024 --layers 8`` is a model
whose forward pass costs something.

    .venv/bin/python benchmarks/serving_vs_offline.py [--num-prompts 64] [--output-len 64]
        [--hidden-size 256] [--layers 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

from pdfleet.engine.contracts.launch import python_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hidden-size", type=int, default=256, help="model width (4 layers at 256)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()

    import httpx

    from pdfleet.engine import LLM, SamplingParams
    from pdfleet.engine.tiny.builder import ensure_tiny_model

    heads = max(4, args.hidden_size // 64)
    model = ensure_tiny_model(
        os.path.join(
            tempfile.gettempdir(), f"pdfleet-serving-bench-{args.hidden_size}x{args.layers}"
        ),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(8, 1800) for _ in range(rng.randint(32, 256))]
        for _ in range(args.num_prompts)
    ]
    engine_flags = {"max_model_len": 1024, "max_num_seqs": args.num_prompts}

    llm = LLM(model, **engine_flags)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:8]}, params.clone(max_tokens=2))

    def offline() -> tuple[float, int]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    port = free_port()
    log = open(os.path.join(tempfile.gettempdir(), "pdfleet-serving-bench.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *python_module("pdfleet.engine.cli"),
            "serve",
            model,
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            str(args.num_prompts),
            "--disable-log-stats",
            "--uvicorn-log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    async def served() -> tuple[float, int]:
        limits = httpx.Limits(max_connections=args.num_prompts + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

            async def one(p: list[int]) -> int:
                body = {
                    "model": model,
                    "prompt": p,
                    "max_tokens": args.output_len,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                }
                last = ""
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = line
                return json.loads(last[6:])["usage"]["completion_tokens"]

            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            return time.perf_counter() - start, sum(counts)

    rounds = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.3)
        # Warm-ups: the first full run of either side is slower (allocator, caches).
        offline()
        asyncio.run(served())
        for i in range(args.rounds):
            first, second = (offline, served) if i % 2 == 0 else (served, offline)
            a = first() if first is offline else asyncio.run(first())
            b = second() if second is offline else asyncio.run(second())
            (off_s, off_n), (srv_s, srv_n) = (a, b) if first is offline else (b, a)
            rounds.append(
                {
                    "offline_tokens_per_s": off_n / off_s,
                    "served_tokens_per_s": srv_n / srv_s,
                    "ratio": (srv_n / srv_s) / (off_n / off_s),
                }
            )
            print(
                f"round {i}: offline {off_n / off_s:8.1f} tok/s  served {srv_n / srv_s:8.1f} "
                f"tok/s  ratio {rounds[-1]['ratio']:.2f}"
            )
    finally:
        proc.terminate()
        proc.wait(30)
    ratios = sorted(r["ratio"] for r in rounds)
    result = {
        "model": {"hidden_size": args.hidden_size, "layers": args.layers},
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "rounds": rounds,
        "median_ratio": ratios[len(ratios) // 2],
    }
    print(f"median ratio {result['median_ratio']:.2f}   (target >= 0.85)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
