"""`pdfleet up`'s flags come from its options dataclass."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdfleet.operator.local.cli import UpOptions, add_parser


def parser() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser().add_subparsers())


def test_every_option_is_a_flag_with_the_dataclass_default():
    args = parser().parse_args([])
    assert args.file is None
    for f in dataclasses.fields(UpOptions):
        assert getattr(args, f.name) == f.default


def test_flags_parse_to_the_field_types():
    args = parser().parse_args(["svc.yaml", "--port", "9000", "--run-dir", "/tmp/r"])
    assert (args.file, args.port, args.run_dir) == ("svc.yaml", 9000, "/tmp/r")
    assert parser().parse_args(["--threads-per-engine", "None"]).threads_per_engine is None


def test_a_bad_value_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--timeout", "soon"])
    assert "--timeout" in capsys.readouterr().err


def test_engine_threads_leave_one_core_to_the_gateway():
    from pdfleet.operator.local.fleet import engine_threads

    assert engine_threads(2, 1) == 1  # the old default, cores / engines, gave 2
    assert engine_threads(16, 2) == 7
    assert engine_threads(8, 1) == 7
    assert engine_threads(1, 1) == 1
    assert engine_threads(2, 3) == 1
