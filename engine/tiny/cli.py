"""``pdfleet tiny-model DIR``: write the built-in tiny model directory."""

from __future__ import annotations

import argparse
import dataclasses

from .builder import ARCHS, TinyModelSpec


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "tiny-model",
        help="write a small random-weight model directory (no download)",
        description="Write a Hugging Face model directory: config.json, model.safetensors "
        "(deterministic random weights), generation_config.json and a byte-level BPE tokenizer "
        "with a chat template, trained on text pdfleet ships.",
    )
    parser.add_argument("directory", metavar="DIR", help="Directory to write.")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="Architecture family.")
    defaults = TinyModelSpec()
    for f in dataclasses.fields(TinyModelSpec):
        if f.name == "arch":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "tie_word_embeddings":
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help="Tie input and output embeddings (default: per family).",
            )
        elif f.name in ("rope_scaling", "dtype"):
            choices = (
                ["llama3", "linear"]
                if f.name == "rope_scaling"
                else ["float32", "bfloat16", "float16"]
            )
            parser.add_argument(flag, choices=choices, default=default, help=f"Default {default}.")
        else:
            kind = float if isinstance(default, float) else int
            parser.add_argument(flag, type=kind, default=default, help=f"Default {default}.")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from .builder import build_tiny_model

    spec = TinyModelSpec(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyModelSpec)}
    )
    path = build_tiny_model(args.directory, spec)
    print(path)
    return 0
