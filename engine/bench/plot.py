"""``pdfleet bench --plot out.png``: latency percentiles and throughput over time.

Requests are grouped by the second-long (or longer, for long runs) bin they
started in; each bin shows TTFT and E2E p50/p90/p99 and the completed
requests and output tokens per second. matplotlib with the headless Agg
backend (the ``plot`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..reports.plotting import pyplot
from ..reports.stats import percentile
from .runner import RequestResult

MAX_BINS = 60


def bin_seconds(elapsed: float) -> float:
    """Bin width: at least 1 s, at most :data:`MAX_BINS` bins."""
    return max(1.0, math.ceil(elapsed / MAX_BINS))


def plot_bench(results: Sequence[RequestResult], elapsed: float, path: str) -> None:
    """Write the picture of one run's per-request results to ``path``."""
    plt = pyplot()
    width = bin_seconds(elapsed)
    bins = max(1, math.ceil(elapsed / width))
    ttft: list[list[float]] = [[] for _ in range(bins)]
    e2e: list[list[float]] = [[] for _ in range(bins)]
    done = [0] * bins
    tokens = [0] * bins
    for r in results:
        if not r.ok:
            continue
        b = min(int(r.start // width), bins - 1)
        if r.ttft is not None:
            ttft[b].append(r.ttft * 1000)
        if r.e2e is not None:
            e2e[b].append(r.e2e * 1000)
            end = min(int((r.start + r.e2e) // width), bins - 1)
            done[end] += 1
            tokens[end] += r.output_tokens
    fig, (lat_ax, e2e_ax, thr_ax) = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True, dpi=80)
    for ax, series, name in ((lat_ax, ttft, "TTFT"), (e2e_ax, e2e, "E2E")):
        for p, style in ((50, "-"), (90, "--"), (99, ":")):
            xs = [b * width for b in range(bins) if series[b]]
            ys = [percentile(sorted(series[b]), p) for b in range(bins) if series[b]]
            ax.plot(xs, ys, ls=style, marker=".", label=f"{name} p{p}")
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(loc="upper left", fontsize=8, ncol=3)
    xs = [b * width for b in range(bins)]
    thr_ax.fill_between(
        xs, [n / width for n in done], step="post", color="tab:blue", alpha=0.3, label="requests/s"
    )
    tok_ax = thr_ax.twinx()
    tok_ax.step(xs, [n / width for n in tokens], where="post", color="tab:green", lw=1.0)
    tok_ax.set_ylabel("output tokens/s", color="tab:green")
    thr_ax.set_ylabel("requests/s")
    thr_ax.set_xlabel(f"seconds since start ({width:g} s bins)")
    failed = sum(1 for r in results if not r.ok)
    lat_ax.set_title(
        f"pdfleet bench: {len(results) - failed} ok, {failed} failed, {elapsed:.0f} s",
        fontsize=10,
    )
    for ax in (lat_ax, e2e_ax, thr_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
