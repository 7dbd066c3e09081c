"""Scale-down victim choice."""

from __future__ import annotations

import pytest

from pdfleet.operator.autoscaling.victims import ReplicaLoad, choose_victims


@pytest.mark.parametrize(
    ("loads", "count", "want"),
    [
        # idle before busy, whatever the names
        (
            [ReplicaLoad("a", in_flight=3), ReplicaLoad("b"), ReplicaLoad("c", in_flight=1)],
            1,
            ["b"],
        ),
        # starting replicas go first: they lose no work and no cache
        ([ReplicaLoad("a"), ReplicaLoad("z", ready=False, in_flight=0)], 1, ["z"]),
        # least in-flight, then least KV, then fewest queued tokens
        (
            [
                ReplicaLoad("a", in_flight=2, kv_cache_usage=0.5),
                ReplicaLoad("b", in_flight=2, kv_cache_usage=0.1),
                ReplicaLoad("c", in_flight=5),
            ],
            2,
            ["b", "a"],
        ),
        # ties by name, so the choice is deterministic
        ([ReplicaLoad("b"), ReplicaLoad("a")], 1, ["a"]),
        ([ReplicaLoad("a")], 0, []),
    ],
)
def test_least_loaded_first(loads, count, want):
    assert choose_victims(loads, count) == want


def test_a_busy_replica_is_never_chosen_while_an_idle_one_remains():
    loads = [ReplicaLoad(f"busy{i}", in_flight=1, kv_cache_usage=0.0) for i in range(5)]
    loads.append(ReplicaLoad("idle", kv_cache_usage=0.9, waiting_prompt_tokens=1e6))
    assert choose_victims(loads, 1) == ["idle"]


@pytest.mark.parametrize("count", [-1, 3])
def test_impossible_counts_raise(count):
    with pytest.raises(ValueError, match="victim count|cannot remove"):
        choose_victims([ReplicaLoad("a"), ReplicaLoad("b")], count)
