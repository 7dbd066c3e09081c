"""Benchmark prompts: random text of a given length, or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common English words: with BPE vocabularies most are one token with their
# leading space, so N random words are about N tokens.
_WORD_LIST = """
time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program
question work government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason
research girl guy moment air teacher force education river stone light sound garden
road market table paper music field street window summer winter spring autumn green
blue red black white small large early late open close fast slow bright dark warm
cold quiet loud happy simple strong clear
"""
WORDS = _WORD_LIST.split()


@dataclass
class BenchRequest:
    """One request of the workload: a completions prompt or chat messages."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int


def _tokenizer(directory: str) -> Any:
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"--tokenizer {directory}: no tokenizer.json in that directory")
    return Tokenizer.from_file(str(path))


def _random_ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    """``n`` token ids of random words (ids of real words keep the text natural)."""
    if n <= 0:
        return []
    words = " ".join(rng.choice(WORDS) for _ in range(2 * n + 8))
    ids: list[int] = tok.encode(words, add_special_tokens=False).ids[:n]
    return ids


class Workload:
    """Request ``i`` of a run, made on demand and the same for equal seeds
    (a --duration run does not know its length in advance).

    With a tokenizer, completions prompts are exactly ``input_len`` tokens as
    the server counts them (special tokens it adds included); chat prompts add
    the chat template's tokens on top.
    """

    def __init__(
        self,
        input_len: int,
        output_len: int,
        seed: int,
        chat: bool,
        shared_prefix_len: int = 0,
        tokenizer: str | None = None,
        dataset: str | None = None,
    ) -> None:
        self.input_len, self.output_len = input_len, output_len
        self.seed, self.chat = seed, chat
        self.shared_prefix_len = shared_prefix_len
        self.tok = _tokenizer(tokenizer) if tokenizer else None
        self.items = jsonl_items(dataset, output_len, chat) if dataset else None
        if self.items is not None:
            random.Random(seed).shuffle(self.items)
        prefix_rng = random.Random(f"{seed}-prefix")
        self.special = 0
        if self.tok is not None:
            if not chat:
                self.special = len(self.tok.encode("", add_special_tokens=True).ids)
            self.prefix_ids = _random_ids(self.tok, prefix_rng, shared_prefix_len)
        else:
            self.prefix = " ".join(prefix_rng.choice(WORDS) for _ in range(shared_prefix_len))

    def prompt(self, i: int) -> str:
        rng = random.Random(f"{self.seed}-{i}")
        n = self.input_len - self.shared_prefix_len
        if self.tok is not None:
            want = max(1, self.input_len - self.special)
            ids = self.prefix_ids + _random_ids(self.tok, rng, want - len(self.prefix_ids))
            text: str = self.tok.decode(ids)
            # Decoding then re-encoding can merge tokens across word boundaries: refit.
            for _ in range(4):
                got = self.tok.encode(text, add_special_tokens=False).ids
                if len(got) == want:
                    break
                if len(got) > want:
                    got = got[:want]
                else:
                    got += _random_ids(self.tok, rng, want - len(got))
                text = self.tok.decode(got)
            return text
        body = " ".join(rng.choice(WORDS) for _ in range(n))
        return f"{self.prefix} {body}" if self.prefix else body

    def get(self, i: int) -> BenchRequest:
        if self.items is not None:
            return self.items[i % len(self.items)]
        prompt = self.prompt(i)
        if self.chat:
            return BenchRequest(None, [{"role": "user", "content": prompt}], self.output_len)
        return BenchRequest(prompt, None, self.output_len)


def jsonl_items(path: str, output_len: int, chat: bool) -> list[BenchRequest]:
    """Every request of a JSONL file (`prompt` or `messages`, optional `max_tokens`)."""
    items: list[BenchRequest] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected an object")
        max_tokens = int(obj.get("max_tokens", output_len))
        if chat:
            messages = obj.get("messages")
            if messages is None and isinstance(obj.get("prompt"), str):
                messages = [{"role": "user", "content": obj["prompt"]}]
            if not isinstance(messages, list):
                raise ValueError(f"{path}:{lineno}: needs `messages` (or `prompt`) for chat")
            items.append(BenchRequest(None, messages, max_tokens))
        else:
            if not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: needs a string `prompt` for completions")
            items.append(BenchRequest(obj["prompt"], None, max_tokens))
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items
