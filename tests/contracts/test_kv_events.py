"""The KV-events decoder: malformed batches only ever raise ValueError."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from pdfleet.engine.contracts.kv_events import BlockStored, EventBatch

VALID = [
    1.0,
    [
        ["BlockStored", [1, 2], None, [3] * 32, 16, None, "GPU"],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ],
    0,
]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 5, 2**63, -(2**63), 2**64 - 1])
    if kind == 3:
        return rng.random() * 1e9
    if kind == 4:
        return rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x", ""])
    if kind == 5:
        return rng.randbytes(rng.randrange(40))
    if kind == 6:
        return rng.choice(["block_hashes", "token_ids", "block_size", "type", "medium"])
    if kind in (7, 8):
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(6))]
    keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randrange(6))}


def _mutate(rng: random.Random, value: Any) -> Any:
    """``value`` with one randomly chosen leaf or container replaced by junk."""
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], _mutate(rng, value[i]), *value[i + 1 :]]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        k = rng.choice(list(value))
        return {**value, k: _mutate(rng, value[k])}
    return _junk(rng)


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        ([0.0, [["BlockStored", [1], None, 5, 16]], 0], "token_ids"),
        ([0.0, [["BlockStored", [1], None, [1, "a"], 16]], 0], "token_ids"),
        ([0.0, [["BlockStored", [1], None, [1], "16"]], 0], "block_size"),
        ([0.0, [["BlockStored", [1], [2], [1], 16]], 0], "parent_block_hash"),
        ([0.0, [["BlockStored", [1.5], None, [], 16]], 0], "block_hashes"),
        ([0.0, [["BlockRemoved", [1], 7]], 0], "medium"),
        ([0.0, [[["x"], 1]], 0], "type"),
        ({"ts": 0, "events": [{"type": ["x"]}]}, "type"),
    ],
)
def test_a_malformed_field_is_a_value_error_naming_it(batch: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EventBatch.decode(msgpack.packb(batch))


def test_random_and_mutated_batches_only_ever_raise_value_error() -> None:
    rng = random.Random(42)
    decoded = 0
    for i in range(3000):
        value = _mutate(rng, VALID) if i % 2 else _junk(rng)
        payload = msgpack.packb(value)
        if i % 7 == 0:
            payload = payload[: rng.randrange(len(payload) + 1)]
        try:
            batch = EventBatch.decode(payload)
        except ValueError:
            continue
        decoded += 1
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert all(isinstance(t, int) for t in e.token_ids)
                assert isinstance(e.block_size, int)
    assert decoded > 100  # the mutations leave many batches valid
