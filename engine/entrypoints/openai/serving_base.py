"""What completion and chat serving share: model and length checks, tokenizing,
running one engine stream, merging streams, usage and SSE framing.

The two endpoints live in ``serving_completion.py`` and ``serving_chat.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ... import tracing
from ...contracts.kv_params import FIELD as KV_PARAMS
from ...contracts.kv_params import KVTransferParams
from ...contracts.migration import MigrationState, ids_comment
from ...contracts.request_fields import RESERVED_TEMPLATE_KWARGS
from ...contracts.sampling_checks import check_output_tokens, check_sampling, num_sequences
from ...loop.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from ...loop.llm_engine import child_seed
from ...loop.output_processor import ChildState
from ...outputs import Logprob, RequestOutput
from ...sample.grammar import GrammarTimeout, GrammarTooLarge
from ...sampling_params import SamplingParams, StructuredOutputsParams
from .grammar_gate import CompileBusy, CompileGate
from .protocol import APIError, ChatCompletionRequest, now

logger = logging.getLogger("pdfleet.serve")

_T = TypeVar("_T")

# (prompt text or None, prompt token ids, sampling params): one engine request.
Job = tuple[str | None, list[int], SamplingParams]


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


def api_error(e: BaseException) -> APIError | None:
    """The HTTP error for an engine-side refusal or failure (None: not one of those)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError | EngineDeadError):
        return APIError(str(e), status=503)
    if isinstance(e, EngineStepError):
        return APIError(f"{e}; retry the request", status=500)
    if isinstance(e, ValueError):
        # A refusal that names its field (RefusedParams: kv_transfer_params) says
        # so; other engine and connector messages start with the field they refuse.
        param = getattr(e, "param", None)
        if isinstance(param, str):
            return APIError(str(e), param=param)
        m = re.match(r"[A-Za-z_][A-Za-z0-9_.]*", str(e))
        return APIError(str(e), param=m.group(0) if m and ":" in str(e) else None)
    return None


def error_event(e: BaseException, request_id: str) -> str:
    """The SSE error event that ends a stream which failed after its response began."""
    error = api_error(e)
    if error is None:
        logger.error("request %s failed mid-stream", request_id, exc_info=e)
        error = APIError("internal error while streaming the response", status=500)
    return sse(error.body())


class Resume:
    """A migratable stream's side of migration (docs/migration.md), shared by
    the completions and chat streams: the answer keeps the first engine's
    ``created``; the tokens another engine already sent count as this
    stream's output (``prior``) on their choices, whose opening chunks (a
    role chunk, an echo) went out from there; and every event that sends
    token ids names them in an ``: ids`` comment, the stream's first event
    too (the gateway moves only a stream that speaks this from its start).
    A request of several choices (``multi``) names the choice on every event
    (``: ids.I``, ``: end.I`` on the one that finishes it)."""

    __slots__ = ("annotated", "created", "migratable", "multi", "prior", "sent_of")

    def __init__(self, migration: MigrationState | None, multi: bool = False) -> None:
        self.migratable = migration is not None
        self.multi = multi
        self.created = migration.created if migration and migration.created else now()
        self.sent_of: dict[int, tuple[int, ...]] = {}
        """Per choice that went out (its opening chunk at least), the output
        tokens another engine sent before this leg."""
        if migration is not None and migration.choices is not None:
            self.sent_of = {i: c for i, c in enumerate(migration.choices) if c is not None}
        elif migration is not None and migration.output_token_ids:
            self.sent_of = {0: migration.output_token_ids}
        self.prior = sum(map(len, self.sent_of.values()))
        """Output tokens another engine sent before this leg (finished choices too)."""
        self.annotated = False

    def generated(self) -> dict[int, int]:
        """Per choice, the output tokens so far (the sent ones)."""
        return {i: len(c) for i, c in self.sent_of.items() if c}

    def opened(self) -> set[int]:
        """The choices whose opening chunk (role, echo) already went out."""
        return set(self.sent_of)

    def event(
        self, token_ids: list[int] | None, event: str, index: int = 0, end: bool = False
    ) -> str:
        """``event`` (an SSE event of choice ``index``; ``end``: it finishes
        the choice) as this stream sends it: after the ``: ids`` comment naming
        ``token_ids`` on a migratable stream."""
        if not self.migratable:
            return event
        if self.multi:
            return ids_comment(token_ids or [], index, end) + event
        if token_ids or end or not self.annotated:
            self.annotated = True
            return ids_comment(token_ids or [], end=end) + event
        return event

    def held(self, token_ids: list[int], index: int = 0) -> str | None:
        """The event for tokens whose text is held back (a stop string's or a
        parser's): the ``: ids`` comment alone, so the gateway counts them
        sent; None on a stream that is not migratable or when there are none."""
        if self.migratable and token_ids:
            return ids_comment(token_ids, index if self.multi else None) + "\n"
        return None


ChoiceIndex = Callable[[int, int], int]
"""``index(job, output index)``: the choice index an output of a job answers."""


def choice_jobs(
    jobs: list[Job], n: int, migration: MigrationState | None
) -> tuple[list[Job], ChoiceIndex]:
    """The engine requests of a stream and the choice index of their outputs.

    As asked: one request per prompt (job) of ``n`` sequences, choice
    ``job × n + i``. A resumed leg of several choices (``migration.choices``):
    one ``n`` = 1 request per unfinished choice, of its prompt, after its own
    sent tokens and with the seed the engine gives that sequence of an ``n``
    request (``child_seed``), so that it draws what it would have drawn
    unfaulted; finished choices are not run again."""
    if migration is None or migration.choices is None:
        return jobs, lambda j, o: j * n + o
    choices = migration.choices
    if len(choices) != len(jobs) * n:
        raise APIError(
            f"migration.choices: names {len(choices)} choices; the request has "
            f"{len(jobs) * n} ({len(jobs)} prompts of n = {n})",
            param="migration.choices",
        )
    finished = set(migration.finished)
    out: list[Job] = []
    index: list[int] = []
    for i, sent in enumerate(choices):
        if i in finished:
            continue
        text, ids, params = jobs[i // n]
        seed = None if params.seed is None else child_seed(params.seed, i % n)
        try:
            resumed = params.clone(n=1, seed=seed, resumed_token_ids=list(sent or ()))
        except ValueError as e:
            raise APIError(
                f"migration.choices: choice {i}: {e}", param="migration.choices"
            ) from None
        out.append((text, ids, resumed))
        index.append(i)
    return out, lambda j, o: index[j]


# Prompts this short are tokenized on the event loop: their tokenizing takes
# tens of microseconds, and a hop to a lane thread and back costs more (two
# thread wake-ups, each waiting for the GIL that a stepping engine thread holds).
INLINE_CHARS = 256


class TokenizerLanes:
    """Tokenizer work off the event loop, in two lanes.

    Prompts of at least ``large_chars`` characters queue for their own small
    pool, so a burst of multi-megabyte prompts cannot occupy the threads that
    short prompts use (the tokenizer releases the GIL, so the lanes really run
    side by side). Prompts of at most ``inline_chars`` characters are
    tokenized where they are asked for, on the event loop."""

    def __init__(
        self,
        large_chars: int,
        workers: int = 4,
        large_workers: int = 1,
        max_large: int = 16,
        inline_chars: int = INLINE_CHARS,
    ) -> None:
        self.large_chars = large_chars
        self.max_large = max_large
        self.inline_chars = min(inline_chars, large_chars - 1)
        self.num_large = 0
        self.small = ThreadPoolExecutor(workers, thread_name_prefix="pdfleet-tokenize")
        self.large = ThreadPoolExecutor(large_workers, thread_name_prefix="pdfleet-tokenize-large")

    async def run(self, num_chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        if num_chars <= self.inline_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        if num_chars < self.large_chars:
            return await loop.run_in_executor(self.small, fn, *args)
        # The large lane's queue is bounded too: each waiting prompt holds its text.
        if self.num_large >= self.max_large:
            raise APIError(
                f"{self.num_large} large prompts are already being tokenized; retry later",
                status=503,
            )
        self.num_large += 1
        try:
            return await loop.run_in_executor(self.large, fn, *args)
        finally:
            self.num_large -= 1

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters: no token covers more of a prompt.

    Byte-level vocabularies spell each byte as one character, and a prompt has
    at most as many characters as bytes, so a prompt longer than
    ``max_model_len * max_token_chars`` characters cannot fit in the context."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        return 0


@dataclass
class ChatOptions:
    """Server flags that shape chat serving (vLLM's names; docs/tool_calling.md)."""

    chat_template: str | None = None
    """A Jinja chat template (the text; ``contracts.chat_template.load_chat_template``
    reads ``--chat-template``)."""
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    """``--reasoning-parser``: splits thinking from the answer (reasoning_parsers.py)."""


class ServingBase:
    def __init__(
        self,
        engine: AsyncEngine,
        served_names: list[str],
        max_model_len: int,
        lanes: TokenizerLanes | None = None,
        options: ChatOptions | None = None,
        gate: CompileGate | None = None,
    ) -> None:
        self.options = options or ChatOptions()
        self.engine = engine
        self.admission = engine.engine.config.admission_config
        # One gate per engine: the server passes the same one to every endpoint.
        self.gate = gate or CompileGate(lambda: engine.engine.grammars, self.admission)
        self.served_names = served_names
        self.max_model_len = max_model_len
        self.tokenizer = engine.engine.tokenizer
        self.defaults = dict(engine.engine.default_sampling)
        self.vocab_size = engine.engine.config.model_config.vocab_size
        self.policy = engine.engine.config.scheduler_config.policy
        # The configured bound (-1: none) as the checks read it, and as a count.
        self.logprobs_bound = engine.engine.config.model_config.max_logprobs
        self.max_logprobs = self.vocab_size if self.logprobs_bound == -1 else self.logprobs_bound
        self.lanes = lanes or TokenizerLanes(large_chars=1 << 16)
        per_token = max_token_chars(self.tokenizer) if self.tokenizer is not None else 0
        # No prompt with more characters than this fits in max_model_len tokens (0: unknown).
        self.max_prompt_chars = max_model_len * per_token

    # -- checks -------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model a request names: a served name of the base model, or a
        loaded LoRA adapter's name (None: the base model)."""
        if model is None or model in self.served_names:
            return self.served_names[0]
        if self.engine.engine.resolve_lora(model) is not None:
            return model
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model")

    def lora_of(self, model: str) -> str | None:
        """The adapter ``model`` (a checked name) runs with; None for the base model."""
        return None if model in self.served_names else model

    def check_sampling(self, req: Any) -> None:
        """Every sampling field against the model, before anything is tokenized."""
        if getattr(req, "priority", 0) and self.policy != "priority":
            raise APIError(
                f"priority {req.priority} needs --scheduling-policy priority (this engine "
                f"schedules {self.policy}); send 0 or leave it out",
                param="priority",
            )
        try:
            check_sampling(
                req.model_dump(exclude_none=True),
                vocab_size=self.vocab_size,
                max_logprobs=self.logprobs_bound,
                max_n=self.admission.max_n,
                max_output_tokens=self.admission.max_request_output_tokens,
            )
        except ValueError as e:
            # The field the message starts with, a nested one by its path
            # (response_format.json_schema.bogus), as the gateway names it.
            m = re.match(r"[a-z_]+(?:[.\[][A-Za-z0-9_\]]+)*", str(e))
            raise APIError(str(e), param=m.group(0).rstrip(".") if m else None) from None

    def check_chars(self, num_chars: int, what: str) -> None:
        """Refuse, before tokenizing, a prompt too long to fit whatever its tokens."""
        if self.max_prompt_chars and num_chars > self.max_prompt_chars:
            raise APIError(
                f"the {what} has {num_chars} characters, more than {self.max_model_len} tokens "
                f"(this model's maximum context length) can hold; shorten it",
                param=what,
            )

    def resumed_text(self, prompt_ids: list[int], params: SamplingParams) -> str:
        """The text a migrated request's sent tokens put before the client: the
        output processor's replay of them (the same detokenizer and stop-string
        holdback the first engine ran), up to what it had handed out."""
        try:
            child = ChildState(0, params, prompt_ids, self._need_tokenizer())
        except ValueError as e:  # (the sent tokens already hold a stop string)
            raise APIError(str(e), param="migration.output_token_ids") from None
        return child.visible_text()[: child.sent_text]

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(
                "this server has no tokenizer (--skip-tokenizer-init): pass token ids",
                param="prompt",
            )
        return self.tokenizer

    def truncate(self, ids: list[int], keep: int | None, side: str | None) -> list[int]:
        """``truncate_prompt_tokens``: the last ``keep`` tokens (``side`` left, the
        default) or the first (right); -1 keeps what the context holds."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise APIError(
                f"truncate_prompt_tokens ({keep}) must be <= max_model_len "
                f"({self.max_model_len}), or -1",
                param="truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        return ids[:keep] if side == "right" else ids[len(ids) - keep :]

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids: list[int] = self._need_tokenizer()(
                prompt, add_special_tokens=add_special_tokens
            ).input_ids
            return ids
        return list(prompt)

    def check_output_tokens(self, req: Any, max_tokens: list[int]) -> None:
        """``n × max_tokens`` as resolved (one entry per prompt) within the
        server's bound; a 400 naming the length field otherwise."""
        name = (
            "max_completion_tokens"
            if getattr(req, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        try:
            check_output_tokens(
                num_sequences(req.model_dump(include={"n", "best_of"}, exclude_none=True)),
                max_tokens,
                self.admission.max_request_output_tokens,
                name,
            )
        except ValueError as e:
            raise APIError(str(e), param=name) from None

    async def compile_constraint(
        self, spec: StructuredOutputsParams | None, param: str | None = None, caller: str = ""
    ) -> StructuredOutputsParams | None:
        """Compile (or find cached) the request's grammar before admission, off the
        event loop and the engine thread, under the per-caller bounds
        (``grammar_gate.py``), so a bad or too costly constraint is a 4xx."""
        if spec is None:
            return None
        try:
            await self.gate.compile(spec, caller or "anonymous")
        except (GrammarTooLarge, GrammarTimeout) as e:
            raise APIError(f"{param}: {e}" if param else str(e), param=param) from None
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        except CompileBusy as e:
            raise APIError(str(e), status=e.status, param=param) from None
        return spec

    def apply_chat_template(self, req: ChatCompletionRequest | Any) -> tuple[str, list[int]]:
        tok = self._need_tokenizer()
        messages = [m.template_dict() for m in req.messages]
        extra: dict[str, Any] = {}
        kwargs = getattr(req, "chat_template_kwargs", None) or {}
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(
                f"chat_template_kwargs: {reserved[0]} is an argument of the template call, "
                "not a template variable (request fields set it, or the server does)",
                param="chat_template_kwargs",
            )
        extra.update(kwargs)
        if getattr(req, "documents", None):
            extra["documents"] = req.documents
        if getattr(req, "tools", None):
            extra["tools"] = req.tools
        if self.options.chat_template is not None:
            extra["chat_template"] = self.options.chat_template
        try:
            text = tok.apply_chat_template(
                messages,
                **extra,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt
                and not getattr(req, "continue_final_message", False),
                continue_final_message=getattr(req, "continue_final_message", False),
            )
        except Exception as e:  # a template that rejects the conversation is bad input
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
        add_special = bool(getattr(req, "add_special_tokens", False))
        return text, tok(text, add_special_tokens=add_special).input_ids

    async def tokenize_prompts(
        self, prompts: list[str | list[int]], bounded: bool = True, add_special_tokens: bool = True
    ) -> list[tuple[str | None, list[int]]]:
        """(text, ids) per prompt, tokenized in the lane its size calls for.

        ``bounded``: refuse, before any tokenizing, a prompt whose characters
        cannot fit in the context."""
        if bounded:
            for p in prompts:
                if isinstance(p, str):
                    self.check_chars(len(p), "prompt")
        out: list[tuple[str | None, list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, await self.lanes.run(len(p), self.tokenize, p, add_special_tokens)))
            else:
                out.append((None, list(p)))
        return out

    async def chat_prompt(self, req: Any, bounded: bool = True) -> tuple[str, list[int]]:
        """The templated conversation and its ids (bounded and laned as prompts are)."""
        num_chars = sum(len(m.text()) for m in req.messages)
        if bounded:
            self.check_chars(num_chars, "messages")
        return await self.lanes.run(num_chars, self.apply_chat_template, req)

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
        # The generation config's max_new_tokens (or --override-generation-config's)
        # caps the output like the context does: the smallest bound wins, whether
        # or not the request names its own.
        default = self.defaults.get("max_tokens")
        if max_tokens is None:
            left = self.max_model_len - n
            return min(left, default) if isinstance(default, int) and default > 0 else left
        if max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the "
                "completion). Please reduce the length of the input or completion.",
                param="max_tokens",
            )
        return min(max_tokens, default) if isinstance(default, int) and default > 0 else max_tokens

    def check_logprobs(self, k: int | None, param: str) -> int | None:
        """The number of logprobs ``k`` asks for (-1: the whole vocabulary), within
        the engine's max_logprobs."""
        if k is None:
            return None
        if k == -1:
            if self.vocab_size > self.max_logprobs:
                # Worded as the shared sampling checks word it (the gateway's too).
                raise APIError(
                    f"{param}: -1 asks for the whole vocabulary ({self.vocab_size} tokens), "
                    f"more than the engine's max_logprobs ({self.max_logprobs}); ask for at "
                    f"most {self.max_logprobs} or serve with --max-logprobs -1",
                    param=param,
                )
            return self.vocab_size
        if not 0 <= k <= self.max_logprobs:
            raise APIError(
                f"{param} must be -1 or an integer 0..{self.max_logprobs} (the engine's "
                f"max_logprobs is {self.max_logprobs}), got {k}",
                param=param,
            )
        return k

    # -- running ------------------------------------------------------------------

    async def admit(
        self,
        request_id: str,
        jobs: list[Job],
        priority: int,
        kv_params: dict[str, Any] | None,
        lora: str | None = None,
        whole: bool = False,
    ) -> list[RequestStream]:
        """One engine request per job, all admitted or none (a refusal closes the rest).

        Called before a response starts, so a refusal (bad kv_transfer_params
        included) is an HTTP error even for a streamed request. ``whole``: the
        answer goes out whole (not streamed), so each stream yields one output
        at its end instead of a delta per step (unless tracing is on)."""
        streams: list[RequestStream] = []
        try:
            for j, (text, ids, params) in enumerate(jobs):
                rid = f"{request_id}-{j}" if len(jobs) > 1 else request_id
                stream = await self.engine.add_request(
                    rid,
                    ids,
                    params,
                    prompt_text=text,
                    priority=priority,
                    kv_transfer_params=kv_params,
                    # A batch's prompts share one group's share of the engine.
                    group=request_id if len(jobs) > 1 else None,
                    lora_name=lora,
                    # Traced, a request keeps its deltas: an aborted one's engine
                    # spans are built from the last output it had.
                    final=whole and not tracing.enabled(),
                )
                # The engine accepted (decoded) them: they decode here too.
                leg = KVTransferParams.from_wire(kv_params) if kv_params else None
                streams.append(tracing.trace_request(stream, rid, leg))
        except BaseException as e:
            for stream in streams:
                stream.close()
            error = api_error(e) if isinstance(e, Exception) else None
            if error is None:
                raise
            raise error from None
        return streams

    @staticmethod
    async def outputs(stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """A request's outputs, its engine-side failures as APIErrors."""
        try:
            async for out in stream:
                yield out
        except Exception as e:
            error = api_error(e)
            if error is None:
                raise
            raise error from None
        finally:
            stream.close()

    @staticmethod
    async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
        """Interleave several async iterators, tagging items with their index."""
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
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
    def _token_str(lp: Logprob, tid: int, as_ids: bool = False) -> str:
        """A token as logprobs name it: its text, or ``token_id:N`` (with
        ``return_tokens_as_token_ids``, or when it has no text)."""
        if as_ids or lp.decoded_token is None:
            return f"token_id:{tid}"
        return lp.decoded_token

    @staticmethod
    def prompt_logprobs_body(
        ids: list[int], entries: list[dict[int, Logprob] | None] | None, k: int, as_ids: bool
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its
        own logprob and the ``k`` most likely, keyed by token id."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = []
        for tid, entry in zip(ids, entries, strict=False):
            if entry is None:
                out.append(None)
                continue
            keep = {t: x for t, x in entry.items() if t == tid or (x.rank or 0) <= k}
            out.append(
                {
                    str(t): {
                        "logprob": x.logprob,
                        "rank": x.rank,
                        "decoded_token": f"token_id:{t}" if as_ids else x.decoded_token,
                    }
                    for t, x in keep.items()
                }
            )
        return out

    @staticmethod
    def usage_so_far(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return ServingBase._usage(
            {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "cached": cached,
            }
        )

    @classmethod
    def response_body(
        cls,
        kind: str,
        response_id: str,
        model: str,
        choices: list[dict[str, Any]],
        usage: dict[str, int],
        kv_out: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """A whole (not streamed) response: OpenAI's envelope, ``kind`` its
        ``object``, plus the producer's ``kv_transfer_params`` when there are any."""
        body = {
            "id": response_id,
            "object": kind,
            "created": now(),
            "model": model,
            "choices": choices,
            "usage": cls._usage(usage),
        }
        if kv_out is not None:
            body[KV_PARAMS] = kv_out
        return body

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
