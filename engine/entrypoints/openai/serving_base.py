"""What completion and chat serving share: model and length checks, tokenizing,
running one engine stream, merging streams, usage and SSE framing.

The two endpoints live in ``serving_completion.py`` and ``serving_chat.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ...async_engine import AsyncEngine, EngineDeadError, QueueFullError
from ...outputs import Logprob, RequestOutput
from ...sampling_params import SamplingParams
from .protocol import APIError, ChatCompletionRequest


@dataclass
class Choice:
    """Accumulated state of one returned choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def raise_if_error(o: Any) -> None:
    """A sequence that ended in an engine-side error (e.g. a failed KV pull under
    kv_load_failure_policy=fail) becomes an HTTP error, never a silent answer."""
    if o.finish_reason == "error":
        raise APIError(str(o.stop_reason or "the request failed in the engine"), status=502)


def finish_reason(reason: str | None) -> str | None:
    # abort/error are not OpenAI finish reasons; a stop covers EOS, stop strings and ids.
    return None if reason is None else ("length" if reason == "length" else "stop")


class ServingBase:
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
            async for out in self.engine.generate(
                request_id,
                prompt_ids,
                params,
                prompt_text=text,
                priority=priority,
                kv_transfer_params=kv_params,
            ):
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

    @staticmethod
    def _token_str(lp: Logprob, tid: int) -> str:
        return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"

    @staticmethod
    def _usage(u: dict[str, int]) -> dict[str, Any]:
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached"]},
        }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
