"""Small statistics shared by the benchmark and the fleet simulator (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ascending values, interpolating
    linearly between the closest ranks (numpy's default); NaN when empty."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)
