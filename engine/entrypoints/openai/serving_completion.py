"""``/v1/completions``: prompts (text or token ids) in, text choices out (JSON or SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...outputs import Logprob
from .protocol import APIError, CompletionRequest, now
from .serving_base import Choice, ServingBase, error_event, finish_reason, raise_if_error, sse


class CompletionServing(ServingBase):
    def completion_logprobs(
        self,
        token_ids: list[int],
        entries: Sequence[dict[int, Logprob] | None],
        k: int,
        offset: int,
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, entry in zip(token_ids, entries, strict=True):
            if entry is None:  # first prompt token: nothing predicts it
                text = self.tokenizer.decode([tid]) if self.tokenizer else f"token_id:{tid}"
                tokens.append(text)
                token_lps.append(None)
                tops.append(None)
            else:
                lp = entry[tid]
                text = self._token_str(lp, tid)
                tokens.append(text)
                token_lps.append(lp.logprob)
                top: dict[str, float] = {}
                for t, x in entry.items():
                    if t != tid and len(top) < k:
                        top[self._token_str(x, t)] = x.logprob
                if k:
                    top[text] = lp.logprob
                tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _echoed(self, text_in: str | None, ids: list[int]) -> str:
        """The prompt as ``echo`` returns it: its text, else its ids decoded ("" with
        no tokenizer)."""
        if text_in is not None:
            return text_in
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def prepare_completion(self, req: CompletionRequest):
        model = self.check_model(req.model)
        req.check_unsupported()
        if req.suffix:
            raise APIError("suffix is not supported by pdfleet", param="suffix")
        self.check_sampling(req)
        self.check_logprobs(req.logprobs, "logprobs")
        structured = await self.compile_constraint(
            req.structured_spec(), req.constraint_field(), req.caller
        )
        prompts = await self.tokenize_prompts(req.prompts())
        lengths = [self.check_length(ids, req.max_tokens, "prompt") for _, ids in prompts]
        self.check_output_tokens(req, lengths)
        jobs = []
        for (text, ids), max_tokens in zip(prompts, lengths, strict=True):
            params = req.sampling_params(
                self.defaults,
                max_tokens,
                req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                structured=structured,
            )
            jobs.append((text, ids, params))
        return model, jobs

    async def completion(
        self, req: CompletionRequest, request_id: str, response_id: str | None = None
    ) -> dict[str, Any]:
        """``request_id`` keys the engine requests (unique, the server's own);
        ``response_id`` is the body's ``id`` (default: the request id)."""
        model, jobs = await self.prepare_completion(req)
        streams = await self.admit(request_id, jobs, req.priority, req.kv_transfer_params)
        try:
            return await self._completion_body(req, response_id or request_id, model, jobs, streams)
        finally:
            for stream in streams:
                stream.close()

    async def _completion_body(self, req, request_id, model, jobs, streams) -> dict[str, Any]:
        n = req.n
        choices = {i: Choice(i) for i in range(len(jobs) * n)}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
        prompt_lps: dict[int, list] = {}
        kv_out = None
        async for j, out in self.merge([self.outputs(s) for s in streams]):
            if out.prompt_logprobs is not None:
                prompt_lps[j] = out.prompt_logprobs
            if out.finished:
                usage["cached"] += out.num_cached_tokens
                kv_out = out.kv_transfer_params or kv_out
            for o in out.outputs:
                raise_if_error(o)
                c = choices[j * n + o.index]
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                if o.finish_reason is not None:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        result_choices = []
        for idx, c in sorted(choices.items()):
            text_in, ids, _ = jobs[idx // n]
            prefix = self._echoed(text_in, ids) if req.echo else ""
            lp = None
            if req.logprobs is not None:
                all_ids, entries = c.token_ids, list(c.logprobs)
                if req.echo:
                    all_ids = ids + c.token_ids
                    entries = list(prompt_lps.get(idx // n) or [None] * len(ids)) + entries
                lp = self.completion_logprobs(all_ids, entries, req.logprobs, 0)
            result_choices.append(
                {
                    "index": idx,
                    "text": prefix + c.text,
                    "logprobs": lp,
                    "finish_reason": finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
            usage["completion_tokens"] += len(c.token_ids)
        usage["prompt_tokens"] = sum(len(ids) for _, ids, _ in jobs)
        return self.response_body(
            "text_completion", request_id, model, result_choices, usage, kv_out
        )

    async def completion_stream(
        self, req: CompletionRequest, request_id: str, response_id: str | None = None
    ) -> AsyncIterator[str]:
        model, jobs = await self.prepare_completion(req)
        streams = await self.admit(request_id, jobs, req.priority, req.kv_transfer_params)
        return self._completion_events(req, response_id or request_id, model, jobs, streams)

    async def _completion_events(self, req, request_id, model, jobs, streams) -> AsyncIterator[str]:
        n = req.n
        created = now()
        usage = {
            "prompt_tokens": sum(len(ids) for _, ids, _ in jobs),
            "completion_tokens": 0,
            "cached": 0,
        }
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        try:
            async for j, out in self.merge([self.outputs(s) for s in streams]):
                if out.finished:
                    usage["cached"] += out.num_cached_tokens
                for o in out.outputs:
                    raise_if_error(o)
                    idx = j * n + o.index
                    text = o.text
                    lp = None
                    ids_for_lp, entries = o.token_ids, list(o.logprobs or [])
                    if req.echo and idx not in echoed:
                        echoed.add(idx)
                        text_in, ids, _ = jobs[j]
                        text = self._echoed(text_in, ids) + text
                        if req.logprobs is not None:
                            ids_for_lp = ids + o.token_ids
                            entries = list(out.prompt_logprobs or [None] * len(ids)) + entries
                    if req.logprobs is not None and ids_for_lp:
                        lp = self.completion_logprobs(
                            ids_for_lp, entries, req.logprobs, offsets.get(idx, 0)
                        )
                        offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    usage["completion_tokens"] += len(o.token_ids)
                    if not text and o.finish_reason is None and not o.token_ids:
                        continue
                    chunk = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {
                                "index": idx,
                                "text": text,
                                "logprobs": lp,
                                "finish_reason": finish_reason(o.finish_reason),
                                "stop_reason": o.stop_reason,
                            }
                        ],
                    }
                    if out.finished and out.kv_transfer_params is not None:
                        chunk["kv_transfer_params"] = out.kv_transfer_params
                    yield sse(chunk)
            if req.stream_options and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": self._usage(usage),
                    }
                )
            yield "data: [DONE]\n\n"
        except Exception as e:
            yield error_event(e, request_id)
            yield "data: [DONE]\n\n"
        finally:
            for stream in streams:
                stream.close()
