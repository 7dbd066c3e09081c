"""The tables of docs/flow-control.md's "A wide request waits on a busy
engine": ``fair_sim`` runs of a wide key (n=64) and a narrow one (n=1), with a
long stream beside them or a better band using part of the engine, under
admission's rule for a request wider than the free slots and under the rule
before it (held until every slot it needs is free). Run from the checkout:

    .venv/bin/python -P tests/gateway/fair_sim_wide.py [seeds]
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.fair_sim import Client, run

from pdfleet.engine.gateway.admission import Admission
from pdfleet.engine.gateway.engines import EngineState

SCENARIOS = {
    "n64 + n1": [Client("n64", 64, 4), Client("n1", 1, 128)],
    "+ one n=1 stream of 2,048 tokens": [
        Client("n64", 64, 4),
        Client("n1", 1, 128),
        Client("long", 1, 1, max_tokens=2048),
    ],
    "+ a better band, 16 n=1 streams": [
        Client("hi", 1, 16, priority=-1),
        Client("n64", 64, 4),
        Client("n1", 1, 128),
    ],
    "band 0: 48 n=1 streams; band 1: n=64 of 400 tokens": [
        Client("mid", 1, 48),
        Client("lo", 64, 2, priority=1, max_tokens=400),
    ],
}


def held_until_all_free(self: Admission, e: EngineState, seqs: int = 1, band: Any = None) -> bool:
    """The rule before: a request starts when all of its sequences fit, one
    wider than the limit when the engine has nothing of this gateway's."""
    capacity = e.capacity
    if capacity is None:
        return True
    cap = self.limit(e, band)
    if cap is None or e.admitted + min(seqs, cap) <= cap:
        return True
    return cap > capacity and e.top_admitted + seqs <= cap - capacity


@contextmanager
def rule(before: bool) -> Iterator[None]:
    now: Callable[..., bool] = Admission.has_room
    if before:
        Admission.has_room = held_until_all_free  # type: ignore[method-assign]
    try:
        yield
    finally:
        Admission.has_room = now  # type: ignore[method-assign]


def span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}} to {hi:{fmt}}"


def main(seeds: int = 8) -> None:
    print(
        "| scenario | capacity | rule | output tokens in 30 s | n=1 ÷ n=64 output "
        "| cost started, n=64 − n=1 | other keys' output |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, clients in SCENARIOS.items():
        others = [c.key for c in clients if c.key not in ("n64", "n1")]
        pair = len(others) < len(clients)
        for capacity in (64, None):
            for before in (True, False):
                total, ratio, gap = [], [], []
                other: dict[str, list[float]] = {k: [] for k in others}
                with rule(before):
                    for latency_s in (0.001, 0.01, 0.05):
                        for seed in range(seeds):
                            r = run(clients, capacity=capacity, latency_s=latency_s, seed=seed)
                            total.append(sum(r.output_all.values()) / 1000)
                            o = r.output
                            ratio.append(o.get("n1", 0) / max(1, o.get("n64", 0)))
                            gap.append((r.routed.get("n64", 0) - r.routed.get("n1", 0)) / 1000)
                            for k in others:
                                other[k].append(o.get(k, 0) / 1000)
                cells = [
                    f"{span(total, '.0f')}k",
                    span(ratio, ".2f") if pair else "",
                    f"{span(gap, '+.1f')}k" if pair else "",
                    ", ".join(f"{k} {span(v, '.1f')}k" for k, v in other.items()),
                ]
                print(
                    f"| {name} | {'64' if capacity else 'not learned'} "
                    f"| {'before' if before else 'after'} | " + " | ".join(cells) + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
