"""B* carried over from an earlier matrix run, accepted only where it replays exactly.

The cache (:mod:`.cache`) recomputes B* whenever the simulator's code
changes, however little: a search of about fifteen simulations per cell.
Most such changes cannot alter a result (an assert that becomes an explicit
raise), but deciding that by reading the change is what a fingerprint that
ignores "harmless" edits would do, and such a fingerprint is only as sound
as its list of harmless edits. Instead, a B* record from an earlier run
(a matrix JSON keeps every cell's B* with its schedules) is **replayed** with
the current code, and accepted as the cell's B* only if everything it
claims comes out identical:

* **the winner**: its sizing turned into schedules by the current needs and
  dynamic programming must give exactly the stored schedules, and those
  schedules played in the current simulator must give exactly the stored
  figures (attainments, percentiles, requests, replica-seconds, events);
* **B*'s fewest-events schedule**: computed again at that sizing, it must be
  the stored schedule, with the same events frontier, and simulate to the
  same figures;
* **the boundary misses**: per role, the failed candidate hotter than the
  winner in that role and nearest to it (the search ruled out every cheaper
  sizing through such failures: it never simulates a pair hotter in both
  roles than one that failed): simulated again, each must give exactly its
  stored figures, so it still misses.

Four simulations at most instead of about fifteen. What this does *not*
re-check: the search's other failed candidates (a change that tipped one of
them into passing while leaving these bit-identical would go unseen) and
the search's own logic (:mod:`.bstar` is replayed only through the
winner's schedules). Any difference rejects the record and the cell's B* is
searched again; an accepted record lists what was replayed (``replayed``),
so a matrix JSON shows which B* were carried over and how they were checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .bstar import FEWEST_EVENTS_SLACK, Searcher, _fewest
from .sim import Cell, summary
from .strategies import Sizing

# The figures of a simulation that must come out identical (wall time and
# decision codes are not figures of the schedule).
FIGURES = (
    "requests",
    "completed",
    "ttft_attainment",
    "itl_attainment",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "replica_seconds",
    "mean_replicas",
    "peak_replicas",
    "scale_events",
    "replicas_started",
    "replicas_stopped",
)
# The candidates' brief records (:meth:`.bstar.Candidate.brief`).
BRIEF = ("ttft_attainment", "itl_attainment", "replica_seconds")

# A cell of a matrix JSON: (regime name, trace, seed, case).
CellId = tuple[str, str, int, str]


def load_records(paths: Iterable[Path | str]) -> dict[CellId, dict[str, Any]]:
    """Every cell's B* record in these matrix JSONs (the benchmark's or
    ``pdfleet sim --matrix --out``'s: ``{"<regime>/<seeds>": result}``)."""
    records: dict[CellId, dict[str, Any]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        # ``pdfleet sim --matrix --out`` writes one result; the benchmark a
        # map of them by "<regime>/<seeds>".
        results = (
            [(data["regime"]["name"], data)]
            if "cells" in data
            else [(key.split("/")[0], result) for key, result in data.items()]
        )
        for name, result in results:
            for cell in result.get("cells", []):
                found = cell.get("bstar")
                if found is not None:
                    records[(name, cell["trace"], int(cell["seed"]), cell["case"])] = found
    return records


def _differences(stored: dict[str, Any], again: dict[str, Any], fields: Iterable[str]) -> list[str]:
    return [f for f in fields if stored.get(f) != again.get(f)]


def boundary_misses(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The failed candidates that make the winner's sizing the hottest that
    passes: per role, of those hotter than the winner in that role, the one
    nearest to it (then the one nearest to passing). The search never
    simulates a pair hotter than a failure in both roles, so these are what
    rules out every cheaper sizing."""
    sizing = record["best"]["sizing"]
    found = []
    for role in ("prefill_utilization", "decode_kv_usage"):
        hotter = [
            c for c in record.get("candidates", []) if not c["met"] and c[role] > sizing[role]
        ]
        if hotter:

            def nearness(c: dict[str, Any], r: str = role) -> tuple[float, float]:
                return (c[r] - sizing[r], -min(c["ttft_attainment"], c["itl_attainment"]))

            found.append(min(hotter, key=nearness))
    return [c for i, c in enumerate(found) if c not in found[:i]]


def replay_bstar(cell: Cell, record: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``record`` (a stored B*, :meth:`.bstar.BStar.to_dict`) with what was
    replayed, if the winner, its fewest-events schedule and the boundary
    misses reproduce exactly with the current code (module docstring); else None
    and why not."""
    best = record.get("best")
    if best is None or "schedule" not in best:
        return None, "no B* schedule to replay"
    searcher = Searcher(
        cell.load, cell.model, cell.spec, cell.start, lambda p, d: summary(cell.schedule(p, d))
    )
    sizing = Sizing(**best["sizing"])
    schedules = (
        searcher.schedule("prefill", sizing.prefill_utilization),
        searcher.schedule("decode", sizing.decode_kv_usage),
    )
    stored = (best["schedule"]["prefill"], best["schedule"]["decode"])
    if schedules != stored:
        return None, "the winner's sizing gives other schedules now"
    winner = searcher.run(sizing)
    diff = _differences(best, winner.result, FIGURES)
    if diff or not winner.met:
        return None, f"the winner's simulation differs ({', '.join(diff) or 'met'})"
    fewest_stored = record.get("fewest_events")
    fewest, frontier = _fewest(searcher, winner, FEWEST_EVENTS_SLACK)
    if fewest_stored is None or "schedule" not in fewest_stored:
        return None, "no fewest-events schedule to replay"
    if [fewest.schedule[0], fewest.schedule[1]] != [
        fewest_stored["schedule"]["prefill"],
        fewest_stored["schedule"]["decode"],
    ] or frontier != record.get("events_frontier"):
        return None, "the fewest-events schedule or its frontier differs"
    diff = _differences(fewest_stored, fewest.result, FIGURES)
    if diff:
        return None, f"the fewest-events simulation differs ({', '.join(diff)})"
    replayed = ["best", "fewest_events"]
    for near in boundary_misses(record):
        again = searcher.run(Sizing(near["prefill_utilization"], near["decode_kv_usage"])).brief()
        diff = _differences(near, again, BRIEF)
        name = f"miss {near['prefill_utilization']}/{near['decode_kv_usage']}"
        if diff or again["met"]:
            return None, f"the {name} differs ({', '.join(diff) or 'it passes now'})"
        replayed.append(name)
    return {**record, "replayed": replayed}, ""
