"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE tokens can split a multi-byte character; decoding such a
prefix yields U+FFFD. The detokenizer decodes a small window of recent tokens
and only emits text once it no longer ends in a replacement character (the
same prefix/read offset scheme as vLLM and TGI).
"""

from __future__ import annotations

from typing import Any

# How many earlier tokens to re-decode for context (spaces, merged characters).
_LOOKBACK = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - _LOOKBACK, 0)
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (may be empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character (or nothing visible) so far
        new = full[len(prefix) :] if full.startswith(prefix) else full
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += new
        return new

    def flush(self) -> str:
        """At the end: emit what is left, even an incomplete character."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        new = full[len(prefix) :] if len(full) > len(prefix) and full.startswith(prefix) else ""
        self.read_offset = len(self.token_ids)
        self.prefix_offset = self.read_offset
        self.output_text += new
        return new
