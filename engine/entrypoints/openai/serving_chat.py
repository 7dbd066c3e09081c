"""``/v1/chat/completions``: messages through the chat template, assistant choices
out (JSON or SSE)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ...loop.async_engine import RequestStream
from ...outputs import Logprob
from ...sampling_params import SamplingParams, StructuredOutputsParams
from .protocol import APIError, ChatCompletionRequest
from .reasoning_parsers import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    prompt_opens_thought,
)
from .serving_base import (
    Choice,
    ChoiceIndex,
    Resume,
    ServingBase,
    choice_jobs,
    error_event,
    finish_reason,
    raise_if_error,
    sse,
)
from .tool_parsers import (
    ForcedParser,
    ParsedCall,
    ToolParser,
    forced_schema,
    get_parser,
    tool_call_id,
)


def tool_call_dicts(calls: list[ParsedCall], ids: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "id": ids[i],
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


class ChatServing(ServingBase):
    def reasoning_parser(self, req: ChatCompletionRequest) -> ReasoningParser | None:
        """The server's reasoning parser for this request: none when its output is
        constrained (a grammar or a forced tool call holds from the first token,
        so the model does not think first)."""
        parser = get_reasoning_parser(self.options.reasoning_parser)
        if parser is None or req.constraint_field() is not None:
            return None
        if req.tools and req.effective_tool_choice() not in ("none", "auto"):
            return None
        return parser

    def chat_logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        k: int,
        as_ids: bool = False,
    ) -> dict[str, Any]:
        content = []
        for tid, entry in zip(token_ids, entries, strict=True):
            lp = entry[tid]
            text = self._token_str(lp, tid, as_ids)
            top = [
                {
                    "token": self._token_str(x, t, as_ids),
                    "logprob": x.logprob,
                    "bytes": list(self._token_str(x, t, as_ids).encode()),
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

    def tool_parser(self, req: ChatCompletionRequest) -> tuple[ToolParser | None, Any]:
        """(parser of this request's output, its forced schema or None)."""
        choice = req.effective_tool_choice()
        if not req.tools or choice == "none":
            return None, None
        if choice == "auto":
            if not (self.options.enable_auto_tool_choice and self.options.tool_call_parser):
                raise APIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set (in an InferenceService: "
                    "spec.serving.enableAutoToolChoice: true and spec.serving.toolCallParser; "
                    'docs/tool_calling.md); tool_choice "none", "required" or a named '
                    "function work without them",
                    param="tool_choice",
                )
            return get_parser(self.options.tool_call_parser), None
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        try:
            schema = forced_schema(req.tools, choice, req.parallel_tool_calls)
        except ValueError as e:
            raise APIError(str(e), param="tools") from None
        return ForcedParser(named), schema

    async def prepare_chat(
        self, req: ChatCompletionRequest
    ) -> tuple[str, str, list[int], SamplingParams, int | None, ToolParser | None]:
        model = self.check_model(req.model)
        req.check_unsupported()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        k = self.check_logprobs((req.top_logprobs or 0) if req.logprobs else None, "top_logprobs")
        if req.logprobs and echoed_content(req):
            # The echoed message is part of the prompt: its tokens have no sampled
            # logprobs, and a response whose logprobs cover only part of its
            # content would misalign them. Refused, never dropped.
            raise APIError(
                "echo with logprobs is not supported for chat (the echoed message's "
                "logprobs are not computed); use prompt_logprobs for the prompt's "
                "tokens, or drop echo or logprobs",
                param="echo",
            )
        pk = self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if (
            req.add_generation_prompt
            and req.continue_final_message
            and "add_generation_prompt" in (req.model_fields_set)
        ):
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        self.check_sampling(req)
        parser, schema = self.tool_parser(req)
        spec = req.structured_spec()
        if schema is not None:
            spec = StructuredOutputsParams(json=schema)
        spec = await self.compile_constraint(
            spec, "tools" if schema is not None else req.constraint_field(), req.caller
        )
        text, ids = await self.chat_prompt(req, bounded=req.truncate_prompt_tokens is None)
        cut = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
        if len(cut) != len(ids):
            text, ids = self._need_tokenizer().decode(cut), cut
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.check_length(ids, max_tokens, "messages")
        self.check_output_tokens(req, [max_tokens])
        params = req.sampling_params(
            self.defaults, max_tokens, k, prompt_logprobs=pk, structured=spec
        )
        return model, text, ids, params, k, parser

    async def chat(
        self, req: ChatCompletionRequest, request_id: str, response_id: str | None = None
    ) -> dict[str, Any]:
        """``request_id`` keys the engine request (unique, the server's own);
        ``response_id`` is the body's ``id`` (default: the request id)."""
        model, text, ids, params, k, parser = await self.prepare_chat(req)
        (stream,) = await self.admit(
            request_id,
            [(text, ids, params)],
            req.priority,
            req.kv_transfer_params,
            self.lora_of(model),
            whole=True,
        )
        try:
            return await self._chat_body(
                req, response_id or request_id, model, text, ids, k, stream, parser
            )
        finally:
            stream.close()

    async def _chat_body(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        prompt_text: str,
        ids: list[int],
        k: int | None,
        stream: RequestStream,
        parser: ToolParser | None,
    ) -> dict[str, Any]:
        choices = {i: Choice(i) for i in range(req.n)}
        cached, kv_out, prompt_lps = 0, None, None
        as_ids = bool(req.return_tokens_as_token_ids)
        echo = echoed_content(req)
        async for out in self.outputs(stream):
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            if out.finished:
                cached, kv_out = out.num_cached_tokens, out.kv_transfer_params
            for o in out.outputs:
                raise_if_error(o)
                c = choices[o.index]
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                if o.finish_reason is not None:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        result = []
        thinking = self.reasoning_parser(req)
        opened = prompt_opens_thought(prompt_text)
        for idx, c in sorted(choices.items()):
            text, reasoning = c.text, ""
            if thinking is not None:
                reasoning, text = thinking.split(c.text, final=True, opened=opened)
            message: dict[str, Any] = {"role": "assistant", "content": echo + text}
            if reasoning and req.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            reason = finish_reason(c.finish_reason)
            if parser is not None:
                content, calls = parser.parse(text, final=True)
                if reason == "length" and (
                    isinstance(parser, ForcedParser)
                    or not all(complete_arguments(x) for x in calls)
                ):
                    # Cut off inside a call: no call is returned (its arguments are
                    # not JSON); the text stays in content and finish_reason says why.
                    # A forced tool_choice cut off is unfinished JSON as a whole
                    # (``required``: an array not closed), even when some of its
                    # items are complete.
                    calls = []
                if calls:
                    message["content"] = (echo + content).strip() or None
                    ids_ = [tool_call_id(self.options.tool_call_parser) for _ in calls]
                    message["tool_calls"] = tool_call_dicts(calls, ids_)
                    if reason == "stop":
                        reason = "tool_calls"
            choice: dict[str, Any] = {
                "index": idx,
                "message": message,
                "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, k or 0, as_ids)
                if k is not None
                else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            result.append(choice)
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": sum(len(c.token_ids) for c in choices.values()),
            "cached": cached,
        }
        body = self.response_body("chat.completion", request_id, model, result, usage, kv_out)
        if req.prompt_logprobs is not None:
            pk = self.check_logprobs(req.prompt_logprobs, "prompt_logprobs") or 0
            body["prompt_logprobs"] = self.prompt_logprobs_body(ids, prompt_lps, pk, as_ids)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        if req.return_prompt_text:
            body["prompt_text"] = prompt_text
        return body

    async def chat_stream(
        self, req: ChatCompletionRequest, request_id: str, response_id: str | None = None
    ) -> AsyncIterator[str]:
        model, text, ids, params, k, parser = await self.prepare_chat(req)
        jobs, index = choice_jobs([(text, ids, params)], req.n, req.migration)
        # Per choice, the text a migrated stream's sent tokens put before the client.
        resumed = {
            index(j, 0): self.resumed_text(ids, p)
            for j, (_, _, p) in enumerate(jobs)
            if p.resumed_token_ids
        }
        streams = await self.admit(
            request_id, jobs, req.priority, req.kv_transfer_params, self.lora_of(model)
        )
        return self._chat_events(
            req, response_id or request_id, model, text, ids, k, streams, index, parser, resumed
        )

    async def _chat_events(  # noqa: C901 (one SSE loop: reasoning, tools and holds per chunk)
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        prompt_text: str,
        ids: list[int],
        k: int | None,
        streams: list[RequestStream],
        index: ChoiceIndex,
        parser: ToolParser | None,
        resumed: dict[int, str],
    ) -> AsyncIterator[str]:
        """``streams``: the engine requests (one, but one per unfinished choice
        on a resumed leg of several), ``index`` the choice of their outputs
        (``choice_jobs``); ``resumed``: per choice, a migrated stream's text
        already sent by another engine (fed to the tool and reasoning parsers
        without being sent again)."""
        resume = Resume(req.migration, multi=req.n > 1)
        created = resume.created
        completion_tokens, cached = resume.prior, 0
        generated = resume.generated()  # per choice: tokens so far
        started = resume.opened()  # choices whose role chunk (and echo) went out
        tools = {i: _ToolStream(parser, self.options.tool_call_parser) for i in range(req.n)}
        as_ids = bool(req.return_tokens_as_token_ids)
        echo = echoed_content(req)
        options = req.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        first_chunk = not started
        thinking = self.reasoning_parser(req)
        opened = prompt_opens_thought(prompt_text)
        thoughts = {i: ReasoningStream(thinking, opened) for i in range(req.n)} if thinking else {}
        for i, text_sent in resumed.items():
            # The parsers' state as the first engine left it (what they return
            # for this text went out from there).
            text_for_tools = text_sent
            if thinking is not None:
                text_for_tools = thoughts[i].feed(text_sent, False)[1]
            if parser is not None:
                tools[i].feed(text_for_tools, False)

        def chunk(
            idx: int,
            delta: dict[str, Any],
            lp: dict[str, Any] | None = None,
            finish: str | None = None,
            stop_reason: int | str | None = None,
            token_ids: list[int] | None = None,
        ) -> str:
            nonlocal first_chunk
            choice: dict[str, Any] = {
                "index": idx,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = token_ids or []
            body: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if first_chunk:
                # The prompt once, on the stream's first chunk (vLLM's placement).
                if req.return_token_ids:
                    body["prompt_token_ids"] = ids
                if req.return_prompt_text:
                    body["prompt_text"] = prompt_text
                first_chunk = False
            if continuous:
                # This choice's own tokens so far (vLLM's), not the request's sum.
                body["usage"] = self.usage_so_far(len(ids), generated.get(idx, 0), cached)
            return resume.event(token_ids, sse(body), idx, finish is not None)

        try:
            async for j, out in self.merge([self.outputs(s) for s in streams]):
                if out.finished:
                    # One prompt: each engine request of it found the same cache.
                    cached = max(cached, out.num_cached_tokens)
                for o in out.outputs:
                    raise_if_error(o)
                    idx = index(j, o.index)
                    if idx not in started:
                        started.add(idx)
                        yield chunk(idx, {"role": "assistant", "content": ""})
                        if echo:
                            yield chunk(idx, {"content": echo})
                    completion_tokens += len(o.token_ids)
                    generated[idx] = generated.get(idx, 0) + len(o.token_ids)
                    if not o.text and o.finish_reason is None and not o.token_ids:
                        continue
                    lp = (
                        self.chat_logprobs(o.token_ids, o.logprobs or [], k or 0, as_ids)
                        if k is not None and o.token_ids
                        else None
                    )
                    reason = finish_reason(o.finish_reason)
                    text = o.text
                    # This step's new token ids ride on the first chunk it sends;
                    # a step whose text is held back (a partial tag) still sends
                    # them, on a chunk with an empty delta.
                    new_ids = [list(o.token_ids)]
                    hold = False
                    if thinking is not None:
                        # Reasoning goes out as its own deltas; the answer goes on.
                        reasoning, text = thoughts[idx].feed(o.text, o.finish_reason is not None)
                        if reasoning and req.include_reasoning:
                            yield chunk(
                                idx,
                                {"reasoning": reasoning, "reasoning_content": reasoning},
                                token_ids=_take(new_ids),
                            )
                        hold = not text and o.finish_reason is None and lp is None
                    if parser is not None and not hold:
                        ts = tools[idx]
                        final = o.finish_reason is not None
                        deltas = ts.feed(text, final)
                        for d in deltas[:-1]:
                            yield chunk(idx, d, token_ids=_take(new_ids))
                        delta = deltas[-1] if deltas else {}
                        if final and ts.num_calls and reason == "stop":
                            reason = "tool_calls"
                        hold = not delta and not final and lp is None
                    elif parser is None:
                        delta = {"content": text} if text or o.finish_reason is None else {}
                    if hold:
                        if req.return_token_ids and new_ids[0]:
                            yield chunk(idx, {}, token_ids=_take(new_ids))
                        else:
                            # Their text is held back: the gateway still counts them sent.
                            held = resume.held(new_ids[0], idx)
                            if held is not None:
                                _take(new_ids)
                                yield held
                        continue
                    yield chunk(idx, delta, lp, reason, o.stop_reason, _take(new_ids))
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
        except Exception as e:
            yield error_event(e, request_id)
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.close()


def _take(box: list[list[int]]) -> list[int]:
    """The ids in ``box``, which is left empty (each id goes out once)."""
    taken, box[0] = box[0], []
    return taken


def echoed_content(req: ChatCompletionRequest) -> str:
    """Chat ``echo``: the last message's text when it is the assistant's (the role
    the answer continues), prepended to each choice's content; else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    return req.messages[-1].text()


def complete_arguments(call: ParsedCall) -> bool:
    """A parsed call whose arguments are whole JSON."""
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return call.complete and call.name is not None


class _ToolStream:
    """One choice's streamed text turned into content and ``tool_calls`` deltas."""

    def __init__(self, parser: ToolParser | None, parser_name: str | None) -> None:
        self.parser, self.parser_name = parser, parser_name
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas that the text so far adds (OpenAI's shape: a call's id and
        name first, then fragments of its arguments)."""
        if self.parser is None:
            raise RuntimeError("broken invariant: self.parser is not None")
        self.text += text
        content, calls = self.parser.parse(self.text, final)
        out: list[dict[str, Any]] = []
        if len(content) > self.sent_content and not (calls and not content.strip()):
            out.append({"content": content[self.sent_content :]})
            self.sent_content = len(content)
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i >= len(self.ids):
                self.ids.append(tool_call_id(self.parser_name))
                self.sent_args.append(0)
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": self.ids[i],
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            if len(call.arguments) > self.sent_args[i]:
                fragment = call.arguments[self.sent_args[i] :]
                self.sent_args[i] = len(call.arguments)
                out.append({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
        return out
