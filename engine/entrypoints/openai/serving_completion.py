"""``/v1/completions``: prompts (text or token ids) in, text choices out (JSON or SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...contracts.kv_params import FIELD as KV_PARAMS
from ...loop.async_engine import RequestStream
from ...outputs import Logprob
from .protocol import APIError, CompletionRequest
from .serving_base import (
    Choice,
    ChoiceIndex,
    Job,
    Resume,
    ServingBase,
    choice_jobs,
    error_event,
    finish_reason,
    raise_if_error,
    sse,
)


class CompletionServing(ServingBase):
    def _offset_token(self, tid: int, as_ids: bool) -> str:
        """A token's string as :meth:`completion_logprobs` counts it in text
        offsets (the output processor's ``decoded_token``, the same decode)."""
        if self.tokenizer is None or as_ids:
            return f"token_id:{tid}"
        return str(self.tokenizer.decode([tid]))

    def completion_logprobs(
        self,
        token_ids: list[int],
        entries: Sequence[dict[int, Logprob] | None],
        k: int,
        offset: int,
        as_ids: bool = False,
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, entry in zip(token_ids, entries, strict=True):
            if entry is None:  # first prompt token: nothing predicts it
                text = (
                    self.tokenizer.decode([tid])
                    if self.tokenizer and not as_ids
                    else f"token_id:{tid}"
                )
                tokens.append(text)
                token_lps.append(None)
                tops.append(None)
            else:
                lp = entry[tid]
                text = self._token_str(lp, tid, as_ids)
                tokens.append(text)
                token_lps.append(lp.logprob)
                # The k most likely tokens, and the chosen one always (logprobs 0:
                # just the chosen one), as OpenAI's legacy completions answer.
                top: dict[str, float] = {}
                for t, x in entry.items():
                    if t != tid and len(top) < k:
                        top[self._token_str(x, t, as_ids)] = x.logprob
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

    async def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[Job]]:
        model = self.check_model(req.model)
        req.check_unsupported()
        self.check_sampling(req)
        k = self.check_logprobs(req.logprobs, "logprobs")
        pk = self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        structured = await self.compile_constraint(
            req.structured_spec(), req.constraint_field(), req.caller
        )
        # A prompt cut by truncate_prompt_tokens is known by its ids alone (echo
        # returns what the model saw, decoded).
        bounded = req.truncate_prompt_tokens is None
        prompts = [
            (text if len(cut) == len(ids) else None, cut)
            for text, ids in await self.tokenize_prompts(
                req.prompts(), bounded=bounded, add_special_tokens=req.add_special_tokens
            )
            for cut in [self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)]
        ]
        lengths = [self.check_length(ids, req.max_tokens, "prompt") for _, ids in prompts]
        self.check_output_tokens(req, lengths)
        # The prompt's logprobs: for prompt_logprobs, and for echo with logprobs.
        wanted = [x for x in (pk, k if req.echo else None) if x is not None]
        jobs: list[Job] = []
        for (text, ids), max_tokens in zip(prompts, lengths, strict=True):
            params = req.sampling_params(
                self.defaults,
                max_tokens,
                k,
                prompt_logprobs=max(wanted) if wanted else None,
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
        streams = await self.admit(
            request_id, jobs, req.priority, req.kv_transfer_params, self.lora_of(model), whole=True
        )
        try:
            return await self._completion_body(req, response_id or request_id, model, jobs, streams)
        finally:
            for stream in streams:
                stream.close()

    async def _completion_body(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        jobs: list[Job],
        streams: list[RequestStream],
    ) -> dict[str, Any]:
        n = req.n
        choices = {i: Choice(i) for i in range(len(jobs) * n)}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
        prompt_lps: dict[int, list[dict[int, Logprob] | None]] = {}
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
            as_ids = bool(req.return_tokens_as_token_ids)
            k = self.check_logprobs(req.logprobs, "logprobs")
            if k is not None:
                entries: list[dict[int, Logprob] | None]  # None: a prompt token without one
                all_ids, entries = c.token_ids, list(c.logprobs)
                if req.echo:
                    all_ids = ids + c.token_ids
                    entries = list(prompt_lps.get(idx // n) or [None] * len(ids)) + entries
                lp = self.completion_logprobs(all_ids, entries, k, 0, as_ids)
            choice: dict[str, Any] = {
                "index": idx,
                "text": prefix + c.text,
                "logprobs": lp,
                "finish_reason": finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            if req.prompt_logprobs is not None:
                pk = self.check_logprobs(req.prompt_logprobs, "prompt_logprobs") or 0
                choice["prompt_logprobs"] = self.prompt_logprobs_body(
                    ids, prompt_lps.get(idx // n), pk, as_ids
                )
            if req.return_token_ids:
                choice["prompt_token_ids"] = ids
                choice["token_ids"] = c.token_ids
            result_choices.append(choice)
            usage["completion_tokens"] += len(c.token_ids)
        usage["prompt_tokens"] = sum(len(ids) for _, ids, _ in jobs)
        return self.response_body(
            "text_completion", request_id, model, result_choices, usage, kv_out
        )

    async def completion_stream(
        self, req: CompletionRequest, request_id: str, response_id: str | None = None
    ) -> AsyncIterator[str]:
        model, jobs = await self.prepare_completion(req)
        if req.migration is not None and req.migration.output_token_ids and len(jobs) > 1:
            raise APIError(
                "migration.output_token_ids: a request of several prompts resumes by "
                "migration.choices",
                param="migration.output_token_ids",
            )
        prompt_tokens = sum(len(ids) for _, ids, _ in jobs)
        run, index = choice_jobs(jobs, req.n, req.migration)
        # Per choice that went out, where its logprobs' text offsets go on
        # from: the first leg advanced them by each named token's string (the
        # echoed prompt's too), not by the text it sent (a partial UTF-8
        # character or a held-back stop-string prefix is text not sent yet).
        resumed: dict[int, int] = {}
        as_ids = bool(req.return_tokens_as_token_ids)
        for j, (_, ids, params) in enumerate(run):
            i = index(j, 0)
            if (
                req.logprobs is None
                or req.migration is None
                or req.migration.choice_sent(i) is None
            ):
                continue
            counted = [*(ids if req.echo else ()), *params.resumed_token_ids]
            resumed[i] = sum(len(self._offset_token(t, as_ids)) for t in counted)
        streams = await self.admit(
            request_id, run, req.priority, req.kv_transfer_params, self.lora_of(model)
        )
        return self._completion_events(
            req, response_id or request_id, model, run, index, prompt_tokens, streams, resumed
        )

    async def _completion_events(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        jobs: list[Job],
        index: ChoiceIndex,
        prompt_tokens: int,
        streams: list[RequestStream],
        resumed: dict[int, int],
    ) -> AsyncIterator[str]:
        """``jobs``: the engine requests (``streams``; on a resumed leg of
        several choices one per unfinished choice), ``index`` the choice of
        their outputs (``choice_jobs``), ``prompt_tokens`` those of every
        prompt of the request; ``resumed``: per choice of a migrated stream,
        the text offset its logprobs go on from."""
        resume = Resume(req.migration, multi=req.n > 1 or len(req.prompts()) > 1)
        created = resume.created
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": resume.prior,
            "cached": 0,
        }
        echoed = resume.opened()  # choices whose echo went out
        offsets: dict[int, int] = dict(resumed)
        k = self.check_logprobs(req.logprobs, "logprobs")
        as_ids = bool(req.return_tokens_as_token_ids)
        options = req.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        # Per choice, for continuous usage (vLLM's): its own prompt's tokens and
        # the tokens it has generated so far, not the request's totals.
        generated = resume.generated()
        cached_of: dict[int, int] = {}
        cached_per_prompt: dict[int, int] = {}
        try:
            async for j, out in self.merge([self.outputs(s) for s in streams]):
                if out.finished:
                    cached_of[j] = out.num_cached_tokens
                    # Per prompt (a resumed leg runs one request per choice of it).
                    prompt = index(j, 0) // req.n
                    cached_per_prompt[prompt] = max(
                        cached_per_prompt.get(prompt, 0), out.num_cached_tokens
                    )
                    usage["cached"] = sum(cached_per_prompt.values())
                for o in out.outputs:
                    raise_if_error(o)
                    idx = index(j, o.index)
                    text = o.text
                    lp = None
                    ids_for_lp, entries = o.token_ids, list(o.logprobs or [])
                    first = idx not in echoed  # this choice's first chunk
                    if req.echo and first:
                        text_in, ids, _ = jobs[j]
                        text = self._echoed(text_in, ids) + text
                        if k is not None:
                            ids_for_lp = ids + o.token_ids
                            entries = list(out.prompt_logprobs or [None] * len(ids)) + entries
                    if k is not None and ids_for_lp:
                        lp = self.completion_logprobs(
                            ids_for_lp, entries, k, offsets.get(idx, 0), as_ids
                        )
                        offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    usage["completion_tokens"] += len(o.token_ids)
                    generated[idx] = generated.get(idx, 0) + len(o.token_ids)
                    if not text and o.finish_reason is None and not o.token_ids:
                        continue
                    choice: dict[str, Any] = {
                        "index": idx,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": finish_reason(o.finish_reason),
                        "stop_reason": o.stop_reason,
                    }
                    if req.return_token_ids:
                        # The prompt's ids once per choice (its first chunk), then
                        # each chunk's new ids.
                        if first:
                            choice["prompt_token_ids"] = jobs[j][1]
                        choice["token_ids"] = o.token_ids
                    chunk = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    if continuous:
                        chunk["usage"] = self.usage_so_far(
                            len(jobs[j][1]), generated[idx], cached_of.get(j, 0)
                        )
                    if out.finished and out.kv_transfer_params is not None:
                        chunk[KV_PARAMS] = out.kv_transfer_params
                    echoed.add(idx)
                    yield resume.event(o.token_ids, sse(chunk), idx, o.finish_reason is not None)
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
