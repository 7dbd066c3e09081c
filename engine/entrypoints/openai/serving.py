"""Completions and chat completions over the async engine (JSON and SSE)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ... import tracing
from ...async_engine import AsyncEngine, EngineDeadError, QueueFullError
from ...outputs import Logprob, RequestOutput
from ...sampling_params import SamplingParams
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    now,
)


@dataclass
class Choice:
    """Accumulated state of one returned choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _raise_if_error(o: Any) -> None:
    """A sequence that ended in an engine-side error (e.g. a failed KV pull under
    kv_load_failure_policy=fail) becomes an HTTP error, never a silent answer."""
    if o.finish_reason == "error":
        raise APIError(str(o.stop_reason or "the request failed in the engine"), status=502)


def _finish_reason(reason: str | None) -> str | None:
    # abort/error are not OpenAI finish reasons; a stop covers EOS, stop strings and ids.
    return None if reason is None else ("length" if reason == "length" else "stop")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_names: list[str], max_model_len: int) -> None:
        self.engine = engine
        self.served_names = served_names
        self.max_model_len = max_model_len
        self.tokenizer = engine.engine.tokenizer
        self.defaults = dict(engine.engine.default_sampling)
        self.max_logprobs = engine.engine.config.model_config.max_logprobs

    # -- checks -------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_names:
            return self.served_names[0]
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model")

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(
                "this server has no tokenizer (--skip-tokenizer-init): pass token ids",
                param="prompt",
            )
        return self.tokenizer

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self._need_tokenizer()(prompt, add_special_tokens=add_special_tokens).input_ids
        return list(prompt)

    def apply_chat_template(self, req: ChatCompletionRequest | Any) -> tuple[str, list[int]]:
        tok = self._need_tokenizer()
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt
                and not getattr(req, "continue_final_message", False),
                continue_final_message=getattr(req, "continue_final_message", False),
            )
        except Exception as e:  # a template that rejects the conversation is bad input
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
        return text, tok(text, add_special_tokens=False).input_ids

    def check_length(self, prompt_ids: list[int], max_tokens: int | None, what: str) -> int:
        """The effective max_tokens; 400 when the prompt plus output cannot fit."""
        if not prompt_ids:
            raise APIError("the prompt is empty", param="prompt" if what == "prompt" else what)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {n} input tokens. Please reduce the length of the input.",
                param=what,
            )
        if max_tokens is None:
            return self.max_model_len - n
        if max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the "
                "completion). Please reduce the length of the input or completion.",
                param="max_tokens",
            )
        return max_tokens

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and not 0 <= k <= self.max_logprobs:
            raise APIError(
                f"{param} must be between 0 and {self.max_logprobs}, got {k}", param=param
            )

    # -- running ------------------------------------------------------------------

    async def _stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        text: str | None,
        priority: int,
        kv_params: dict[str, Any] | None,
    ) -> AsyncIterator[RequestOutput]:
        try:
            outputs = self.engine.generate(
                request_id,
                prompt_ids,
                params,
                prompt_text=text,
                priority=priority,
                kv_transfer_params=kv_params,
            )
            async for out in tracing.trace_generate(outputs, request_id, kv_params):
                yield out
        except QueueFullError as e:
            raise APIError(str(e), status=503) from None
        except EngineDeadError as e:
            raise APIError(str(e), status=503) from None
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(":")[0] if ":" in str(e) else None) from None

    @staticmethod
    async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
        """Interleave several async iterators, tagging items with their index."""
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, it: AsyncIterator[Any]) -> None:
            try:
                async for item in it:
                    await queue.put((i, item))
            except BaseException as e:  # forwarded to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- logprobs -----------------------------------------------------------------

    @staticmethod
    def _token_str(lp: Logprob, tid: int) -> str:
        return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"

    def completion_logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, Logprob] | None],
        k: int,
        offset: int,
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
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
                top = {}
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

    def chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], k: int
    ) -> dict[str, Any]:
        content = []
        for tid, entry in zip(token_ids, entries, strict=True):
            lp = entry[tid]
            text = self._token_str(lp, tid)
            top = [
                {
                    "token": self._token_str(x, t),
                    "logprob": x.logprob,
                    "bytes": list(self._token_str(x, t).encode()),
                }
                for t, x in sorted(entry.items(), key=lambda kv: -kv[1].logprob)
            ][:k]
            content.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    # -- completions --------------------------------------------------------------

    async def prepare_completion(self, req: CompletionRequest):
        model = self.check_model(req.model)
        req.check_unsupported()
        if req.suffix:
            raise APIError("suffix is not supported by pdfleet", param="suffix")
        self.check_logprobs(req.logprobs, "logprobs")
        prompts = await asyncio.to_thread(
            lambda: [(p if isinstance(p, str) else None, self.tokenize(p)) for p in req.prompts()]
        )
        jobs = []
        for text, ids in prompts:
            max_tokens = self.check_length(ids, req.max_tokens, "prompt")
            params = req.sampling_params(
                self.defaults,
                max_tokens,
                req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            )
            jobs.append((text, ids, params))
        return model, jobs

    def _job_streams(self, jobs: list, request_id: str, req: Any) -> list:
        """One engine stream per prompt of the request (ids suffixed when several)."""
        return [
            self._stream(
                f"{request_id}-{j}" if len(jobs) > 1 else request_id,
                ids,
                params,
                text,
                req.priority,
                req.kv_transfer_params,
            )
            for j, (text, ids, params) in enumerate(jobs)
        ]

    async def completion(self, req: CompletionRequest, request_id: str) -> dict[str, Any]:
        model, jobs = await self.prepare_completion(req)
        n = req.n
        choices = {i: Choice(i) for i in range(len(jobs) * n)}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}
        prompt_lps: dict[int, list] = {}
        kv_out = None
        streams = self._job_streams(jobs, request_id, req)
        async for j, out in self.merge(streams):
            if out.prompt_logprobs is not None:
                prompt_lps[j] = out.prompt_logprobs
            if out.finished:
                usage["cached"] += out.num_cached_tokens
                kv_out = out.kv_transfer_params or kv_out
            for o in out.outputs:
                _raise_if_error(o)
                c = choices[j * n + o.index]
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                if o.finish_reason is not None:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        result_choices = []
        for idx, c in sorted(choices.items()):
            text_in, ids, _ = jobs[idx // n]
            prefix = ""
            if req.echo:
                prefix = (
                    text_in
                    if text_in is not None
                    else (self.tokenizer.decode(ids) if self.tokenizer else "")
                )
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
                    "finish_reason": _finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
            usage["completion_tokens"] += len(c.token_ids)
        usage["prompt_tokens"] = sum(len(ids) for _, ids, _ in jobs)
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": model,
            "choices": result_choices,
            "usage": self._usage(usage),
        }
        if kv_out is not None:
            body["kv_transfer_params"] = kv_out
        return body

    @staticmethod
    def _usage(u: dict[str, int]) -> dict[str, Any]:
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached"]},
        }

    async def completion_stream(
        self, req: CompletionRequest, request_id: str
    ) -> AsyncIterator[str]:
        model, jobs = await self.prepare_completion(req)
        return self._completion_events(req, request_id, model, jobs)

    async def _completion_events(self, req, request_id, model, jobs) -> AsyncIterator[str]:
        n = req.n
        created = now()
        usage = {
            "prompt_tokens": sum(len(ids) for _, ids, _ in jobs),
            "completion_tokens": 0,
            "cached": 0,
        }
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        streams = self._job_streams(jobs, request_id, req)
        try:
            async for j, out in self.merge(streams):
                if out.finished:
                    usage["cached"] += out.num_cached_tokens
                for o in out.outputs:
                    _raise_if_error(o)
                    idx = j * n + o.index
                    text = o.text
                    lp = None
                    ids_for_lp, entries = o.token_ids, list(o.logprobs or [])
                    if req.echo and idx not in echoed:
                        echoed.add(idx)
                        text_in, ids, _ = jobs[j]
                        text = (
                            text_in if text_in is not None else self.tokenizer.decode(ids)
                        ) + text
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
                                "finish_reason": _finish_reason(o.finish_reason),
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
        except APIError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"

    # -- chat ---------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest):
        model = self.check_model(req.model)
        req.check_unsupported()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        self.check_logprobs(k, "top_logprobs")
        text, ids = await asyncio.to_thread(self.apply_chat_template, req)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.check_length(ids, max_tokens, "messages")
        params = req.sampling_params(self.defaults, max_tokens, k)
        return model, text, ids, params, k

    async def chat(self, req: ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        model, text, ids, params, k = await self.prepare_chat(req)
        choices = {i: Choice(i) for i in range(req.n)}
        cached, kv_out = 0, None
        async for out in self._stream(
            request_id, ids, params, text, req.priority, req.kv_transfer_params
        ):
            if out.finished:
                cached, kv_out = out.num_cached_tokens, out.kv_transfer_params
            for o in out.outputs:
                _raise_if_error(o)
                c = choices[o.index]
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                if o.finish_reason is not None:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        result = []
        for idx, c in sorted(choices.items()):
            result.append(
                {
                    "index": idx,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, k or 0)
                    if k is not None
                    else None,
                    "finish_reason": _finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": sum(len(c.token_ids) for c in choices.values()),
            "cached": cached,
        }
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": model,
            "choices": result,
            "usage": self._usage(usage),
        }
        if kv_out is not None:
            body["kv_transfer_params"] = kv_out
        return body

    async def chat_stream(self, req: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
        prepared = await self.prepare_chat(req)
        return self._chat_events(req, request_id, *prepared)

    async def _chat_events(self, req, request_id, model, text, ids, params, k):
        created = now()
        completion_tokens, cached = 0, 0
        started: set[int] = set()

        def chunk(idx: int, delta: dict, lp=None, finish=None, stop_reason=None) -> str:
            return sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": idx,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": finish,
                            "stop_reason": stop_reason,
                        }
                    ],
                }
            )

        try:
            async for out in self._stream(
                request_id, ids, params, text, req.priority, req.kv_transfer_params
            ):
                if out.finished:
                    cached = out.num_cached_tokens
                for o in out.outputs:
                    _raise_if_error(o)
                    if o.index not in started:
                        started.add(o.index)
                        yield chunk(o.index, {"role": "assistant", "content": ""})
                    completion_tokens += len(o.token_ids)
                    if not o.text and o.finish_reason is None and not o.token_ids:
                        continue
                    lp = (
                        self.chat_logprobs(o.token_ids, o.logprobs or [], k or 0)
                        if k is not None and o.token_ids
                        else None
                    )
                    delta = {"content": o.text} if o.text or o.finish_reason is None else {}
                    yield chunk(o.index, delta, lp, _finish_reason(o.finish_reason), o.stop_reason)
            if req.stream_options and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": self._usage(
                            {
                                "prompt_tokens": len(ids),
                                "completion_tokens": completion_tokens,
                                "cached": cached,
                            }
                        ),
                    }
                )
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
