"""The measured KV pull bandwidth behind KVTransferDegraded (pure)."""

from __future__ import annotations

import pytest

from pdfleet.engine.kv_transfer.connector import BANDWIDTH_WINDOW, PullBandwidth

MB = 1 << 20


def test_degraded_only_while_the_recent_mean_is_under_the_floor():
    bw = PullBandwidth(floor_bytes_per_second=10e9, min_bytes=4 * MB)
    assert not bw.degraded  # nothing measured yet
    assert bw.add(64 * MB, 64 * MB / 2e9)  # 2 GB/s: TCP-like
    assert bw.mean == pytest.approx(2e9)
    assert bw.degraded
    for _ in range(BANDWIDTH_WINDOW):
        bw.add(64 * MB, 64 * MB / 40e9)  # RDMA-like pulls push the slow one out
    assert bw.mean == pytest.approx(40e9)
    assert not bw.degraded


def test_small_pulls_are_latency_and_are_not_measured():
    bw = PullBandwidth(floor_bytes_per_second=10e9, min_bytes=4 * MB)
    assert not bw.add(MB, 1.0)
    assert not bw.add(8 * MB, 0.0)
    assert bw.mean == 0 and not bw.degraded


def test_no_floor_never_degrades_and_negative_settings_are_refused():
    bw = PullBandwidth(floor_bytes_per_second=0, min_bytes=0)
    bw.add(10, 100.0)
    assert bw.mean > 0 and not bw.degraded
    with pytest.raises(ValueError, match="min_pull_gbps"):
        PullBandwidth(floor_bytes_per_second=-1, min_bytes=0)
