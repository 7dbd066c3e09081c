"""The reasoning parsers split ``<think>…</think>`` from the answer as vLLM's do,
whole and streamed token by token (the streamed pieces add up to the whole)."""

from __future__ import annotations

import pytest

from pdfleet.engine.entrypoints.openai.reasoning_parsers import (
    ReasoningStream,
    get_reasoning_parser,
)

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # thinking off: all answer
    ("qwen3", "<think>cut off while thin", "cut off while thin", ""),
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_whole(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser is not None
    assert parser.split(text, final=True) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_deltas_add_up_to_the_whole(name, text, reasoning, content, step):
    parser = get_reasoning_parser(name)
    assert parser is not None
    stream = ReasoningStream(parser)
    got_r, got_c = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        got_r += r
        got_c += c
        # No piece of the tags themselves ever leaks into either stream.
        assert "</think" not in got_r and "<think" not in got_c
    assert (got_r, got_c) == (reasoning, content)


def test_unknown_parser_is_refused():
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("granite")
