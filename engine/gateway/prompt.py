"""What routing needs to know about a prompt: its length and its leading blocks.

With ``--tokenizer DIR`` the model's tokenizer (``tokenizer.json`` through the
``tokenizers`` library, and the chat template through jinja2, as the engine
renders it: the directory's, or the engines' ``--chat-template`` given to the
gateway too) counts tokens and cuts blocks of ``block_size`` tokens, so block
hashes line up with the engines' prefix-cache blocks (exactly within a
bounded head of the prompt, see ``PromptAnalyzer``). Without it tokens are
estimated (``_text_tokens``: a digit or a character beyond ASCII a token,
``CHARS_PER_TOKEN`` other characters a token) and blocks are cut every
``block_size × 4`` characters.
Prompts given as token ids are always exact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from ..contracts.chat_template import CHAT_TEMPLATE_FLAG, load_chat_template, template_message
from ..contracts.request_fields import RESERVED_TEMPLATE_KWARGS

logger = logging.getLogger("pdfleet.gateway")

CHARS_PER_TOKEN = 4


@dataclass
class PromptInfo:
    num_tokens: int
    """Prompt length in tokens (estimated without a tokenizer)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the leading full blocks: hash i covers blocks 0..i."""
    batch: bool = False
    """A completions request with several prompts (routed by the first)."""
    exact_hashes: list[int] | None = None
    """The leading full blocks' ids exactly as the engines' KV events name them
    (docs/kv_events.md), when the prompt's token ids are known (a tokenizer, or
    token ids given) and the exact prefix index is on; else None."""
    prompt_logprobs: bool = False
    """The request asks for the prompt's logprobs (``needs_prompt_logprobs``):
    one engine computes the whole prompt, so it is never split into legs."""
    adapter: str | None = None
    """The LoRA adapter the request names (None: the base model)."""
    analyzed: bool = True
    """False for a request routed without looking at its prompt (one engine
    could serve it: ``Proxy``'s single-engine route); whatever needs the
    prompt later (a failover among several engines) analyzes it then."""


def needs_prompt_logprobs(body: dict[str, Any], chat: bool) -> bool:
    """Whether the answer holds the prompt's logprobs: a completion with ``echo``
    and ``logprobs``, or vLLM's ``prompt_logprobs`` field (either endpoint).

    A decode engine that receives the prompt's KV computes only the last
    prompt token, so only the engine that computes the whole prompt has its
    logprobs: such a request runs on one engine."""
    if body.get("prompt_logprobs") is not None:
        return True
    return not chat and bool(body.get("echo")) and body.get("logprobs") is not None


def chain_hashes(items: list[Any] | str, block: int, max_blocks: int) -> list[int]:
    """Hashes of the first full blocks of ``items``; each folds in its
    predecessor, so equal hashes mean equal prefixes (up to collisions, which
    only cost a routing preference, never correctness)."""
    out: list[int] = []
    h = 0
    for start in range(0, min(len(items), block * max_blocks) - block + 1, block):
        chunk = items[start : start + block]
        h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
        out.append(h)
    return out


class Tokenizer:
    """The model's tokenizer and chat template, without transformers or torch."""

    def __init__(self, directory: str, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {directory}: no tokenizer.json in that directory")
        self.tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        given = load_chat_template(chat_template)
        sources, named = _model_templates(path, config)
        if given is not None:
            # The engine's --chat-template: transformers renders every request
            # with it, whatever templates the model names (tool_use included),
            # unless its whole text is the name of one of them.
            given = sources[given] if named and given in sources else given
            sources = {"default": given}
        # The special tokens the template sees (special_tokens_map.json over
        # the config's, as the engine's tokenizer reads them).
        # Named extra special tokens (``extra_special_tokens`` as a mapping,
        # such as a multimodal model's ``image_token``) are template variables
        # too.
        tokens: dict[str, Any] = {k: config[k] for k in _SPECIAL_TOKENS if config.get(k)}
        extra_named = config.get("extra_special_tokens")
        if isinstance(extra_named, dict):
            tokens.update({str(k): v for k, v in extra_named.items() if v})
        if (path / "special_tokens_map.json").is_file():
            mapped = json.loads((path / "special_tokens_map.json").read_text())
            tokens.update({k: mapped[k] for k in _SPECIAL_TOKENS if mapped.get(k)})
        self.special = {
            k: (v.get("content") if isinstance(v, dict) else v) for k, v in tokens.items()
        }
        self.templates: dict[str, Any] = {}
        self.sources = sources
        if sources:
            env = _template_environment()
            if given is not None:
                self.templates = {"default": _compiled_chat_template(env, given)}
            else:
                self.templates = {name: env.from_string(text) for name, text in sources.items()}

    def template_name(self, tools: bool) -> str | None:
        """The name of the template the engine renders a request with (None:
        none): of several, the ``tool_use`` one for a request with tools, else
        the ``default`` one."""
        if len(self.templates) <= 1:
            return next(iter(self.templates), None)
        if tools and "tool_use" in self.templates:
            return "tool_use"
        return "default" if "default" in self.templates else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def chat_text(self, messages: list[dict[str, Any]], inputs: dict[str, Any]) -> str | None:
        """The conversation as the engine renders it (None without a template).
        ``inputs``: the request's other template inputs (``template_inputs``)."""
        name = self.template_name(inputs.get("tools") is not None)
        if name is None:
            return None
        template = self.templates[name]
        inputs = dict(inputs)
        final: str | None = None
        if inputs.pop("continue_final_message", False):
            # As transformers continues the last message: its text marked at
            # the end, the rendering cut at the mark (what the template adds
            # after it is dropped). It refuses a last message without text, and
            # a template that never reads ``content``.
            last = messages[-1] if messages else {}
            final = last.get("content")
            if not isinstance(final, str) or "content" not in self.sources[name]:
                return None
            messages = [*messages[:-1], {**last, "content": final + CONTINUE_MARK}]
        try:
            text = str(
                template.render(
                    {"tools": None, "documents": None, **self.special, **inputs}, messages=messages
                )
            )
        except Exception:  # the engine will reject a conversation its template rejects
            return None
        if final is not None:
            mark = CONTINUE_MARK.strip()
            if final.strip() not in text or mark not in text:
                return None  # the template dropped the message: the engine refuses it
            at = text.rindex(mark)
            # A template that trims the message's end trimmed the mark's space.
            text = text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()
        return text


def check_chat_template(value: str | None) -> None:
    """Refuse, with a ValueError naming the flag, a ``--chat-template`` the
    gateway would fail to load: what the engine's loading rule refuses, or a
    template jinja2 cannot compile."""
    text = load_chat_template(value)
    if text is not None:
        _compiled_chat_template(_template_environment(), text)


def _compiled_chat_template(env: Any, text: str) -> Any:
    from jinja2 import TemplateSyntaxError

    try:
        return env.from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(
            f"{CHAT_TEMPLATE_FLAG}: not a template jinja2 can compile: {e} (line {e.lineno})"
        ) from None
    except (RecursionError, MemoryError, ValueError) as e:  # nested past the parser's depth
        raise ValueError(
            f"{CHAT_TEMPLATE_FLAG}: not a template jinja2 can compile: {type(e).__name__}"
        ) from None


def _template_environment() -> Any:
    """jinja2 set up as transformers renders chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _generation_extension()],
    )

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    # Templates render tools and tool call arguments as JSON: plain JSON, as
    # the engine's templating writes it (jinja's own filter escapes HTML
    # characters).
    env.filters["tojson"] = _tojson
    return env


def _model_templates(path: Path, config: dict[str, Any]) -> tuple[dict[str, str], bool]:
    """The model directory's templates by name, as the engine's tokenizer
    loads them: files first (chat_template.jinja the default,
    additional_chat_templates/NAME.jinja), else the config's one template or
    its named list; and whether they are a named set (a given template may
    name one of them)."""
    sources: dict[str, str] = {}
    named = False
    if (path / "chat_template.jinja").is_file():
        sources["default"] = (path / "chat_template.jinja").read_text()
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            sources[f.stem] = f.read_text()
            named = True
    if not sources:
        given = config.get("chat_template")
        if isinstance(given, str):
            sources["default"] = given
        elif isinstance(given, list):
            named = True
            for t in given:
                if isinstance(t, dict) and isinstance(t.get("template"), str):
                    sources[str(t.get("name"))] = t["template"]
    return sources, named


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# The mark transformers puts after the last message's text to continue it
# (``continue_final_message``): the rendering ends where it is found.
CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "

# The special tokens a chat template may name.
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _generation_extension() -> Any:
    """A jinja extension for ``{% generation %}...{% endgeneration %}`` (which
    marks the assistant's tokens for training): the block renders its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja's own attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return Generation


def _as_bool(value: Any) -> bool | None:
    """A boolean field as the engine's request model reads it (``0``,
    ``"false"``, ``"no"`` and the like are false); None for what it refuses."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("0", "off", "f", "false", "n", "no"):
            return False
        if word in ("1", "on", "t", "true", "y", "yes"):
            return True
    return None


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


# Tokens a chat template adds around each message (its role's markers).
MESSAGE_OVERHEAD_TOKENS = 4
# Fields of a chat request that its template renders into the prompt besides
# the messages' text (charged by their JSON's size).
_TEMPLATED_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs", "tool_choice")
# Fields of a message that its template renders besides its content.
_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")


def template_messages(raw: list[Any]) -> list[dict[str, Any]] | None:
    """The messages as the engine's chat template receives them: each built as
    the engine builds it (``template_message``), and an earlier turn's
    reasoning also as ``thinking`` (transformers' templating adds it for
    templates that read it by that name, gpt-oss's). None for a message the
    engine refuses (tool calls that are not a list of functions, arguments
    that are not JSON text)."""
    out: list[dict[str, Any]] = []
    for m in raw:
        if not isinstance(m, dict):
            continue
        calls: list[tuple[Any, Any, str]] = []
        given = m.get("tool_calls")
        if given:
            if not isinstance(given, list):
                return None
            for c in given:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    return None
                arguments = fn.get("arguments", "{}")  # (the engine's default)
                if not isinstance(arguments, str):
                    return None
                calls.append((c.get("id"), fn.get("name"), arguments))
        try:
            msg = template_message(
                str(m.get("role", "")),
                _message_text(m.get("content")),
                name=m.get("name"),
                tool_call_id=m.get("tool_call_id"),
                reasoning_content=m.get("reasoning_content"),
                reasoning=m.get("reasoning"),
                tool_calls=calls,
            )
        except ValueError:
            return None
        if "reasoning_content" in msg:
            msg = {"thinking": msg["reasoning_content"], **msg}
        out.append(msg)
    return out


def template_inputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat template's inputs besides the messages, as the engine passes
    them: ``chat_template_kwargs``, documents, tools and whether to add the
    assistant's turn, or to continue its last message
    (``continue_final_message``, which ``Tokenizer.chat_text`` takes out).
    None where the rendering could not be mirrored (a reserved or malformed
    ``chat_template_kwargs``, fields the engine refuses)."""
    add = _as_bool(body.get("add_generation_prompt", True))
    continuing = _as_bool(body.get("continue_final_message", False))
    kwargs = body.get("chat_template_kwargs") or {}
    if add is None or continuing is None:
        return None
    if not isinstance(kwargs, dict) or set(kwargs) & RESERVED_TEMPLATE_KWARGS:
        return None
    inputs = dict(kwargs)
    for name in ("documents", "tools"):
        if body.get(name):
            inputs[name] = body[name]
    # Continuing the last message, the engine adds no assistant's turn.
    inputs["add_generation_prompt"] = add and not continuing
    if continuing:
        inputs["continue_final_message"] = True
    return inputs


_NO_DIGITS = str.maketrans("", "", "0123456789")


def _text_tokens(text: str) -> int:
    """Tokens of ``text``, estimated: a token a digit (tokenizers split numbers
    into digits or short groups of them), ``CHARS_PER_TOKEN`` other ASCII
    characters a token, a token a character beyond ASCII (about what
    tokenizers give for CJK text; generous for accented Latin)."""
    n = len(text)
    digits = n - len(text.translate(_NO_DIGITS))
    if text.isascii():
        return digits + -(-(n - digits) // CHARS_PER_TOKEN)
    wide = min(n - digits, (len(text.encode("utf-8", "surrogatepass")) - n + 1) // 2)
    return digits + wide + -(-(n - digits - wide) // CHARS_PER_TOKEN)


def _json_text(value: Any) -> str:
    """``value`` as its JSON text ("" for one nested past what JSON encodes:
    the engine refuses such a request)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        return ""


def _json_tokens(value: Any) -> int:
    return _text_tokens(_json_text(value))


def estimated_tokens(body: dict[str, Any]) -> int | None:
    """The prompt's tokens of a request routed without analyzing it, from its
    text (``_text_tokens``; token ids counted as they are): every prompt of a
    completions request; every message's role, text and other rendered fields
    of a chat one, a template's markers per message, and the request's fields
    that its template renders (tools and the like). None when the body holds
    neither in a form this knows."""
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens = 0
        for m in messages:
            tokens += MESSAGE_OVERHEAD_TOKENS
            if isinstance(m, dict):
                tokens += _text_tokens(str(m.get("role", "")) + _message_text(m.get("content")))
                for name in _MESSAGE_FIELDS:
                    if m.get(name):
                        tokens += _json_tokens(m[name])
        for name in _TEMPLATED_FIELDS:
            if body.get(name):
                tokens += _json_tokens(body[name])
        return _kept(tokens, _cap(body))
    prompt = body.get("prompt")
    cap = _cap(body)
    if isinstance(prompt, str):
        return _kept(_text_tokens(prompt), cap)
    if not isinstance(prompt, list):
        return None
    if not any(isinstance(t, str | list) for t in prompt):
        return _kept(len(prompt), cap)  # token ids (or what the engine refuses)
    tokens = 0
    for p in prompt:
        if isinstance(p, str):
            tokens += _kept(_text_tokens(p), cap)
        elif isinstance(p, list):
            tokens += _kept(len(p), cap)
        else:
            return None
    return tokens


def _kept(tokens: int, cap: int | None) -> int:
    return tokens if cap is None else min(tokens, cap)


def _cap(body: dict[str, Any]) -> int | None:
    keep = truncation(body)
    return keep if keep is not None and keep >= 0 else None


def first_prompt_estimate(body: dict[str, Any]) -> int | None:
    """``estimated_tokens`` of a completions batch's first prompt alone."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    return estimated_tokens({**body, "prompt": prompt[0]})


def truncation(body: dict[str, Any]) -> int | None:
    """``truncate_prompt_tokens`` as the engine's request model reads it (an
    integer, a whole float, a boolean or an integer's text); None when unset
    or in a form it refuses."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
        try:
            number = float(value)
        except ValueError:
            return None
        return int(number) if number.is_integer() else None
    return None


def _truncate(info: PromptInfo, keep: int, right: bool, block_size: int) -> None:
    """``truncate_prompt_tokens``: the engine keeps ``keep`` tokens of the
    prompt, its first (``right``) or its last ones. Kept from the start, the
    blocks within them are unchanged; kept from the end, the blocks are
    another prompt's, which the head this looked at cannot tell: none are
    hashed (no engine is preferred for a prefix it does not hold)."""
    info.num_tokens = keep
    full = keep // block_size if right else 0
    info.block_hashes = info.block_hashes[:full]
    if info.exact_hashes is not None:
        info.exact_hashes = info.exact_hashes[:full]


class PromptAnalyzer:
    """Prompt length and block hashes, at a bounded cost per request.

    With a tokenizer only a head of the text is tokenized: enough characters
    for ``max(max_blocks × block_size, min_prompt_tokens)`` tokens and a
    margin at ``MAX_CHARS_PER_TOKEN``; past the head tokens are estimated
    from characters. A 100k-character prompt costs what a 10k one does, and
    every decision the count feeds (the Conditional threshold, the hashed
    blocks) lies inside the exactly counted head.
    """

    HEAD_MARGIN = 16
    """Tokens at the head's cut that may differ from the full text's."""
    MAX_CHARS_PER_TOKEN = 8
    """A generous bound, so the head holds at least the tokens it must."""

    def __init__(
        self,
        tokenizer_dir: str | None,
        max_blocks: int,
        min_prompt_tokens: int = 0,
        exact: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = Tokenizer(tokenizer_dir, chat_template) if tokenizer_dir else None
        self.max_blocks = max_blocks
        self.min_prompt_tokens = min_prompt_tokens
        self.exact = exact
        """Also compute ``exact_hashes`` (the exact prefix index is on)."""
        self.hash_algo = "sha256"
        """The engines' ``prefix_caching_hash_algo`` (the pool sets it from scrapes)."""
        self.lora_identity: Callable[[str], str | None] = lambda name: None
        """A served LoRA adapter's prefix-cache identity by name (None: not an
        adapter); the proxy reads it from the engines' scrapes."""

    def exact_hashes(
        self,
        ids: list[int],
        block_size: int,
        cache_salt: str | None = None,
        lora_identity: str | None = None,
    ) -> list[int] | None:
        """The engine's block ids of the leading ``max_blocks`` full blocks of ``ids``
        (in the request's ``cache_salt`` and LoRA adapter namespace, as the engine
        hashes them)."""
        if not self.exact:
            return None
        digests = prompt_block_hashes(
            ids,
            block_size,
            get_hash_fn(self.hash_algo),
            self.max_blocks,
            cache_salt,
            lora_identity,
        )
        return [external_block_hash(d) for d in digests]

    def _tokenized(
        self,
        text: str,
        special: bool,
        block_size: int,
        salt: str | None = None,
        lora: str | None = None,
    ) -> PromptInfo:
        if self.tokenizer is None:
            raise RuntimeError("broken invariant: self.tokenizer is not None")
        head_tokens = max(self.max_blocks * block_size, self.min_prompt_tokens) + self.HEAD_MARGIN
        head_chars = head_tokens * self.MAX_CHARS_PER_TOKEN
        if len(text) <= head_chars:
            ids = self.tokenizer.encode(text, add_special_tokens=special)
            return PromptInfo(
                len(ids),
                chain_hashes(ids, block_size, self.max_blocks),
                exact_hashes=self.exact_hashes(ids, block_size, salt, lora),
            )
        ids = self.tokenizer.encode(text[:head_chars], add_special_tokens=special)
        # The rest at the head's own characters per token (its kind of text),
        # at least the ASCII estimate's.
        rest_chars = len(text) - head_chars
        rest = max(_text_tokens(text[head_chars:]), -(-rest_chars * len(ids) // head_chars))
        hashed = ids[: -self.HEAD_MARGIN]
        return PromptInfo(
            len(ids) + rest,
            chain_hashes(hashed, block_size, self.max_blocks),
            exact_hashes=self.exact_hashes(hashed, block_size, salt, lora),
        )

    def analyze(self, body: dict[str, Any], chat: bool, block_size: int) -> PromptInfo:
        """Length and block hashes of the request's prompt, and whether it needs
        the prompt's logprobs. Malformed prompts give an empty PromptInfo: the
        engine will answer them with a 400."""
        info = self._analyze(body, chat, block_size)
        keep = truncation(body)
        if keep is not None and 0 <= keep < info.num_tokens:
            _truncate(info, keep, body.get("truncation_side") == "right", block_size)
        info.prompt_logprobs = needs_prompt_logprobs(body, chat)
        model = body.get("model")
        if isinstance(model, str) and self.lora_identity(model) is not None:
            # A LoRA adapter's KV is its own: keys apart from the base model's.
            info.adapter = model
            info.block_hashes = [hash(("lora", model, h)) for h in info.block_hashes]
        salt = body.get("cache_salt")
        if isinstance(salt, str) and salt:
            # Another prefix-cache namespace: affinity keys differ from the
            # unsalted prompt's as the engines' block hashes do.
            info.block_hashes = [hash((salt, h)) for h in info.block_hashes]
        return info

    def _analyze(self, body: dict[str, Any], chat: bool, block_size: int) -> PromptInfo:
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        model = body.get("model")
        lora = self.lora_identity(model) if isinstance(model, str) else None
        batch = False
        text = ""
        # The engine adds special tokens to a completions prompt unless told not to.
        special = _as_bool(body.get("add_special_tokens", True)) is not False
        exact = self.tokenizer is not None
        if chat:
            raw = body.get("messages")
            messages = template_messages(raw) if isinstance(raw, list) else []
            inputs = template_inputs(body)
            rendered = None
            if self.tokenizer and messages is not None and inputs is not None:
                rendered = self.tokenizer.chat_text(messages, inputs)
            if rendered is not None:
                # The template holds the special tokens (unless the request adds more).
                text, special = rendered, _as_bool(body.get("add_special_tokens", False)) is True
            else:
                # Estimated and hashed from the same text: the fields a
                # template renders ahead of the conversation (tools and the
                # like), then each message's role and text, so a repeated
                # request's blocks cover what it is counted.
                head = "".join(_json_text(body[k]) for k in _TEMPLATED_FIELDS if body.get(k))
                conversation = "".join(
                    f"{m.get('role', '')}\n{_message_text(m.get('content'))}\n"
                    for m in (raw if isinstance(raw, list) else [])
                    if isinstance(m, dict)
                )
                text, exact = (head + conversation if conversation else ""), False
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
                batch = len(prompt) > 1
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
                ids = list(prompt)
                return PromptInfo(
                    len(ids),
                    chain_hashes(ids, block_size, self.max_blocks),
                    batch,
                    self.exact_hashes(ids, block_size, salt, lora),
                )
            if isinstance(prompt, str):
                text = prompt
        if exact and text:
            info = self._tokenized(text, special, block_size, salt, lora)
            info.batch = batch
            return info
        return PromptInfo(
            _text_tokens(text),
            chain_hashes(text, block_size * CHARS_PER_TOKEN, self.max_blocks),
            batch,
        )
