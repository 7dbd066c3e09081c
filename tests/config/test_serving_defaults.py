"""A model directory's serving defaults (pdfleet_serving.json): the built-in
model's parser is on with no flag; the server's flags override it."""

from __future__ import annotations

import pytest

from pdfleet.engine.config.serving_defaults import (
    ServingDefaults,
    read_serving_defaults,
    resolve_tool_flags,
    write_serving_defaults,
)

HERMES = ServingDefaults("hermes")
NONE = ServingDefaults()


@pytest.mark.parametrize(
    ("template", "parser", "auto", "defaults", "expected"),
    [
        (None, None, None, HERMES, ("hermes", True)),  # no flag: the model's parser, auto on
        (None, None, False, HERMES, ("hermes", False)),  # --no-enable-auto-tool-choice
        (None, None, True, HERMES, ("hermes", True)),
        (None, "mistral", None, HERMES, ("mistral", False)),  # vLLM: auto needs its flag
        (None, "mistral", True, HERMES, ("mistral", True)),
        ("{{ x }}", None, None, HERMES, (None, False)),  # an own template: not the model's
        (None, None, None, NONE, (None, False)),  # a model that names nothing
        (None, "hermes", True, NONE, ("hermes", True)),
    ],
)
def test_flags_win_else_the_directory_names_the_parser(template, parser, auto, defaults, expected):
    assert resolve_tool_flags(template, parser, auto, defaults) == expected


def test_the_file_round_trips_and_a_bad_one_is_refused_naming_it(tmp_path):
    assert read_serving_defaults(str(tmp_path)) == NONE
    write_serving_defaults(str(tmp_path), HERMES)
    assert read_serving_defaults(str(tmp_path)) == HERMES
    (tmp_path / "pdfleet_serving.json").write_text('{"tool_call_parser": "nope"}')
    with pytest.raises(ValueError, match="pdfleet_serving.json: tool_call_parser 'nope'"):
        read_serving_defaults(str(tmp_path))
    (tmp_path / "pdfleet_serving.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a pdfleet serving-defaults file"):
        read_serving_defaults(str(tmp_path))
