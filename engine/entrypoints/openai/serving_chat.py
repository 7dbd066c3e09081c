"""``/v1/chat/completions``: messages through the chat template, assistant choices
out (JSON or SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ...outputs import Logprob
from ...sampling_params import StructuredOutputsParams
from .protocol import APIError, ChatCompletionRequest, now
from .serving_base import Choice, ServingBase, error_event, finish_reason, raise_if_error, sse
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

    async def prepare_chat(self, req: ChatCompletionRequest):
        model = self.check_model(req.model)
        req.check_unsupported()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        self.check_logprobs(k, "top_logprobs")
        self.check_sampling(req)
        parser, schema = self.tool_parser(req)
        spec = req.structured_spec()
        if schema is not None:
            spec = StructuredOutputsParams(json=schema)
        spec = await self.compile_constraint(
            spec, "tools" if schema is not None else req.constraint_field(), req.caller
        )
        text, ids = await self.chat_prompt(req)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.check_length(ids, max_tokens, "messages")
        self.check_output_tokens(req, [max_tokens])
        params = req.sampling_params(self.defaults, max_tokens, k, structured=spec)
        return model, text, ids, params, k, parser

    async def chat(
        self, req: ChatCompletionRequest, request_id: str, response_id: str | None = None
    ) -> dict[str, Any]:
        """``request_id`` keys the engine request (unique, the server's own);
        ``response_id`` is the body's ``id`` (default: the request id)."""
        model, text, ids, params, k, parser = await self.prepare_chat(req)
        (stream,) = await self.admit(
            request_id, [(text, ids, params)], req.priority, req.kv_transfer_params
        )
        try:
            return await self._chat_body(
                req, response_id or request_id, model, ids, k, stream, parser
            )
        finally:
            stream.close()

    async def _chat_body(self, req, request_id, model, ids, k, stream, parser) -> dict[str, Any]:
        choices = {i: Choice(i) for i in range(req.n)}
        cached, kv_out = 0, None
        async for out in self.outputs(stream):
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
        for idx, c in sorted(choices.items()):
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = finish_reason(c.finish_reason)
            if parser is not None:
                content, calls = parser.parse(c.text, final=True)
                if calls:
                    message["content"] = content.strip() or None
                    ids_ = [tool_call_id(self.options.tool_call_parser) for _ in calls]
                    message["tool_calls"] = tool_call_dicts(calls, ids_)
                    if reason == "stop":
                        reason = "tool_calls"
            result.append(
                {
                    "index": idx,
                    "message": message,
                    "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, k or 0)
                    if k is not None
                    else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": sum(len(c.token_ids) for c in choices.values()),
            "cached": cached,
        }
        return self.response_body("chat.completion", request_id, model, result, usage, kv_out)

    async def chat_stream(
        self, req: ChatCompletionRequest, request_id: str, response_id: str | None = None
    ) -> AsyncIterator[str]:
        model, text, ids, params, k, parser = await self.prepare_chat(req)
        (stream,) = await self.admit(
            request_id, [(text, ids, params)], req.priority, req.kv_transfer_params
        )
        return self._chat_events(req, response_id or request_id, model, ids, k, stream, parser)

    async def _chat_events(self, req, request_id, model, ids, k, stream, parser):
        created = now()
        completion_tokens, cached = 0, 0
        started: set[int] = set()
        tools = {i: _ToolStream(parser, self.options.tool_call_parser) for i in range(req.n)}

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
            async for out in self.outputs(stream):
                if out.finished:
                    cached = out.num_cached_tokens
                for o in out.outputs:
                    raise_if_error(o)
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
                    reason = finish_reason(o.finish_reason)
                    if parser is not None:
                        ts = tools[o.index]
                        final = o.finish_reason is not None
                        deltas = ts.feed(o.text, final)
                        for d in deltas[:-1]:
                            yield chunk(o.index, d)
                        delta = deltas[-1] if deltas else {}
                        if final and ts.num_calls and reason == "stop":
                            reason = "tool_calls"
                        if not delta and not final and lp is None:
                            continue
                    else:
                        delta = {"content": o.text} if o.text or o.finish_reason is None else {}
                    yield chunk(o.index, delta, lp, reason, o.stop_reason)
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
            stream.close()


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
        assert self.parser is not None
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
