"""The async engine's output streams: a delta each step a request progressed,
or (``final``, for an answer sent whole) one output at its end that holds
exactly what the deltas add up to."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.loop.async_engine import AsyncEngine

PROMPT = [5, 6, 7, 8, 9, 10]


def test_a_final_stream_yields_once_what_the_deltas_add_up_to(tiny_model):
    llm = LLM(tiny_model, max_model_len=256)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=7, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1
    )

    async def scenario():
        deltas = [o async for o in await engine.add_request("d", PROMPT, params)]
        finals = [o async for o in await engine.add_request("f", PROMPT, params, final=True)]
        return deltas, finals

    try:
        deltas, finals = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert len(deltas) >= 7 and len(finals) == 1  # a delta a step; the final one once
    (final,) = finals
    assert final.finished and deltas[-1].finished
    summed: dict[int, tuple[str, list[int], list, str | None]] = {}
    for out in deltas:
        for o in out.outputs:
            text, ids, lps, reason = summed.get(o.index, ("", [], [], None))
            summed[o.index] = (
                text + o.text,
                ids + o.token_ids,
                lps + (o.logprobs or []),
                o.finish_reason or reason,
            )
    got = {o.index: (o.text, o.token_ids, o.logprobs, o.finish_reason) for o in final.outputs}
    assert got == summed and len(got) == 2
    assert all(len(ids) == 7 for _, ids, _, _ in got.values())
    assert final.prompt_logprobs == next(
        o.prompt_logprobs for o in deltas if o.prompt_logprobs is not None
    )


def test_traced_a_request_answered_whole_keeps_its_deltas_so_an_abort_has_its_spans(
    tiny_model, monkeypatch
):
    """An aborted request's engine spans come from the last output it had: with
    tracing on, one answered whole still gets a delta every step."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdfleet.engine import tracing
    from pdfleet.engine.entrypoints.openai.serving_base import ServingBase

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    llm = LLM(tiny_model, max_model_len=2048)
    steps = threading.Semaphore(0)
    engine = AsyncEngine(llm.engine, on_step=lambda _: steps.release())
    serving = SimpleNamespace(engine=engine)
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def scenario() -> None:
        with tracing._tracer.start_as_current_span("server"):
            (stream,) = await ServingBase.admit(  # type: ignore[arg-type]
                serving, "r", [(None, PROMPT, params)], 0, None, whole=True
            )

            async def consume() -> None:
                async for _ in stream:
                    pass

            task = asyncio.ensure_future(consume())
            for _ in range(5):  # the client goes away a few steps in
                assert await asyncio.to_thread(steps.acquire, True, 30)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            stream.close()
            deadline = asyncio.get_running_loop().time() + 30
            while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # until the engine thread took the abort

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    names = [s.name for s in spans.get_finished_spans()]
    assert {"queue", "decode", "end"} <= set(names), names
