"""Reasoning parsers: a thinking model's ``<think>…</think>`` text, split from
its answer (``--reasoning-parser``, vLLM's names).

* ``qwen3``: the reasoning is what comes before ``</think>`` (after the
  opening ``<think>`` the model writes). Output that opens no ``<think>`` and
  has no ``</think>`` is all answer: Qwen3 with thinking off
  (``chat_template_kwargs.enable_thinking: false``) answers directly.
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

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far. Not ``final``: text that
        may still become reasoning is reasoning for now, and a partial end tag
        is held back from both (it may complete on the next token)."""
        body = text[len(START) :] if text.startswith(START) else text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :].lstrip("\n")
        if final:
            # Cut off while thinking (an opened "<think>") is reasoning too.
            if self.unended_is_reasoning or text.startswith(START):
                return body, ""
            return "", text
        if len(text) < len(START) and START.startswith(text):
            return "", ""  # could still open "<think>"
        if self.unended_is_reasoning or text.startswith(START):
            # Hold back what could be the start of "</think>".
            keep = len(body)
            for n in range(min(len(END) - 1, len(body)), 0, -1):
                if END.startswith(body[-n:]):
                    keep = len(body) - n
                    break
            return body[:keep], ""
        return "", text


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

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) this text adds."""
        self.text += text
        reasoning, content = self.parser.split(self.text, final)
        new_r = reasoning[self.sent_reasoning :] if len(reasoning) > self.sent_reasoning else ""
        new_c = content[self.sent_content :] if len(content) > self.sent_content else ""
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return new_r, new_c
