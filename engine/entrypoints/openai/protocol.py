"""OpenAI API request schemas and error bodies (the fields pdfleet serves)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    field_validator,
    model_validator,
)

from ...contracts import request_fields
from ...contracts.chat_template import template_message
from ...contracts.errors import ErrorBody
from ...contracts.migration import MigrationState, MigrationStateError
from ...sampling_params import SamplingParams, StructuredOutputsParams, json_schema_text


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class APIError(Exception):
    """An error with an HTTP status, answered as OpenAI's error body
    (engine/contracts/errors.py: the gateway's too)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorBody(self.message, self.status, self.param).to_dict()


def check_text(body: Any) -> Any:
    """Refuse strings the tokenizer cannot encode (lone UTF-16 surrogates such as
    ``"\\ud800"``, which JSON allows), naming the top-level field holding one."""
    if not isinstance(body, dict):
        return body
    for name, value in body.items():
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(
                        f"{name}: the text holds a lone surrogate (an unpaired \\ud800-\\udfff "
                        "escape), which is not valid Unicode",
                        param=str(name),
                    ) from None
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
    return body


class _Checked(BaseModel):
    """A request body whose every string is valid Unicode and whose every field
    is served by its route (``contracts/request_fields.py``: a field pdfleet
    does not implement is a 400 naming it, never ignored)."""

    # The route whose fields the body may hold (request_fields.ROUTES).
    route: ClassVar[str] = ""
    # Fields whose explicit ``null`` means their default (vLLM types them
    # Optional with a default): the null is dropped before validation.
    null_is_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        data = check_text(data)
        if isinstance(data, dict) and cls.route:
            try:
                request_fields.check_fields(data, cls.route)
            except ValueError as e:
                raise APIError(str(e), param=str(e).split(" ")[0]) from None
        if isinstance(data, dict) and cls.null_is_default:
            data = {k: v for k, v in data.items() if not (v is None and k in cls.null_is_default)}
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _migration_state(raw: Any) -> MigrationState | None:
    """The ``migration`` field (an internal field: only from the fleet token or
    an internal key; docs/migration.md), decoded by its one carrier
    (``contracts/migration.py``). Its presence asks for a stream the gateway
    can move: each event that carries output tokens starts with an SSE comment
    ``: ids ID ID...`` (clients never see it: the gateway takes it off), and a
    draining engine ends the stream with ``: migrate`` instead of an error. A
    malformed state is a 400 naming the field (``migration.output_token_ids``,
    ...); ``resume_identity`` of another engine is refused by the server."""
    if raw is None or isinstance(raw, MigrationState):
        return raw
    try:
        return MigrationState.from_json(raw)
    except MigrationStateError as e:
        raise APIError(str(e), param=e.param) from None


MigrationField = Annotated[
    MigrationState | None,
    PlainValidator(_migration_state),
    PlainSerializer(lambda m: None if m is None else m.to_json()),
]


class _Sampling(_Checked):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    migration: MigrationField = None
    # Output constraints (docs/structured_outputs.md): OpenAI's response_format,
    # vLLM's guided_* fields and its newer structured_outputs object.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The one backend there is: "xgrammar" (or "auto", or unset); another is a 400.
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Checked (and each bias clamped to [-100, 100]) by the shared sampling
    # checks, so the engine and the gateway word a bad key or value alike.
    logit_bias: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool = True
    # Keep only this many prompt tokens (-1: as many as the context holds), cut
    # from ``truncation_side`` (default left: the prompt's end is kept).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # The response's id (as X-Request-Id does); never an engine key.
    request_id: str | None = Field(default=None, max_length=256)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # A prefix-cache namespace: requests with different salts share no KV.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Who the request is for (set by the server from its credential, never from
    # the body): per-caller bounds count against it (entrypoints/caller.py).
    _caller: str = PrivateAttr(default="anonymous")

    @property
    def caller(self) -> str:
        return self._caller

    def for_caller(self, caller: str) -> None:
        """Mutates: the request is for ``caller``."""
        self._caller = caller

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise APIError(
                f"guided_decoding_backend must be xgrammar or auto (the one backend), got "
                f"{self.guided_decoding_backend!r}",
                param="guided_decoding_backend",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )

    def constraint_field(self) -> str | None:
        """The request field that carries its output constraint (None: none)."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs" if self.structured_outputs is not None else None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The request's output constraint (shapes were checked by check_structured)."""
        rf = self.response_format or {}
        try:
            if rf.get("type") == "json_schema":
                return StructuredOutputsParams(json=rf["json_schema"]["schema"])
            if rf.get("type") == "json_object":
                return StructuredOutputsParams(json_object=True)
            if self.guided_json is not None:
                return StructuredOutputsParams(json=json_schema_text(self.guided_json))
            if self.guided_regex is not None:
                return StructuredOutputsParams(regex=self.guided_regex)
            if self.guided_choice is not None:
                return StructuredOutputsParams(choice=tuple(self.guided_choice))
            if self.guided_grammar is not None:
                return StructuredOutputsParams(grammar=self.guided_grammar)
            if self.structured_outputs is not None:
                so = self.structured_outputs
                return StructuredOutputsParams(
                    json=so.get("json"),
                    regex=so.get("regex"),
                    choice=so.get("choice"),
                    grammar=so.get("grammar"),
                    json_object=bool(so.get("json_object")),
                )
        except ValueError as e:
            raise APIError(str(e), param="structured_outputs") from None
        return None

    def stop_list(self) -> list[str]:
        """``stop`` as a list (one string is a list of one; "" and null are none)."""
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return list(self.stop or [])

    def sampling_params(
        self,
        defaults: dict[str, Any],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        m = self.migration
        if m is not None and m.output_token_ids is not None and self.n != 1:
            raise APIError(
                "migration.output_token_ids: a request of n > 1 resumes by migration.choices",
                param="migration.output_token_ids",
            )
        if m is not None and m.choices is not None and not self.stream:
            # A non-streamed answer sent nothing before it failed: it goes again whole.
            raise APIError(
                "migration.choices: only a stream resumes its choices", param="migration.choices"
            )
        values: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        try:
            return SamplingParams(
                n=self.n,
                seed=self.seed,
                stop=self.stop_list(),
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logit_bias=[(int(t), b) for t, b in (self.logit_bias or {}).items()] or None,
                cache_salt=self.cache_salt,
                resumed_token_ids=list(self.migration.sent) if self.migration else [],
                **values,
            )
        except ValueError as e:
            field = str(e).split(" ")[0].rstrip(":")  # ("field: why" names the field too)
            raise APIError(str(e), param=field) from None


class CompletionRequest(_Sampling):
    null_is_default: ClassVar[frozenset[str]] = frozenset({"stream", "echo"})
    route: ClassVar[str] = request_fields.COMPLETIONS
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        # The field's type admits no mixed list: all token ids, or all prompts.
        ids = [x for x in p if isinstance(x, int)]
        if ids:
            return [ids]
        return [x for x in p if not isinstance(x, int)]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # A key no message type has is refused by its path (messages.0.key), never
    # ignored. The keys the official clients send (an assistant message sent back
    # as the response gave it included) are declared: those with no effect here
    # pass only at their empty value.
    model_config = ConfigDict(extra="forbid")
    # OpenAI's roles (system, developer, user, assistant, tool) or any other the
    # chat template renders (vLLM passes custom roles to the template as they are).
    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An earlier turn's thinking (our responses' reasoning / reasoning_content):
    # reaches the template as reasoning_content (Qwen3's templates read it).
    reasoning: str | None = None
    reasoning_content: str | None = None
    # Output-only fields of an assistant message sent back as it came: no effect
    # here, so only their empty values pass.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (``template_message``: the
        gateway builds it alike)."""
        try:
            return template_message(
                self.role,
                self.text(),
                name=self.name,
                tool_call_id=self.tool_call_id,
                reasoning_content=self.reasoning_content,
                reasoning=self.reasoning,
                tool_calls=[
                    (c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()
                ],
            )
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"message content of type {part.type!r} is not supported (text only)",
                    param="messages",
                )
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    route: ClassVar[str] = request_fields.CHAT
    null_is_default: ClassVar[frozenset[str]] = frozenset(
        {"n", "stream", "logprobs", "parallel_tool_calls"}
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # On top of what the chat template adds (vLLM's default: nothing more).
    add_special_tokens: bool = False
    # Passed to the chat template as it is (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # The template's RAG documents (templates without them ignore them, as vLLM's).
    documents: list[dict[str, str]] | None = None
    return_prompt_text: bool | None = None
    # With --reasoning-parser: return the reasoning (false: the answer alone).
    include_reasoning: bool = True

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class TokenizeRequest(_Checked):
    route: ClassVar[str] = request_fields.TOKENIZE
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template adds them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Checked):
    route: ClassVar[str] = request_fields.DETOKENIZE
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
