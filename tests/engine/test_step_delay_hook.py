"""The step-delay test hook: a first number slept before each step, an optional
second one per scheduled token, counted as forward time."""

from __future__ import annotations

import pytest

from pdfleet.engine.testing_hooks import StepFaults


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", (0.0, 0.0)),
        ("0.05\n", (0.05, 0.0)),
        ("0 0.001\n", (0.0, 0.001)),
        ("0.02 0.003", (0.02, 0.003)),
        ("-1 -2", (0.0, 0.0)),
        ("soon", (0.0, 0.0)),
    ],
)
def test_the_file_holds_a_step_delay_and_an_optional_per_token_one(tmp_path, text, expected):
    path = tmp_path / "delay"
    path.write_text(text)
    assert StepFaults(step_delay_file=str(path)).step_delay() == expected


def test_no_file_or_a_missing_one_delays_nothing(tmp_path):
    assert StepFaults().step_delay() == (0.0, 0.0)
    assert StepFaults(step_delay_file=str(tmp_path / "absent")).step_delay() == (0.0, 0.0)
