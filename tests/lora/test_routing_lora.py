"""Adapter-aware routing: engines that serve the adapter, weighed against load."""

from __future__ import annotations

from pdfleet.engine.gateway.engines import EngineLoad, EngineState
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.routing import prefer_adapter_holders


def engine(url: str, queue: int, adapters: tuple[str, ...] = (), **resident: str) -> EngineState:
    e = EngineState(url, "decode")
    e.load = EngineLoad(
        waiting=queue,
        adapters={a: (f"{a}@0", f"/{a}") for a in adapters},
        resident=dict(resident),
    )
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


def test_device_residents_win_then_host_then_registered_each_weighed_against_load():
    cold = engine("http://c", 0, ("a",))
    host = engine("http://h", 1, ("a",), a="host")
    dev = engine("http://d", 2, ("a",), a="device")
    none = engine("http://n", 0)
    assert prefer_adapter_holders([none, cold, host, dev], "a") == [dev]
    assert prefer_adapter_holders([none, cold, host], "a") == [host]
    assert prefer_adapter_holders([none, cold], "a") == [cold]
    # Residency of another adapter says nothing about this one.
    other = engine("http://o", 0, ("a", "b"), b="device")
    assert prefer_adapter_holders([cold, other], "a") == [cold, other]
    # The device holder is too busy (9 - 0 > max(4, 0 / 2)): the next tier
    # (host or warmer) holds the least busy candidate within the slack.
    busy = engine("http://d", 9, ("a",), a="device")
    assert prefer_adapter_holders([none, cold, host, busy], "a") == [host, busy]
    # Every warm engine is too busy: all candidates, and the gateway loads it.
    hot = [engine("http://d", 9, ("a",), a="device"), engine("http://h", 8, ("a",), a="host")]
    assert prefer_adapter_holders([none, *hot], "a") == [none, *hot]


def test_residency_is_read_from_the_scrape_and_shown_by_the_engines_view():
    from pdfleet.engine.gateway.engines import parse_engine_metrics

    text = "\n".join(
        [
            'pdfleet_engine_lora_adapter_info{model_name="t",lora_name="a",'
            'lora_identity="a@1",lora_path="/a"} 1.0',
            'pdfleet_engine_lora_adapter_info{model_name="t",lora_name="b",'
            'lora_identity="b@1",lora_path="/b"} 1.0',
            'pdfleet_engine_lora_adapter_info{model_name="t",lora_name="c",'
            'lora_identity="c@1",lora_path="/c"} 1.0',
            'pdfleet_engine_lora_adapter_resident{model_name="t",lora_name="a",tier="device"} 1.0',
            'pdfleet_engine_lora_adapter_resident{model_name="t",lora_name="b",tier="host"} 1.0',
            'pdfleet_engine_lora_adapter_resident{model_name="t",lora_name="c",tier="disk"} 1.0',
            "",
        ]
    )
    text += (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 1.7e9\n'
    )
    load = parse_engine_metrics(text)
    assert set(load.adapters) == {"a", "b", "c"}
    assert load.resident == {"a": "device", "b": "host"}  # an unknown tier is ignored
    assert load.max_loras == 2


def test_a_routed_adapter_counts_on_the_device_and_pushes_the_oldest_beyond_the_slots_out():
    from pdfleet.engine.gateway.routing import mark_routed

    e = engine("http://e", 0, ("a", "b", "c"), a="device", b="host")
    mark_routed(e, "b")
    assert e.load.resident == {"a": "device", "b": "device"}  # slots not known: no limit
    e.load.max_loras = 2
    mark_routed(e, "c")
    assert e.load.resident == {"a": "host", "b": "device", "c": "device"}
    mark_routed(e, "b")  # again: the most recent now
    mark_routed(e, "a")
    assert e.load.resident == {"c": "host", "b": "device", "a": "device"}


def test_the_gateway_loads_the_adapter_on_route_engines_that_lack_it_once():
    import asyncio
    import json
    from types import SimpleNamespace

    from pdfleet.engine.gateway.adapters import AdapterLoader
    from pdfleet.engine.gateway.engines import EnginePool
    from pdfleet.engine.gateway.routing import Route

    holder, other, prefill = (
        engine("http://h", 0, ("a",)),
        engine("http://o", 0),
        engine("http://p", 0),
    )
    posts = []

    class Client:
        async def post(self, url, content, headers, timeout):
            posts.append((url, json.loads(content)))
            await asyncio.sleep(0)
            return SimpleNamespace(status_code=200, content=b"ok", text="ok")

    pool = EnginePool.__new__(EnginePool)
    pool.metrics, pool.adapter_first_seen = GatewayMetrics(), {}
    pool.engines = {e.url: e for e in (holder, other, prefill)}
    metrics = SimpleNamespace(
        lora_loads=SimpleNamespace(labels=lambda url: SimpleNamespace(inc=lambda: None))
    )
    loader = AdapterLoader(pool, Client(), metrics, None)
    route = Route(other, prefill, "prefill_decode", "always")

    async def run():
        return await asyncio.gather(*(loader.ensure(None, route, "a") for _ in range(3)))

    assert asyncio.run(run()) == [route, route, route]
    # One load per engine that lacked it, from the directory the holder reports.
    assert sorted(posts) == [
        ("http://o/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
        ("http://p/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
    ]
    assert "a" in other.load.adapters and "a" in prefill.load.adapters and not loader._loading
    # Both legs run it: the gateway counts it device-resident there until its
    # next scrape says otherwise.
    assert other.load.resident == prefill.load.resident == {"a": "device"}
    assert holder.load.resident == {}


def test_the_proxy_counts_a_load_done_only_when_the_engine_serves_those_weights():
    import asyncio

    from pdfleet.engine.contracts.errors import ErrorBody
    from pdfleet.engine.contracts.lora import already_loaded

    same, other = already_loaded("a", True).encode(), already_loaded("a", False).encode()
    answers = {
        # The name taken (vLLM's 400 naming lora_name): the card says by whom.
        "http://same": (400, same),
        "http://other": (400, other),
        "http://gone": (400, same),  # its card is not to be had
        # Prose that says "already loaded" is no success unless the contract says so.
        "http://prose": (409, ErrorBody("'a' already loaded", 409, None).encode()),
    }
    cards = {
        "http://same/v1/models/a": {"id": "a", "lora_identity": "a@0"},
        "http://other/v1/models/a": {"id": "a", "lora_identity": "a@ffff"},
        "http://prose/v1/models/a": {"id": "a", "lora_identity": "a@0"},
    }
    loader, _, gets = _loader_of(
        [engine("http://h", 0, ("a",))],
        lambda url: (answers[url][0], answers[url][1].decode()),
        cards,
    )

    async def load(url: str) -> str | None:
        return await loader._load_adapter(engine(url, 0), "a")

    assert asyncio.run(load("http://same")) is None
    error = asyncio.run(load("http://other"))
    assert error is not None and "400 The lora adapter 'a' has already been loaded" in error
    assert asyncio.run(load("http://gone")) is not None
    assert asyncio.run(load("http://prose")) is not None
    # The card is asked for only after a taken-name answer.
    assert "http://prose/v1/models/a" not in gets
    assert {"http://same/v1/models/a", "http://other/v1/models/a"} <= set(gets)


def _loader_of(engines, answer, cards=None):
    """An adapter loader over ``engines`` whose load POSTs ``answer(url)`` says (status,
    text) and whose adapter-card GETs answer ``cards[url]`` (else 404)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from pdfleet.engine.gateway.adapters import AdapterLoader
    from pdfleet.engine.gateway.engines import EnginePool

    posts, gets = [], []

    class Client:
        async def post(self, url, content, headers, timeout):
            posts.append((url.removesuffix("/v1/load_lora_adapter"), json.loads(content)))
            await asyncio.sleep(0)
            status, text = answer(url.removesuffix("/v1/load_lora_adapter"))
            return SimpleNamespace(status_code=status, content=text.encode(), text=text)

    class Cards:
        async def get(self, url, timeout):
            gets.append(url)
            card = (cards or {}).get(url)
            return SimpleNamespace(status_code=200 if card else 404, json=lambda: card or {})

    pool = EnginePool.__new__(EnginePool)
    pool.metrics, pool.adapter_first_seen = GatewayMetrics(), {}
    pool.engines = {e.url: e for e in engines}
    pool.client, pool.check_timeout = Cards(), 1.0
    metrics = SimpleNamespace(
        lora_loads=SimpleNamespace(labels=lambda url: SimpleNamespace(inc=lambda: None))
    )
    legs = SimpleNamespace(
        error=lambda call, message, status, param: SimpleNamespace(status=status, text=message)
    )
    return AdapterLoader(pool, Client(), metrics, legs), posts, gets


def test_a_hub_adapter_is_loaded_by_its_source_and_revision_not_a_pods_cache_path():
    import asyncio

    from pdfleet.engine.gateway.routing import Route

    holder, other = engine("http://h", 0, ("a",)), engine("http://o", 0)
    card = {"id": "a", "root": "/cache/h/snap", "source": "hf://org/a", "revision": "abc1"}
    loader, posts, gets = _loader_of(
        [holder, other], lambda url: (200, "ok"), {"http://h/v1/models/a": card}
    )
    route = Route(other, None, "decode_only", "short_prompt")
    assert asyncio.run(loader.ensure(None, route, "a")) is route
    assert gets == ["http://h/v1/models/a"]
    assert posts == [
        ("http://o", {"lora_name": "a", "lora_path": "hf://org/a", "revision": "abc1"})
    ]


def test_a_failed_load_routes_to_a_holder_and_is_remembered_for_a_while():
    import asyncio

    from pdfleet.engine.gateway import adapters as adapters_module
    from pdfleet.engine.gateway.routing import Route

    holder, busy_holder, other, prefill = (
        engine("http://h", 1, ("a",)),
        engine("http://b", 5, ("a",)),
        engine("http://o", 0),
        engine("http://p", 0),
    )
    for e in (holder, busy_holder, other, prefill):
        e.state = "healthy"
    prefill.role = "prefill"
    fails = {"http://o", "http://p"}
    loader, posts, _ = _loader_of(
        [holder, busy_holder, other, prefill],
        lambda url: (400, '{"error": {"message": "no room"}}') if url in fails else (200, "ok"),
    )
    route = Route(other, prefill, "prefill_decode", "always")
    got = asyncio.run(loader.ensure(None, route, "a"))
    # The decode leg's load failed: the least busy holder runs it, decode only.
    assert (got.decode, got.prefill, got.reason) == (holder, None, "adapter_fallback")
    assert [url for url, _ in posts] == ["http://o"]
    # Remembered: the next request goes straight to the holder, no new POST.
    again = asyncio.run(loader.ensure(None, route, "a"))
    assert again.decode is holder and len(posts) == 1
    # A failed prefill leg alone: the decode engine computes the prompt.
    fails.discard("http://o")
    loader._load_failures.clear()
    got = asyncio.run(loader.ensure(None, route, "a"))
    assert (got.decode, got.prefill, got.decision) == (other, None, "decode_only")
    # Past the memory's time the load is tried again; the memory is bounded.
    del other.load.adapters["a"]
    fails.add("http://o")
    loader._load_failures[("http://o", "a")] = (0.0, "expired")
    holder.load.adapters.clear()
    busy_holder.load.adapters.clear()
    prefill.load.adapters["a"] = ("a@0", "/a")  # the only engine serving it: a prefill one
    sent = len(posts)
    got = asyncio.run(loader.ensure(None, Route(other, None, "decode_only", "x"), "a"))
    assert posts[sent:] == [("http://o", {"lora_name": "a", "lora_path": "/a"})]
    # No decode engine serves it: the error answer, as before.
    assert got.status == 503 and "could not load LoRA adapter 'a' on http://o" in got.text
    for i in range(adapters_module.LORA_LOAD_FAILURES_MAX + 5):
        loader._loaded((f"http://e{i}", "a"))(_failed_future())
    assert len(loader._load_failures) == adapters_module.LORA_LOAD_FAILURES_MAX


def _failed_future():
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        done.set_result("error")
        return done
    finally:
        loop.close()


def test_one_name_with_other_weights_on_some_engines_is_counted_and_never_routed_there():
    from pdfleet.engine.gateway.engines import EnginePool

    pool = EnginePool.__new__(EnginePool)
    pool.metrics, pool.adapter_first_seen = GatewayMetrics(), {}
    first, second, odd = (
        engine("http://1", 5, ("a",)),
        engine("http://2", 5, ("a",)),
        engine("http://3", 0, ("a",), a="device"),
    )
    odd.load.adapters["a"] = ("a@other", "/elsewhere")
    none = engine("http://n", 0)
    pool.engines = {e.url: e for e in (first, odd)}
    # A tie (one engine each): the identity seen first wins.
    assert pool.adapter("a") == ("a@0", "/a")
    pool.engines = {e.url: e for e in (odd, first, second, none)}
    assert pool.adapter("a") == ("a@0", "/a")  # the majority, whatever the order
    assert pool.holds_adapter(first, "a") and not pool.holds_adapter(odd, "a")
    conflicts = pool.metrics.lora_identity_conflicts.labels("a")._value.get()
    assert conflicts == 1
    # The odd engine is idle and has "a" on its device, yet never a candidate.
    cands = [odd, first, second, none]
    assert odd not in prefer_adapter_holders(cands, "a", "a@0")
    assert prefer_adapter_holders([odd, none], "a", "a@0") == [none]
    # Most engines now serve the other weights: they win, the first one is odd.
    pool.engines = {e.url: e for e in (odd, first)}
    odd2 = engine("http://4", 0, ("a",))
    odd2.load.adapters["a"] = ("a@other", "/elsewhere")
    pool.engines[odd2.url] = odd2
    assert pool.adapter("a") == ("a@other", "/elsewhere")
    assert not pool.holds_adapter(first, "a")
    # Served nowhere: forgotten, the gauge back to 0.
    pool.engines = {none.url: none}
    assert pool.adapter("a") is None and "a" not in pool.adapter_first_seen
    assert pool.metrics.lora_identity_conflicts.labels("a")._value.get() == 0
