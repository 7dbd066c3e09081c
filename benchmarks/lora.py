"""Multi-LoRA serving: decode step time over many adapters, adapter load time,
and the hit rate of adapter-aware routing.

1. **Decode step time.** One engine (``--enable-lora --max-loras 16``) decodes
   a batch of 32 requests spread over 1, 4 or 16 adapters (16 three ways:
   evenly, 2 rows each; Zipf-like, rows 9, 4, 3, 2, 2, 2 and ten of 1; one
   popular adapter with 17 rows and fifteen of 1; the two uneven ones also
   with every segment padded to the longest, ``*_padded``, the torch form
   before the long segments were split off); the baseline is the
   same 32 requests on the base model, on the same engine, in the same run.
   Reported: the median (and the minimum: on a shared machine the least
   disturbed step) forward time of the decode steps (all 32 rows scheduled),
   the median CPU time of the engine thread over those steps (with one torch
   thread all the compute runs there; on a loaded machine it is far less
   noisy than wall time; the benchmark sets one torch thread itself), and their ratios to the baseline (target on the
   torch path: <= 1.3x at 16 adapters). Configurations take turns over several rounds so
   a shared machine's load falls on all of them alike.
2. **Adapter load time.** ``/v1/load_lora_adapter``'s work on one adapter
   (all seven projections of every layer), median of 5: the read (read, check,
   hash; off the step loop) and the install into the host cache (the step
   loop's pause).
3. **Routing hit rate.** 4 simulated engines (``--max-loras 2
   --max-cpu-loras 4``, 8 requests each at most), each keeping its device
   slots and host copies as the runner does, all serving (registered) all 20
   adapters, take a Poisson trace (6 requests/s, 2 s mean service, Zipf
   popularity s = 1.1). The gateway side runs the gateway's own
   ``prefer_adapter_holders`` on what it would see: the engines' scrapes
   (queue, registered adapters, residency series) every scrape interval
   (0.2, 1 and 5 s), its own in-flight counts and its own marks between
   them. ``aware``: by residency; ``registered``: by registration (what the
   gateway did before residency was exported); ``blind``: by load alone.
   Hit: when the request starts on its engine, its adapter is already in a
   device slot (``device``) or at least in host memory (``host_or_device``:
   no disk read). ``view_stale``: how often the gateway's tier of the
   adapter on the chosen engine was not the engine's at that moment.
   ``--routing-only`` runs this part alone (seconds).

Adapters are random PEFT-format directories written here (rank ``--rank``,
all target modules). Run::

    .venv/bin/python -P benchmarks/lora.py --model builtin://smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: str, model_config, rank: int, seed: int) -> str:
    """A random LoRA adapter of the model, as peft saves one."""
    import torch
    from safetensors.torch import save_file

    from pdfleet.engine.lora.adapter import module_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(model_config)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module in TARGETS:
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            in_f, out_f = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def decode_step_times(llm, prompts, loras, max_tokens: int) -> list[float]:
    """Forward seconds of every step that decoded all the requests at once."""
    from pdfleet.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(
            f"r{time.monotonic_ns()}-{i}",
            {"prompt_token_ids": prompt},
            params,
            output_kind="final",
            lora_request=lora,
        )
    times = []
    while engine.has_unfinished_requests():
        cpu = time.thread_time()
        engine.step()
        cpu = time.thread_time() - cpu
        s = engine.stats
        if s.num_scheduled_reqs == len(prompts) and s.num_scheduled_tokens == len(prompts):
            times.append((s.forward_seconds, cpu))
    return times


def bench_steps(args, llm, adapters) -> dict:
    from pdfleet.engine import LoRARequest
    from pdfleet.engine.lora import ops

    rng = random.Random(0)
    vocab = llm.engine.config.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(32)]
    configs = {"base": [None] * 32}
    for n in (1, 4, 16):
        configs[f"{n}_adapters"] = [LoRARequest(f"a{i % n}", 1, adapters[i % n]) for i in range(32)]
    # Uneven spreads over the 16 adapters: rows per adapter.
    for name, counts in (
        ("16_adapters_zipf", [9, 4, 3, 2, 2, 2] + [1] * 10),
        ("16_adapters_one_hot", [17] + [1] * 15),
    ):
        owners = [a for a, n in enumerate(counts) for _ in range(n)]
        configs[name] = [LoRARequest(f"a{a}", 1, adapters[a]) for a in owners]
        # The same rows with every segment padded to the longest (the grouped
        # form without the split): what the split saves, in the same run.
        configs[name + "_padded"] = configs[name]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    split = ops.LOOP_SEGMENT_ROWS
    for _ in range(args.rounds):
        for name, loras in configs.items():
            ops.LOOP_SEGMENT_ROWS = 10**9 if name.endswith("_padded") else split
            times[name] += decode_step_times(llm, prompts, loras, args.decode_steps)
    ops.LOOP_SEGMENT_ROWS = split
    base = statistics.median(w for w, _ in times["base"])
    base_min = min(w for w, _ in times["base"])
    base_cpu = statistics.median(c for _, c in times["base"])
    out = {}
    for name, values in times.items():
        med = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        out[name] = {
            "median_step_ms": round(1000 * med, 2),
            "min_step_ms": round(1000 * min(w for w, _ in values), 2),
            "median_step_cpu_ms": round(1000 * cpu, 2),
            "steps": len(values),
            "ratio_to_base": round(med / base, 3),
            "min_ratio_to_base": round(min(w for w, _ in values) / base_min, 3),
            "cpu_ratio_to_base": round(cpu / base_cpu, 3),
        }
    return out


def bench_load(llm, adapters) -> dict:
    """A run-time load in its two halves: the read (read, check, hash: on the
    server's reader thread, the engine keeps stepping) and the install (the
    only part between two steps: the pause a load costs the step loop)."""
    read, install = [], []
    for i in range(5):
        start = time.perf_counter()
        prepared = llm.engine.prepare_lora(f"load{i}", adapters[i])
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.engine.install_lora(prepared)
        install.append(time.perf_counter() - start)
        llm.engine.remove_lora(f"load{i}")
    size = os.path.getsize(os.path.join(adapters[0], "adapter_model.safetensors"))
    return {
        "read_median_ms": round(1000 * statistics.median(read), 1),
        "step_loop_pause_median_ms": round(1000 * statistics.median(install), 3),
        "adapter_mib": round(size / (1 << 20), 2),
    }


class SimEngine:
    """One engine's adapter caches and scheduler, as the runner and the
    scheduler keep them (``lora/manager.py``, ``core/scheduler.py``):
    ``max_loras`` device slots (a free one, the lowest first, else the least
    recently used slot no running request needs), ``max_cpu_loras`` host
    copies (least recently used first out, never one a running request
    needs), at most ``max_loras`` distinct adapters running, waiting requests
    of other adapters skipped (no head-of-line blocking)."""

    def __init__(self, max_loras: int, max_cpu_loras: int, max_seqs: int) -> None:
        from collections import OrderedDict, deque

        self.max_loras, self.max_cpu, self.max_seqs = max_loras, max_cpu_loras, max_seqs
        self.running: list[tuple[float, str]] = []  # (finish time, adapter)
        self.waiting: deque[tuple[str, float]] = deque()  # (adapter, service seconds)
        self.slots: list[str | None] = [None] * max_loras
        self.slot_used = [0.0] * max_loras
        self.host: OrderedDict[str, None] = OrderedDict()
        self.starts = self.device_hits = self.host_hits = 0

    def resident(self) -> dict[str, str]:
        """What the engine exports (pdfleet_engine_lora_adapter_resident)."""
        out = dict.fromkeys(self.host, "host")
        out.update({a: "device" for a in self.slots if a is not None})
        return out

    def _touch(self, adapter: str, now: float) -> None:
        self.slot_used[self.slots.index(adapter)] = now
        if adapter in self.host:
            self.host.move_to_end(adapter)

    def _start(self, adapter: str, service: float, now: float) -> None:
        self.starts += 1
        in_use = {a for _, a in self.running}
        if adapter in self.slots:
            self.device_hits += 1
        else:
            if adapter in self.host:
                self.host_hits += 1
            else:  # read from its directory into the host cache
                self.host[adapter] = None
                for victim in [a for a in self.host if a not in in_use | {adapter}]:
                    if len(self.host) <= self.max_cpu:
                        break
                    del self.host[victim]
            free = [s for s, a in enumerate(self.slots) if a is None]
            slot = (
                free[0]
                if free
                else min(
                    (s for s, a in enumerate(self.slots) if a not in in_use),
                    key=lambda s: self.slot_used[s],
                )
            )
            self.slots[slot] = adapter
        self._touch(adapter, now)
        self.running.append((now + service, adapter))

    def _admit(self, now: float) -> None:
        for _ in range(len(self.waiting)):
            adapter, service = self.waiting.popleft()
            loras = {a for _, a in self.running}
            if len(self.running) < self.max_seqs and (
                adapter in loras or len(loras) < self.max_loras
            ):
                self._start(adapter, service, now)
            else:
                self.waiting.append((adapter, service))

    def advance(self, now: float) -> None:
        """Finish the requests due by ``now``, admitting waiting ones as each ends."""
        while self.running:
            done = min(self.running)
            if done[0] > now:
                break
            self.running.remove(done)
            self._touch(done[1], done[0])
            self._admit(done[0])

    def submit(self, adapter: str, service: float, now: float) -> None:
        self.waiting.append((adapter, service))
        self._admit(now)


def simulate_routing(
    policy: str,
    seed: int,
    scrape_interval: float,
    engines: int = 4,
    max_loras: int = 2,
    max_cpu_loras: int = 4,
    num_adapters: int = 20,
    requests: int = 4000,
    rate: float = 6.0,
    service: float = 2.0,
) -> dict[str, float]:
    """Route a Poisson trace (``rate`` requests/s, exponential service of mean
    ``service`` s, 20 adapters of Zipf popularity s = 1.1) over ``engines``
    simulated engines that all serve (register) every adapter, as the
    operator and ``pdfleet up`` load each listed adapter on every engine.

    The gateway side is the gateway's own code on what it would see: every
    ``scrape_interval`` seconds each engine's ``EngineLoad`` is rebuilt from
    that moment's state (queue, registered adapters and, for ``aware``, the
    residency series, ``--max-loras``), and between scrapes only the
    gateway's own exact in-flight count and its own marks (``mark_routed``:
    an adapter routed to an engine counts device-resident there, the oldest
    beyond its slots host-resident) change it; ``prefer_adapter_holders`` narrows the
    candidates and the least busy of them wins (ties at random: the prompts
    share no prefix). ``registered``: the same without the residency series
    (routing by registration); ``blind``: least busy of all.

    Hits are counted where they matter, when the request starts running on
    its engine: ``device`` (its adapter was in a slot: no copy), ``host_or_device``
    (no read from disk). ``view_stale``: routed requests for which the
    gateway's tier of the adapter on the chosen engine differed from the
    engine's state at that moment."""
    from pdfleet.engine.gateway.engines import EngineLoad, EngineState
    from pdfleet.engine.gateway.routing import adapter_tier, mark_routed, prefer_adapter_holders

    rng = random.Random(seed)
    names = [f"a{k}" for k in range(num_adapters)]
    weights = [1 / (k + 1) ** 1.1 for k in range(num_adapters)]
    registered = {a: (a, "") for a in names}
    states = [EngineState(f"http://e{i}", "decode") for i in range(engines)]
    sims = [SimEngine(max_loras, max_cpu_loras, max_seqs=8) for _ in range(engines)]
    now, next_scrape, stale = 0.0, 0.0, 0
    for _ in range(requests):
        now += rng.expovariate(rate)
        adapter = rng.choices(names, weights)[0]
        while next_scrape <= now:
            for st, sim in zip(states, sims, strict=True):
                sim.advance(next_scrape)
                st.load = EngineLoad(
                    running=len(sim.running),
                    waiting=len(sim.waiting),
                    adapters=dict(registered),
                    resident=sim.resident() if policy == "aware" else {},
                    max_loras=max_loras,
                )
            next_scrape += scrape_interval
        for st, sim in zip(states, sims, strict=True):
            sim.advance(now)
            st.inflight = len(sim.running) + len(sim.waiting)
        candidates = states if policy == "blind" else prefer_adapter_holders(states, adapter)
        low = min(c.queue() for c in candidates)
        chosen = rng.choice([c for c in candidates if c.queue() == low])
        sim = sims[states.index(chosen)]
        truth = EngineState(chosen.url, "decode")
        truth.load = EngineLoad(adapters=registered, resident=sim.resident())
        if policy == "aware":
            stale += adapter_tier(chosen, adapter) != adapter_tier(truth, adapter)
            mark_routed(chosen, adapter)  # the proxy's own mark
        sim.submit(adapter, rng.expovariate(1 / service), now)
    for sim in sims:
        sim.advance(float("inf"))
    starts = sum(s.starts for s in sims)
    device = sum(s.device_hits for s in sims)
    return {
        "device": device / starts,
        "host_or_device": (device + sum(s.host_hits for s in sims)) / starts,
        "view_stale": stale / requests,
    }


def bench_routing(seeds: int = 3) -> dict:
    """Hit rates per policy and scrape interval, means over ``seeds`` traces."""
    out: dict = {}
    for interval in (0.2, 1.0, 5.0):
        row: dict = {}
        for policy in ("aware", "registered", "blind"):
            runs = [simulate_routing(policy, s, interval) for s in range(seeds)]
            row[policy] = {
                k: round(statistics.mean(r[k] for r in runs), 3)
                for k in runs[0]
                if policy == "aware" or k != "view_stale"
            }
        out[f"scrape_{interval:g}s"] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin://smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--routing-only",
        action="store_true",
        help="only the routing simulation (seconds); with --out, replace its "
        "routing_hit_rate in that file and keep the rest",
    )
    args = p.parse_args()
    if args.routing_only:
        routing = {"routing_hit_rate": bench_routing()}
        print(json.dumps(routing, indent=2))
        if args.out:
            kept = {}
            if os.path.exists(args.out):
                with open(args.out) as f:
                    kept = json.load(f)
            with open(args.out, "w") as f:
                f.write(json.dumps({**kept, **routing}, indent=2) + "\n")
        return 0

    import torch

    from pdfleet.engine import LLM

    # One torch thread: all the compute then runs on the engine thread, whose
    # CPU time is the benchmark's least noisy measure on a shared machine.
    torch.set_num_threads(1)

    model = args.model
    if model.startswith("builtin://"):
        from pdfleet.engine.tiny.registry import builtin_model_dir

        model = builtin_model_dir(model.removeprefix("builtin://"))
    llm = LLM(
        model,
        max_model_len=512,
        enable_lora=True,
        max_loras=16,
        max_cpu_loras=24,
        max_lora_rank=max(8, args.rank),
        max_num_seqs=32,
    )
    tmp = tempfile.mkdtemp(prefix="pdfleet-lora-bench-")
    m = llm.engine.config.model_config
    adapters = [write_adapter(os.path.join(tmp, f"a{i}"), m, args.rank, i) for i in range(16)]
    result = {
        "model": args.model,
        "rank": args.rank,
        "torch_threads": torch.get_num_threads(),
        "decode_batch_32": bench_steps(args, llm, adapters),
        "adapter_load": bench_load(llm, adapters),
        "routing_hit_rate": bench_routing(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
