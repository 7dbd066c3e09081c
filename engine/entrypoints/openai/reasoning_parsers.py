"""Reasoning parsers: a thinking model's ``<think>…</think>`` text, split from
its answer (``--reasoning-parser``, vLLM's names).

* ``qwen3``: the reasoning is what comes before ``</think>``, when the output
  starts inside a thought: the model writes the opening ``<think>``, or the
  prompt left one open (a template that places ``<think>`` in the prompt, or an
  assistant prefill ending in an open ``<think>``). Output that starts outside
  a thought is all answer: Qwen3 with thinking off
  (``chat_template_kwargs.enable_thinking: false``) answers directly, and its
  template closes the ``<think>`` it writes into the prompt.
* ``deepseek_r1``: as ``qwen3``, except that output without ``</think>`` is all
  reasoning (the model always thinks first; the template opens ``<think>``).

The chat response carries the reasoning as ``message.reasoning`` and, under
its older name, ``message.reasoning_content``; streamed, as deltas of both.
A request with ``include_reasoning: false`` gets the answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    unended_is_reasoning: bool
    """Text with no ``</think>`` yet: reasoning (True) or answer (False)."""

    def split(self, text: str, final: bool, opened: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the output so far. ``opened``: the prompt
        left a ``<think>`` open, so the output starts inside the thought. Not
        ``final``: text that may still become reasoning is reasoning for now,
        and a partial tag is held back from both (it may complete on the next
        token). Streamed and whole, the same text splits the same way: whether
        a text is reasoning is known from its start, never decided later."""
        thinking = self.unended_is_reasoning or opened or text.startswith(START)
        body = text[len(START) :] if text.startswith(START) else text
        if not thinking:
            if not final and len(text) < len(START) and START.startswith(text):
                return "", ""  # could still open "<think>"
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :].lstrip("\n")
        if final:
            # Cut off while thinking is reasoning too.
            return body, ""
        if not text.startswith(START) and len(text) < len(START) and START.startswith(text):
            return "", ""  # could still be the model's own "<think>"
        # Hold back what could be the start of "</think>".
        keep = len(body)
        for n in range(min(len(END) - 1, len(body)), 0, -1):
            if END.startswith(body[-n:]):
                keep = len(body) - n
                break
        return body[:keep], ""


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", unended_is_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", unended_is_reasoning=True),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}"
        ) from None


class ReasoningStream:
    """One streamed choice's text, as reasoning and content deltas."""

    def __init__(self, parser: ReasoningParser, opened: bool = False) -> None:
        self.parser, self.opened = parser, opened
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) this text adds."""
        self.text += text
        reasoning, content = self.parser.split(self.text, final, self.opened)
        new_r = reasoning[self.sent_reasoning :] if len(reasoning) > self.sent_reasoning else ""
        new_c = content[self.sent_content :] if len(content) > self.sent_content else ""
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return new_r, new_c


def prompt_opens_thought(prompt: str) -> bool:
    """The prompt ends inside a ``<think>`` it opened (no ``</think>`` after
    the last ``<think>``): the output continues that thought."""
    start = prompt.rfind(START)
    return start >= 0 and prompt.find(END, start) < 0
