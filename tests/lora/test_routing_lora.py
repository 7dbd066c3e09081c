"""Adapter-aware routing: engines that serve the adapter, weighed against load."""

from __future__ import annotations

from pdfleet.engine.gateway.engines import EngineLoad, EngineState
from pdfleet.engine.gateway.routing import prefer_adapter_holders


def engine(url: str, queue: int, adapters: tuple[str, ...] = ()) -> EngineState:
    e = EngineState(url, "decode")
    e.load = EngineLoad(waiting=queue, adapters={a: (f"{a}@0", f"/{a}") for a in adapters})
    return e


def test_holders_win_unless_they_are_much_busier():
    idle, holder = engine("http://x", 0), engine("http://h", 3, ("a",))
    assert prefer_adapter_holders([idle, holder], "a") == [holder]
    assert prefer_adapter_holders([idle, holder], None) == [idle, holder]
    assert prefer_adapter_holders([idle, holder], "b") == [idle, holder]  # nobody has it
    busy = engine("http://h", 9, ("a",))  # 9 - 0 > max(4, 0 / 2): load it elsewhere
    assert prefer_adapter_holders([idle, busy], "a") == [idle, busy]
    loaded = [engine("http://y", 20), engine("http://z", 30, ("a",))]
    assert prefer_adapter_holders(loaded, "a") == [loaded[1]]  # 10 <= max(4, 20 / 2)
