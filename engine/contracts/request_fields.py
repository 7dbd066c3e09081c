"""The request fields of the OpenAI routes: which ones pdfleet serves, which it
refuses by name, and the one check that engines and the gateway both run.

A field a client sends is never accepted and ignored. Each field of vLLM's
completion, chat and tokenize requests (and the OpenAI fields vLLM knows) is
in exactly one table here:

* ``WORKS``: implemented with vLLM's semantics on the routes listed;
* ``REFUSED``: not implemented; a request that sets it to anything but its
  no-op value (``None``, ``False``, vLLM's default) is a 400 naming it.

A field in neither table (a typo, another server's extension) is a 400
naming it too. ``docs/serving.md`` lists the tables with the tests that prove
each row; ``tests/conformance/test_fields.py`` fails when a field of the
request models, or of vLLM's APIs, is missing from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
ROUTES = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)

_GEN = frozenset((COMPLETIONS, CHAT))
_C = frozenset((COMPLETIONS,))
_CH = frozenset((CHAT,))

# field -> the routes where it works.
WORKS: dict[str, frozenset[str]] = {
    # What both generation routes share (OpenAI's fields and vLLM's extensions).
    **{
        name: _GEN
        for name in (
            "model",
            "n",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "ignore_eos",
            "min_tokens",
            "max_tokens",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "stream",
            "stream_options",
            "user",
            "priority",
            "request_id",
            "kv_transfer_params",
            # pdfleet's own, internal: a decode leg the gateway can migrate.
            "migration",
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "structured_outputs",
            "logprobs",
            "prompt_logprobs",
            "echo",
            "add_special_tokens",
            "truncate_prompt_tokens",
            "truncation_side",
            "return_token_ids",
            "return_tokens_as_token_ids",
            "cache_salt",
        )
    },
    # Completions only.
    "prompt": frozenset((COMPLETIONS, TOKENIZE)),
    # Chat only.
    **{
        name: _CH
        for name in (
            "max_completion_tokens",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "documents",
            "return_prompt_text",
            "include_reasoning",
        )
    },
    "messages": frozenset((CHAT, TOKENIZE)),
    "add_generation_prompt": frozenset((CHAT, TOKENIZE)),
    "continue_final_message": frozenset((CHAT, TOKENIZE)),
    "chat_template_kwargs": frozenset((CHAT, TOKENIZE)),
    "return_token_strs": frozenset((TOKENIZE,)),
    "tokens": frozenset((DETOKENIZE,)),
}
WORKS["model"] = frozenset(ROUTES)
WORKS["add_special_tokens"] = frozenset((COMPLETIONS, CHAT, TOKENIZE))
WORKS["tools"] = frozenset((CHAT, TOKENIZE))

# What makes a refused field harmless: its value is one of these. A list
# field's empty list asks for nothing too (``functions: []``, no functions),
# except where vLLM gives ``[]`` a meaning (``allowed_token_ids: []`` would
# allow no token: vLLM refuses it, and so is it refused here).
_NONE: tuple[Any, ...] = (None,)
_OFF: tuple[Any, ...] = (None, False)


def _values(*inert: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    return lambda value, body: any(value is x or (x is not None and value == x) for x in inert)


def _best_of_is_n(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == body.get("n", 1)


def _empty(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == "" or value == [] or value == {}


# field -> (is its value a no-op, why it is refused): the routes it is refused on
# are the generation routes (and tokenize for the chat-template fields).
REFUSED: dict[str, tuple[Callable[[Any, Mapping[str, Any]], bool], str]] = {
    # vLLM's sampling extensions pdfleet's sampler does not implement.
    "use_beam_search": (_values(*_OFF), "beam search is not implemented; use n"),
    "length_penalty": (_values(None, 1, 1.0), "it applies to beam search, not implemented"),
    "best_of": (_best_of_is_n, "use n (best_of must equal n)"),
    "allowed_token_ids": (_values(*_NONE), "use logit_bias"),
    "bad_words": (_empty, "use logit_bias or stop"),
    "logprob_token_ids": (_values(None, []), "use logprobs / top_logprobs"),
    "watermarking": (_values(*_OFF), "watermarking is not implemented"),
    "repetition_detection": (_values(*_NONE), "use repetition_penalty or stop"),
    "stream_interval": (_values(None, 1), "streams send every step's tokens"),
    "min_characters": (_values(None, 0), "use min_tokens"),
    "suffix": (_empty, "fill-in-the-middle is not implemented"),
    "guided_whitespace_pattern": (_values(*_NONE), "the JSON grammar's whitespace is fixed"),
    # Inputs pdfleet does not take.
    "prompt_embeds": (_empty, "send token ids or text"),
    "mm_processor_kwargs": (_empty, "pdfleet serves text models"),
    "media_io_kwargs": (_empty, "pdfleet serves text models"),
    "chat_template": (
        _values(*_NONE),
        "a request may not bring its own template (the server's --chat-template is used)",
    ),
    # Reasoning controls (the reasoning parsers split thinking; these would steer it).
    "reasoning_effort": (_values(*_NONE), "use chat_template_kwargs (e.g. enable_thinking)"),
    "thinking_token_budget": (_values(None, -1), "reasoning length is bounded by max_tokens"),
    # Extensions of vLLM's server that pdfleet does not serve.
    "session_id": (_values(*_NONE), "route by prefix instead (the gateway does)"),
    "ec_transfer_params": (_values(*_NONE), "no encoder-cache transfer"),
    "vllm_xargs": (_empty, "no custom request extensions"),
    "routed_experts_prompt_start": (_values(None, 0), "routed-expert data is not returned"),
    "return_token_offsets": (_values(*_OFF), "renders return token ids, not offsets"),
    "return_mm_kwargs": (_values(None, True), "pdfleet serves text models"),
    # What vLLM's router (vllm-router) adds to every body it forwards, at these
    # no-op defaults.
    "no_stop_trim": (_values(*_OFF), "use include_stop_str_in_output"),
    "separate_reasoning": (_values(None, True), "use include_reasoning"),
    "stream_reasoning": (_values(None, True), "reasoning is streamed as it comes"),
    "return_hidden_states": (_values(*_OFF), "hidden states are not returned"),
    # OpenAI fields (of its hosted service) with no meaning here.
    "store": (_values(*_OFF), "responses are not stored"),
    "metadata": (_empty, "responses are not stored"),
    "service_tier": (_values(None, "auto", "default"), "one service tier"),
    "modalities": (_values(None, ["text"]), "text output only"),
    "audio": (_values(*_NONE), "text output only"),
    "prediction": (_values(*_NONE), "predicted outputs are not implemented"),
    "web_search_options": (_values(*_NONE), "no web search"),
    "functions": (_values(None, []), "deprecated by OpenAI: use tools"),
    "function_call": (_values(*_NONE), "deprecated by OpenAI: use tool_choice"),
    "verbosity": (_values(*_NONE), "no verbosity control"),
    "prompt_cache_key": (_values(*_NONE), "use cache_salt to separate prefix caches"),
    "safety_identifier": (_values(*_NONE), "no safety service (user is logged)"),
}

# The fields vLLM's request models declare (read from its OpenAI server), per
# route: a test checks that each is in WORKS or REFUSED.
VLLM_FIELDS: dict[str, list[str]] = {
    COMPLETIONS: [
        "model",
        "prompt",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "watermarking",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
        "allowed_token_ids",
        "prompt_logprobs",
        "logprob_token_ids",
        "bad_words",
        "prompt_embeds",
        "add_special_tokens",
        "response_format",
        "structured_outputs",
        "priority",
        "request_id",
        "session_id",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "routed_experts_prompt_start",
        "return_token_offsets",
        "return_mm_kwargs",
        "cache_salt",
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "repetition_detection",
        "thinking_token_budget",
        "stream_interval",
        "best_of",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    ],
    CHAT: [
        "messages",
        "model",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "reasoning_effort",
        "thinking_token_budget",
        "include_reasoning",
        "parallel_tool_calls",
        "user",
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "watermarking",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
        "prompt_logprobs",
        "logprob_token_ids",
        "allowed_token_ids",
        "bad_words",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "structured_outputs",
        "priority",
        "request_id",
        "session_id",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "routed_experts_prompt_start",
        "return_token_offsets",
        "return_prompt_text",
        "return_mm_kwargs",
        "cache_salt",
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "repetition_detection",
        "stream_interval",
        "best_of",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "store",
        "metadata",
        "service_tier",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
        "verbosity",
        "prompt_cache_key",
        "safety_identifier",
    ],
    TOKENIZE: [
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_strs",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "tools",
    ],
    DETOKENIZE: ["model", "tokens"],
}


def refused_reason(name: str, value: Any, body: Mapping[str, Any]) -> str | None:
    """Why ``name: value`` is refused (None: it is not, or it is a no-op value)."""
    entry = REFUSED.get(name)
    if entry is None:
        return None
    inert, why = entry
    return None if inert(value, body) else why


def check_fields(body: Mapping[str, Any], route: str) -> None:
    """``ValueError`` naming the first field of ``body`` that ``route`` does not
    serve: refused (set to something other than its no-op value) or unknown.

    The message starts with the field's name (the 400's ``param``)."""
    for name, value in body.items():
        routes = WORKS.get(name)
        if routes is not None and route in routes:
            continue
        if name in REFUSED:
            why = refused_reason(name, value, body)
            if why is None:
                continue
            raise ValueError(f"{name} is not supported by pdfleet ({why})")
        where = sorted(routes) if routes else []
        hint = f"; it is a field of {', '.join(where)}" if where else ""
        raise ValueError(f"{name} is not a field of this request ({route}{hint})")


# Arguments of the chat template call, not variables of the template: request
# fields set some, the others shape tokenizing, which the server does itself.
# A request's chat_template_kwargs may name none of them (the template would
# never see it).
RESERVED_TEMPLATE_KWARGS = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)
