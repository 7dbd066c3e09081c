"""P/D vs aggregated: the same engines, the same prefill-heavy mixed load, one run.

Two topologies with the same number of engine processes (two), one after the
other, each behind its own gateway:

* ``aggregated`` — both engines serve whole requests
  (``--disaggregation-mode Disabled``, load- and prefix-aware routing);
* ``pd`` — one prefill and one decode engine (``--pd-mode``: ``Conditional`` by
  default, so short chat prompts go straight to decode; or ``Always``).

The load, for ``--duration`` seconds, mixes two classes at once: ``long``
(long prompts, short answers, Poisson arrivals) and ``chat`` (short prompts,
long streamed answers, fixed concurrency). Long prefills stall an aggregated
engine's decode steps; moving them to a prefill engine is what P/D buys, so
the numbers to read are the chat class's ITL p99 and both classes' TTFT.

P/D needs KV transfer: give the roles their connector with
``--prefill-engine-args '--kv-transfer-config {...kv_producer...}'`` and
``--decode-engine-args '--kv-transfer-config {...kv_consumer...}'``. Without
them (today: the connectors are not merged yet) the ``pd`` topology still runs
the two-leg protocol, but the prefill engine returns no KV and the decode
engine recomputes every prompt: the comparison is then aggregated vs
decode-only behind a wasted prefill leg, and the script says so, with the
gateway's fallback count.

    .venv/bin/python benchmarks/pd_vs_aggregated.py [--quick] [--json PATH]
        [--model DIR] [--prefill-engine-args ARGS] [--decode-engine-args ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
from pathlib import Path

from fleet import Fleet, engine_env, metric, tiny_model

from pdfleet.engine.bench import BenchConfig, BenchResult, arun_benchmark
from pdfleet.engine.contracts.metrics import GATEWAY_DISAGG_DECISIONS, GATEWAY_FALLBACKS


async def mixed_load(url: str, args: argparse.Namespace) -> dict[str, BenchResult]:
    common = dict(
        url=url,
        duration=args.duration,
        num_requests=None,
        quiet=True,
        timeout=120.0,
        tokenizer=args.model_dir,  # exact prompt lengths
    )
    long = BenchConfig(
        **common,
        request_rate=args.long_rate,
        input_len=args.long_input,
        output_len=args.long_output,
        seed=1,
    )
    chat = BenchConfig(
        **common,
        concurrency=args.chat_concurrency,
        input_len=args.chat_input,
        output_len=args.chat_output,
        seed=2,
    )
    results = await asyncio.gather(arun_benchmark(long), arun_benchmark(chat))
    return dict(zip(("long", "chat"), results, strict=True))


def run_topology(name: str, model: str, args: argparse.Namespace, log_dir: Path) -> dict:
    engine_common = ["serve", model, "--disable-log-stats", "--max-model-len", "4096"]
    env = engine_env(args.engine_threads)
    with Fleet(log_dir / name) as fleet:
        if name == "aggregated":
            engines = [fleet.start(f"engine{i}", engine_common, env) for i in range(2)]
            roles = ["--decode", *engines]
            mode = "Disabled"
        else:
            prefill = fleet.start(
                "prefill", [*engine_common, *shlex.split(args.prefill_engine_args)], env
            )
            decode = fleet.start(
                "decode", [*engine_common, *shlex.split(args.decode_engine_args)], env
            )
            engines = [prefill, decode]
            roles = [
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--min-prompt-tokens",
                str(args.min_prompt_tokens),
            ]
            mode = args.pd_mode
        fleet.wait_healthy(engines)
        gateway = fleet.start(
            "gateway", ["gateway", "--host", "127.0.0.1", *roles, "--disaggregation-mode", mode]
        )
        fleet.wait_healthy([gateway])
        results = asyncio.run(mixed_load(gateway, args))
        fallbacks = metric(gateway, GATEWAY_FALLBACKS.name)
        legs = metric(gateway, GATEWAY_DISAGG_DECISIONS.name, decision="prefill_decode")
    return {
        "results": {k: v.to_dict() for k, v in results.items()},
        "prefill_decode_requests": legs,
        "fallbacks": fallbacks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--long-input", type=int, default=2048)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--long-rate", type=float, default=2.0, help="long requests per second")
    parser.add_argument("--chat-input", type=int, default=64)
    parser.add_argument("--chat-output", type=int, default=128)
    parser.add_argument("--chat-concurrency", type=int, default=4)
    parser.add_argument("--prefill-engine-args", default="", help="extra flags, one string")
    parser.add_argument("--decode-engine-args", default="", help="extra flags, one string")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of each engine (0: unset)"
    )
    parser.add_argument("--pd-mode", default="Conditional", choices=["Conditional", "Always"])
    parser.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=256,
        help="Conditional threshold of the pd topology",
    )
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.long_input, args.chat_output = 8.0, 512, 32
    model = args.model or tiny_model()
    args.model_dir = model
    log_dir = Path(tempfile.mkdtemp(prefix="pdfleet-pd-vs-agg-"))
    out = {"config": vars(args), "logs": str(log_dir)}
    for name in ("aggregated", "pd"):
        out[name] = run_topology(name, model, args, log_dir)

    def row(label: str, cls: str, dist: str, p: str) -> str:
        a = out["aggregated"]["results"][cls][dist][p]
        d = out["pd"]["results"][cls][dist][p]
        ratio = d / a if a and d is not None else float("nan")
        a, d = (float("nan") if x is None else x for x in (a, d))
        return f"{label:<22}{a:>12.1f}{d:>12.1f}{ratio:>10.2f}"

    print(f"{'(ms)':<22}{'aggregated':>12}{'pd':>12}{'pd/agg':>10}")
    print(row("chat ITL p99", "chat", "itl_ms", "p99"))
    print(row("chat TTFT p50", "chat", "ttft_ms", "p50"))
    print(row("chat TTFT p99", "chat", "ttft_ms", "p99"))
    print(row("long TTFT p50", "long", "ttft_ms", "p50"))
    print(row("long TTFT p99", "long", "ttft_ms", "p99"))
    for name in ("aggregated", "pd"):
        r = out[name]["results"]
        print(
            f"{name}: chat {r['chat']['completed']} done / {r['chat']['failed']} failed, "
            f"long {r['long']['completed']} done / {r['long']['failed']} failed"
        )
        for cls in ("chat", "long"):
            for error in r[cls]["errors"][:3]:
                print(f"  {name} {cls} error: {error}")
    pd = out["pd"]
    if pd["fallbacks"] and pd["fallbacks"] >= pd["prefill_decode_requests"]:
        print(
            f"NOTE: no KV transfer: all {int(pd['fallbacks'])} two-leg requests fell back to "
            "decode-only (the decode engine recomputed every prompt). This compares aggregated "
            "with decode-only behind a wasted prefill leg, not with P/D; pass "
            "--prefill-engine-args/--decode-engine-args with --kv-transfer-config for P/D."
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
