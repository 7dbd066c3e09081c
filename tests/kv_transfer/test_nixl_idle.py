"""An idle NIXL agent sleeps: its UCX progress thread blocks in poll(), it does not spin."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("nixl_cu12")

from pdfleet.engine.kv_transfer.nixl_shard import ShardAgent

SAMPLES = 100


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _state(tid: str) -> str:
    """R (running or runnable), S (asleep), ...; '' once the thread is gone."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_idle_nixl_progress_thread_blocks_in_poll_instead_of_spinning():
    before = _threads()
    agent = ShardAgent("idle-test-0", ["UCX"])
    try:
        started = _threads() - before
        assert started, "NIXL started no progress thread"
        runnable = dict.fromkeys(started, 0)
        for _ in range(SAMPLES):
            for tid in started:
                runnable[tid] += _state(tid) == "R"
            time.sleep(0.01)
        # A zero-timeout poll() loop is runnable in every sample, even on a loaded
        # machine; a thread that blocks in poll() is asleep in nearly all of them.
        assert max(runnable.values()) < SAMPLES // 2, runnable
    finally:
        agent.shutdown()
