"""Turning request timings into the benchmark's numbers, text and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..reports.stats import percentile
from .config import BenchConfig
from .runner import RequestResult

PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in milliseconds."""
    ordered = sorted(v * 1000 for v in values_s)
    out = {"mean": sum(ordered) / len(ordered) if ordered else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p)
    return out


@dataclass
class BenchResult:
    duration_s: float
    completed: int
    failed: int
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    total_token_throughput: float
    """Prompt plus generated tokens per second."""
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    goodput: float | None
    """Requests per second that met every given SLO (None without SLOs)."""
    slo_attainment: float | None
    """Share of all sent requests that met every given SLO."""
    errors: list[str] = field(default_factory=list)
    """Up to 10 distinct error messages."""
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; NaN (no sample) becomes null."""
        plain: dict[str, Any] = _no_nan(asdict(self))
        return plain


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def meets_slo(r: RequestResult, config: BenchConfig) -> bool:
    if not r.ok:
        return False
    if config.slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > config.slo_ttft_ms):
        return False
    tpot = r.tpot
    return not (
        config.slo_tpot_ms is not None and tpot is not None and tpot * 1000 > config.slo_tpot_ms
    )


def summarize(results: list[RequestResult], elapsed: float, config: BenchConfig) -> BenchResult:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    has_slo = config.slo_ttft_ms is not None or config.slo_tpot_ms is not None
    good = sum(1 for r in results if meets_slo(r, config)) if has_slo else 0
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < 10:
            errors.append(r.error)
    return BenchResult(
        duration_s=elapsed,
        completed=len(ok),
        failed=len(results) - len(ok),
        request_throughput=len(ok) / elapsed if elapsed > 0 else 0.0,
        output_throughput=output / elapsed if elapsed > 0 else 0.0,
        total_token_throughput=(prompt + output) / elapsed if elapsed > 0 else 0.0,
        total_prompt_tokens=prompt,
        total_output_tokens=output,
        ttft_ms=distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=distribution_ms([x for r in ok for x in r.itls]),
        e2e_ms=distribution_ms([r.e2e for r in ok if r.e2e is not None]),
        goodput=good / elapsed if has_slo and elapsed > 0 else None,
        slo_attainment=good / len(results) if has_slo and results else None,
        errors=errors,
        config={k: v for k, v in vars(config).items() if k != "api_key"},
    )


def format_report(result: BenchResult) -> str:
    lines = [
        f"{'requests completed / failed':<32}{result.completed} / {result.failed}",
        f"{'duration (s)':<32}{result.duration_s:.2f}",
        f"{'request throughput (req/s)':<32}{result.request_throughput:.2f}",
        f"{'output throughput (tok/s)':<32}{result.output_throughput:.1f}",
        f"{'total throughput (tok/s)':<32}{result.total_token_throughput:.1f}",
        f"{'prompt / output tokens':<32}{result.total_prompt_tokens} / {result.total_output_tokens}",
    ]
    if result.goodput is not None:
        lines.append(f"{'goodput (req/s)':<32}{result.goodput:.2f}")
        lines.append(f"{'SLO attainment':<32}{100 * (result.slo_attainment or 0):.1f}%")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, dist in (
        ("TTFT", result.ttft_ms),
        ("TPOT", result.tpot_ms),
        ("ITL", result.itl_ms),
        ("E2E", result.e2e_ms),
    ):
        cells = "".join(f"{dist[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<10}{cells}")
    for e in result.errors:
        lines.append(f"error: {e}")
    return "\n".join(lines)
