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


def test_the_proxy_loads_the_adapter_on_route_engines_that_lack_it_once():
    import asyncio
    import json
    from types import SimpleNamespace

    from pdfleet.engine.gateway.engines import EnginePool
    from pdfleet.engine.gateway.proxy import Proxy
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

    proxy = Proxy.__new__(Proxy)
    proxy.pool = EnginePool.__new__(EnginePool)
    proxy.pool.engines = {e.url: e for e in (holder, other, prefill)}
    proxy.client = Client()
    proxy.metrics = SimpleNamespace(
        lora_loads=SimpleNamespace(labels=lambda url: SimpleNamespace(inc=lambda: None))
    )
    proxy._loading = {}
    route = Route(other, prefill, "prefill_decode", "always")

    async def run():
        return await asyncio.gather(*(proxy._ensure_adapter(None, route, "a") for _ in range(3)))

    assert asyncio.run(run()) == [None, None, None]
    # One load per engine that lacked it, from the directory the holder reports.
    assert sorted(posts) == [
        ("http://o/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
        ("http://p/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
    ]
    assert "a" in other.load.adapters and "a" in prefill.load.adapters and not proxy._loading


def test_the_proxy_counts_a_load_done_only_when_the_engine_serves_those_weights():
    import asyncio
    from types import SimpleNamespace

    from pdfleet.engine.contracts.errors import ErrorBody
    from pdfleet.engine.contracts.lora import already_loaded
    from pdfleet.engine.gateway.proxy import Proxy

    answers = {
        "http://same": (409, already_loaded("a").encode()),
        "http://other": (
            400,
            ErrorBody(
                "LoRA adapter 'a' is already loaded with other weights", 400, "lora_path"
            ).encode(),
        ),
        # Prose that says "already loaded" is no success unless the contract says so.
        "http://prose": (409, ErrorBody("'a' already loaded", 409, None).encode()),
    }

    class Client:
        async def post(self, url, content, headers, timeout):
            status, body = answers[url.removesuffix("/v1/load_lora_adapter")]
            return SimpleNamespace(status_code=status, content=body, text=body.decode())

    proxy = Proxy.__new__(Proxy)
    proxy.client = Client()
    proxy.metrics = SimpleNamespace(
        lora_loads=SimpleNamespace(labels=lambda url: SimpleNamespace(inc=lambda: None))
    )

    async def load(url: str) -> str | None:
        return await proxy._load_adapter(engine(url, 0), "a", ("h", "/a"))

    assert asyncio.run(load("http://same")) is None
    error = asyncio.run(load("http://other"))
    assert error is not None and "400 LoRA adapter 'a' is already loaded with other" in error
    assert asyncio.run(load("http://prose")) is not None
