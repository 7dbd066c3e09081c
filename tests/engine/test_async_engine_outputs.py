"""The async engine's output streams: a delta each step a request progressed,
or (``final``, for an answer sent whole) one output at its end that holds
exactly what the deltas add up to."""

from __future__ import annotations

import asyncio

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
