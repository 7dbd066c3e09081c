"""``pdfleet fetch-model URI``: make a model ready on this machine, print its directory.

``builtin://NAME`` is prepared from what pdfleet ships; ``hf://ORG/NAME``
(or ``hf://ORG/NAME/FILE.gguf``) is downloaded into a Hugging Face cache. A
GGUF file gets its config and tokenizer read from its metadata. The
operator's init containers run this command; so does ``pdfleet up``.
Progress goes to stderr, the directory to stdout. See docs/models.md.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "fetch-model",
        help="download or prepare a model (builtin://, hf://) and print its directory",
        description="Make builtin://NAME or hf://ORG/NAME[/FILE.gguf] ready to serve and print "
        "the model directory. hf:// reads the token from $HF_TOKEN and the endpoint from "
        "$HF_ENDPOINT (for mirrors); downloads resume and are shared through --cache-dir.",
    )
    parser.add_argument("uri", metavar="URI", help="builtin://NAME or hf://ORG/NAME[/FILE.gguf]")
    parser.add_argument("--revision", default=None, help="hf:// branch, tag or commit")
    parser.add_argument(
        "--cache-dir", default=None, help="Hugging Face cache directory (hf:// only)"
    )
    parser.add_argument(
        "--output",
        default=None,
        help="also make the model available at this path (a prepared directory, or a link "
        "to the downloaded snapshot)",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="hf:// only: the repository is a LoRA adapter (fetch adapter_config.json and "
        "adapter_model.safetensors)",
    )
    parser.set_defaults(func=run)
    return parser


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _link(target: str, output: str) -> str:
    """``output`` -> ``target``, replaced atomically when it exists."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    os.symlink(target, tmp)
    os.replace(tmp, output)
    return output


def fetch_model(
    uri: str,
    revision: str | None = None,
    cache_dir: str | None = None,
    output: str | None = None,
    adapter: bool = False,
) -> str:
    from ..contracts.model_source import HF_SCHEME
    from ..models.sources.gguf import is_gguf_file, prepare_gguf_dir
    from ..models.sources.hub import download_hf_model

    scheme, _, rest = uri.partition("://")
    if adapter and scheme != HF_SCHEME:
        raise ValueError(f"{uri!r}: --adapter takes hf://ORG/NAME")
    if scheme == "builtin":
        from .registry import builtin_model_dir

        return builtin_model_dir(rest, _say, out=output)
    if scheme == HF_SCHEME:
        path = download_hf_model(uri, revision, cache_dir=cache_dir, say=_say, adapter=adapter)
        if is_gguf_file(path):
            return prepare_gguf_dir(path, _say, out=output)
        return _link(path, output) if output else path
    if scheme == "file" and is_gguf_file(rest):
        return prepare_gguf_dir(rest, _say, out=output)
    raise ValueError(
        f"{uri!r}: fetch-model takes builtin://NAME, hf://ORG/NAME or file:///PATH.gguf"
    )


def run(args: argparse.Namespace) -> int:
    import logging

    # One line per HTTP request would bury the progress lines.
    for name in ("httpx", "httpx2", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)
    path = fetch_model(args.uri, args.revision, args.cache_dir, args.output, args.adapter)
    print(path, flush=True)
    return 0
