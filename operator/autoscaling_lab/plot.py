"""``pdfleet sim --plot out.png``: one run of the strategies, over time.

Four panels sharing the time axis: the request rate; prefill replicas and
decode replicas per strategy (the pdfleet policy, the HPA-style baseline, the
oracle; the policy's scale events marked); the policy's and HPA's TTFT p99 per
period against the SLO. matplotlib with the headless Agg backend (the ``plot``
extra).
"""

from __future__ import annotations

from typing import Any

from ...engine.reports.plotting import pyplot
from .sim_fleet import FleetModel, SimResult
from .traces import Trace

COLORS = {"pdfleet": "tab:blue", "hpa": "tab:orange", "oracle": "tab:green", "fixed": "tab:gray"}


def plot_sim(trace: Trace, model: FleetModel, results: dict[str, SimResult], path: str) -> None:
    """Write the picture of ``results`` (from :func:`.sim.compare`) to ``path``."""
    plt = pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(9, 8.5), sharex=True, dpi=80)
    rate_ax, prefill_ax, decode_ax, ttft_ax = axes
    minutes = 60.0
    any_result = next(iter(results.values()))
    times = [t / minutes for t, _, _, _ in any_result.timeline]
    rate_ax.plot(times, [r for _, _, _, r in any_result.timeline], color="black", lw=0.8)
    rate_ax.plot(
        times,
        [trace.rate(t * minutes) for t in times],
        color="tab:red",
        lw=1.0,
        ls="--",
        label="expected",
    )
    rate_ax.set_ylabel("requests/s")
    rate_ax.legend(loc="upper right", fontsize=8)
    title = (
        f"{trace.config.kind} trace, seed {trace.config.seed}, cold start "
        f"{model.cold_start_seconds:g} s"
    )
    rate_ax.set_title(title, fontsize=10)
    for name in ("oracle", "hpa", "fixed", "pdfleet"):
        result = results.get(name)
        if result is None:
            continue
        t = [x / minutes for x, _, _, _ in result.timeline]
        style = {"color": COLORS[name], "lw": 1.6 if name == "pdfleet" else 1.0}
        prefill_ax.step(t, [p for _, p, _, _ in result.timeline], where="post", label=name, **style)
        decode_ax.step(t, [d for _, _, d, _ in result.timeline], where="post", **style)
    ours = results.get("pdfleet")
    if ours is not None:
        for when, role, _, after in ours.scale_log:
            ax = prefill_ax if role == "prefill" else decode_ax
            ax.plot(when / minutes, after, marker="|", color="tab:blue", ms=9, ls="none")
    prefill_ax.set_ylabel("prefill replicas")
    prefill_ax.legend(loc="upper left", fontsize=8, ncol=4)
    decode_ax.set_ylabel("decode replicas")
    for name in ("hpa", "pdfleet"):
        result = results.get(name)
        if result is None or not result.ttft_series:
            continue
        ttft_ax.plot(
            [t / minutes for t, _ in result.ttft_series],
            [max(v, 1e-3) for _, v in result.ttft_series],
            color=COLORS[name],
            lw=1.0,
            label=f"{name} TTFT p99",
        )
    ttft_ax.axhline(model.ttft_slo_seconds, color="tab:red", ls="--", lw=1.0, label="TTFT SLO")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("TTFT p99 (s)")
    ttft_ax.set_xlabel("minutes")
    ttft_ax.legend(loc="upper left", fontsize=8, ncol=3)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_matrix(result: dict[str, Any], path: str) -> None:
    """The matrix's summary: per trace, the mean replica-seconds over the
    seeds of the policy, HPA tuned per trace, B* and fixed peak (B*'s peak
    counts held all trace long), each bar labelled with its multiple of B*,
    and the policy's worst TTFT and ITL attainment over the seeds."""
    plt = pyplot()
    cells = [c for c in result["cells"] if c["case"] == "default" and c["bstar"]["best"]]
    kinds = list(dict.fromkeys(c["trace"] for c in cells))
    bars = (
        ("pdfleet", "policy", "tab:blue"),
        ("hpa_tuned", "HPA tuned per trace", "tab:orange"),
        ("bstar", "B*", "tab:green"),
        ("fixed", "fixed peak", "tab:gray"),
    )
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=90)
    width = 0.8 / len(bars)
    for i, (name, label, color) in enumerate(bars):
        means, ratios = [], []
        for kind in kinds:
            group = [c for c in cells if c["trace"] == kind]
            values = [
                (c["bstar"]["best"] if name == "bstar" else c["results"][name])["replica_seconds"][
                    "total"
                ]
                for c in group
            ]
            bstar = [c["bstar"]["best"]["replica_seconds"]["total"] for c in group]
            means.append(sum(values) / len(values) / 3600)
            ratios.append(sum(values) / sum(bstar))
        xs = [k + (i - (len(bars) - 1) / 2) * width for k in range(len(kinds))]
        ax.bar(xs, means, width, label=label, color=color)
        for x, y, r in zip(xs, means, ratios, strict=True):
            ax.text(x, y, f"{r:.2f}", ha="center", va="bottom", fontsize=7)
    labels = []
    for kind in kinds:
        group = [c for c in cells if c["trace"] == kind]
        ttft = min(c["results"]["pdfleet"]["ttft_attainment"] for c in group)
        itl = min(c["results"]["pdfleet"]["itl_attainment"] for c in group)
        labels.append(f"{kind}\npolicy's worst seed:\nTTFT {ttft:.2%}, ITL {itl:.2%}")
    ax.set_xticks(range(len(kinds)), labels, fontsize=8)
    ax.set_ylabel("mean replicas (replica-seconds / 3600)")
    reg = result["regime"]
    seeds = result["seeds"]
    ax.set_title(
        f"regime {reg['name']}: seeds {seeds[0]}-{seeds[-1]}, mean over seeds (label: x B*)",
        fontsize=10,
    )
    # Room above the tallest bar for its label and the legend.
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
