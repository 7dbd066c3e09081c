"""Memory and lookup cost of the gateway's exact prefix index (engine/gateway/kv_index.py).

Fills an index with 1M block ids spread over 16 engines (as their KV events
would), reports its memory (tracemalloc), then times the per-request work for
a 4k-token prompt: hashing its 256 blocks as the engines do, and the index
lookup against the 16 engines (p50/p99 over many lookups).

    .venv/bin/python benchmarks/kv_index_cost.py [--blocks 1000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from pdfleet.engine.contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.contracts.kv_events import BlockStored
from pdfleet.engine.gateway.kv_index import KVIndex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/kv_index_cost.json")
    args = ap.parse_args()
    rng = random.Random(0)
    urls = [f"http://10.0.0.{i}:8000" for i in range(args.engines)]

    tracemalloc.start()
    index = KVIndex(max_blocks=args.blocks)
    per_batch = 256
    for start in range(0, args.blocks, per_batch):
        ids = [rng.getrandbits(64) for _ in range(min(per_batch, args.blocks - start))]
        index.apply(urls[(start // per_batch) % len(urls)], [BlockStored(ids)])
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    tokens = [rng.randrange(32_000) for _ in range(args.prompt_tokens)]
    hash_fn = get_hash_fn("sha256")
    hash_times = []
    for _ in range(200):
        t0 = time.perf_counter()
        prompt = [external_block_hash(h) for h in prompt_block_hashes(tokens, 16, hash_fn)]
        hash_times.append(time.perf_counter() - t0)
    # One engine holds the whole prompt, a few hold leading parts, the rest nothing.
    index.apply(urls[0], [BlockStored(prompt)])
    for i, url in enumerate(urls[1:6], 1):
        index.apply(url, [BlockStored(prompt[: len(prompt) * i // 8])])
    lookup_times = []
    for _ in range(args.lookups):
        t0 = time.perf_counter()
        got = index.matched(prompt, urls)
        lookup_times.append(time.perf_counter() - t0)
    assert got[urls[0]][0] == len(prompt), got

    def us(xs: list[float], q: float) -> float:
        return round(statistics.quantiles(xs, n=100)[int(q) - 1] * 1e6, 1)

    result = {
        "blocks": len(index),
        "engines": args.engines,
        "index_memory_mb": round(current / 2**20, 1),
        "bytes_per_block": round(current / len(index), 1),
        "prompt_tokens": args.prompt_tokens,
        "prompt_blocks": len(prompt),
        "lookup_us_p50": us(lookup_times, 50),
        "lookup_us_p99": us(lookup_times, 99),
        "hash_prompt_us_p50": us(hash_times, 50),
        "hash_prompt_us_p99": us(hash_times, 99),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
