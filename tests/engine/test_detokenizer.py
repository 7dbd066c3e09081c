"""Incremental detokenization never splits a UTF-8 character."""

from __future__ import annotations

import pytest

from pdfleet.engine.loop.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii text, with spaces",
        "東京の朝 🙂🚀 ꙮ∰‱ naïve",
        "line one\nline two\n\ttabbed",
        "🚀" * 5,
    ],
)
def test_streamed_text_equals_full_decode_and_never_emits_half_characters(tokenizer, text):
    prompt = tokenizer("Hello").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    # Characters arrive as soon as they are complete.
    assert sum(1 for p in pieces if p) > 1


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer("ꙮ", add_special_tokens=False).input_ids
    assert len(ids) >= 2, "the glyph should need several byte tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "ꙮ"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = tokenizer("hi there", add_special_tokens=False).input_ids
    text = "".join(detok.add(t) for t in [*ids, eos])
    assert text == "hi there"
