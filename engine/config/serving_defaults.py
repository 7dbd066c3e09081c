"""Chat-serving defaults a model directory carries: ``pdfleet_serving.json``.

pdfleet's built-in models ship with a chat template that renders tools and the
tool-call parser that reads the model's calls (``builtin://smollm2-135m-instruct``:
a ChatML template with Hermes-style ``<tool_call>`` blocks and the ``hermes``
parser). Preparing such a model writes the template as the directory's
``chat_template.jinja`` and the parser here, so every engine serving the
directory (``pdfleet serve``, ``pdfleet up``, the operator's pods) answers
``tool_choice: "auto"`` with no flag. The server flags (and
``spec.serving`` of an InferenceService) override it: see
:func:`resolve_tool_flags` and docs/tool_calling.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SERVING_DEFAULTS_FILE = "pdfleet_serving.json"
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ServingDefaults:
    tool_call_parser: str | None = None
    """The parser matching the directory's chat template; with it, tool_choice
    "auto" is on unless the server turns it off."""


def read_serving_defaults(model_dir: str) -> ServingDefaults:
    """The directory's defaults (none when it has no file)."""
    path = os.path.join(model_dir, SERVING_DEFAULTS_FILE)
    if not os.path.isfile(path):
        return ServingDefaults()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        parser = data.get("tool_call_parser")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a pdfleet serving-defaults file ({e})") from None
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"{path}: tool_call_parser {parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    return ServingDefaults(tool_call_parser=parser)


def write_serving_defaults(model_dir: str, defaults: ServingDefaults) -> None:
    with open(os.path.join(model_dir, SERVING_DEFAULTS_FILE), "w", encoding="utf-8") as f:
        json.dump({"tool_call_parser": defaults.tool_call_parser}, f, indent=2)


def resolve_tool_flags(
    chat_template: str | None,
    tool_call_parser: str | None,
    enable_auto_tool_choice: bool | None,
    defaults: ServingDefaults,
) -> tuple[str | None, bool]:
    """(parser, auto tool choice) of a server: the flags where given; the model
    directory's parser (with "auto" on) where neither the parser nor a template
    of the server's own is given. ``enable_auto_tool_choice`` None means the flag
    was not given (``--no-enable-auto-tool-choice`` is False)."""
    if tool_call_parser is None and chat_template is None and defaults.tool_call_parser:
        parser = defaults.tool_call_parser
        return parser, enable_auto_tool_choice is not False
    return tool_call_parser, bool(enable_auto_tool_choice)
