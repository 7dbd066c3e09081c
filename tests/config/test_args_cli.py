"""Flags are derived from the typed fields and round-trip exactly."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from typing import Any, Literal, get_args, get_origin

import pytest

from pdfleet.engine.config import (
    UNSUPPORTED,
    CompilationConfig,
    EngineArgs,
    FlexibleArgumentParser,
    KVEventsConfig,
    KVTransferConfig,
    expand_json_human_numbers,
    parse_human_int,
    parse_human_int_or_auto,
)
from pdfleet.engine.config.fields import flatten_type


def parser() -> argparse.ArgumentParser:
    p = FlexibleArgumentParser(prog="test")
    EngineArgs.add_cli_args(p, positional_model=True)
    return p


def parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(parser().parse_args(argv))


def non_default_value(name: str, tp: Any, default: Any) -> Any:
    """A value of type ``tp`` different from ``default``."""
    hints = flatten_type(tp) - {type(None)}
    if name == "max_model_len":
        return 1024
    for h in hints:
        if get_origin(h) is Literal:
            return next(v for v in get_args(h) if v != default)
    if bool in hints:
        return not default if default is not None else True
    if CompilationConfig in hints:
        return CompilationConfig(
            cudagraph_capture_sizes=[1, 2, 8], cudagraph_mode="FULL_DECODE_ONLY"
        )
    if KVTransferConfig in hints:
        return KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_consumer",
            engine_id="e-1",
            kv_connector_extra_config={"lease_seconds": 12, "backends": ["UCX"]},
        )
    if KVEventsConfig in hints:
        return KVEventsConfig(enable_kv_cache_events=True, topic="kv")
    for h in hints:
        if get_origin(h) is list or h is list:
            (elem,) = get_args(h) or (str,)
            return [3, 1, 2] if elem is int else ["a", "b"]
        if get_origin(h) is dict or h is dict:
            val_t = (get_args(h) or (str, Any))[1]
            if val_t is int:
                return {"alpha": 1}
            if val_t is str:
                return {"alpha": "x"}
            return {"alpha": 1, "nested": {"beta": "x"}}
    if int in hints:
        return (default or 0) + 7
    if float in hints:
        return (default or 0.0) + 0.25 if name != "gpu_memory_utilization" else 0.5
    if str in hints:
        return "value-for-" + name
    raise AssertionError(f"no test value for {name}: {tp}")


FIELDS = [(f, t) for f, t in typing.get_type_hints(EngineArgs).items()]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineArgs)])
def test_every_field_round_trips_through_its_flag(name):
    f = next(x for x in dataclasses.fields(EngineArgs) if x.name == name)
    tp = typing.get_type_hints(EngineArgs)[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    value = non_default_value(name, tp, default)
    args = EngineArgs(**{name: value})
    argv = args.to_cli_args()
    assert argv, f"{name}: a non-default value must produce a flag"
    assert argv[0] in (f"--{name.replace('_', '-')}", f"--no-{name.replace('_', '-')}")
    assert parse(argv) == args


def test_every_flag_has_help_text():
    for f in dataclasses.fields(EngineArgs):
        assert EngineArgs.field_help(f).strip(), f"{f.name} has no docstring"


def test_flags_are_grouped_by_sub_config():
    groups = {g.title for g in parser()._action_groups}
    assert {
        "ModelConfig",
        "CacheConfig",
        "SchedulerConfig",
        "ParallelConfig",
        "DeviceConfig",
        "LoadConfig",
        "CompilationConfig",
        "ObservabilityConfig",
        "EngineConfig",
    } <= groups


def test_none_restores_an_optional_default_and_bool_flags_have_negations():
    args = parse(["--max-num-seqs", "None", "--no-enable-prefix-caching", "--enforce-eager"])
    assert args.max_num_seqs is None
    assert args.enable_prefix_caching is False
    assert args.enforce_eager is True


def test_literal_flags_reject_unknown_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["--kv-cache-dtype", "fp8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8" in err
    assert len(err.strip().splitlines()) == 1


def test_positional_model_and_underscore_flags():
    args = parse(["/models/x", "--max_num_seqs", "12", "--served-model-name", "a", "b"])
    assert args.model == "/models/x"
    assert args.max_num_seqs == 12
    assert args.served_model_name == ["a", "b"]


def test_model_given_twice_differently_is_an_error():
    with pytest.raises(ValueError, match="given twice"):
        parse(["/models/x", "--model", "/models/y"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2k", 2000),
        ("2K", 2048),
        ("1G", 1 << 30),
        ("1g", 10**9),
        ("25.6k", 25600),
        ("1.5m", 1_500_000),
        ("3M", 3 << 20),
        ("1T", 1 << 40),
        ("512", 512),
    ],
)
def test_human_readable_ints(text, value):
    assert parse_human_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "abc", "1.5", "-3", "2kb", ""])
def test_human_readable_int_errors(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):  # each message starts with it
        parse_human_int(text)


def test_human_readable_flags_and_auto():
    args = parse(
        ["--max-num-batched-tokens", "8K", "--kv-cache-memory-bytes", "1G", "--max-model-len", "2k"]
    )
    assert (args.max_num_batched_tokens, args.kv_cache_memory_bytes, args.max_model_len) == (
        8192,
        1 << 30,
        2000,
    )
    assert parse(["--max-model-len", "auto"]).max_model_len == -1
    assert parse_human_int_or_auto("-1") == -1
    with pytest.raises(SystemExit):
        parse(["--max-num-seqs", "2k"])  # plain int field: no suffixes


def test_json_flags_take_human_readable_numbers_but_not_inside_strings():
    assert json.loads(expand_json_human_numbers('{"a": 80m, "b": "8k", "c": [2K, 1.5k]}')) == {
        "a": 80_000_000,
        "b": "8k",
        "c": [2048, 1500],
    }
    args = parse(
        [
            "--kv-transfer-config",
            '{"kv_connector": "ZmqConnector", "kv_role": "kv_producer", '
            '"kv_connector_extra_config": {"lease_seconds": 2k, "name": "1k"}}',
        ]
    )
    assert args.kv_transfer_config.kv_connector_extra_config == {
        "lease_seconds": 2000,
        "name": "1k",
    }


def test_dotted_json_keys_merge_with_a_whole_json_flag():
    args = parse(
        [
            "--kv-transfer-config",
            '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
            "--kv-transfer-config.kv_role",
            "kv_consumer",
            "--kv-transfer-config.kv_connector_extra_config.lease_seconds=5",
            "--kv_transfer_config.kv_port",
            "15000",
        ]
    )
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_port) == ("NixlConnector", "kv_consumer", 15000)
    assert kv.kv_connector_extra_config == {"lease_seconds": 5}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-transfer-config", "{not json"], "invalid JSON"),
        (
            ["--kv-transfer-config", '{"kv_conector": "NixlConnector"}'],
            "unknown field.*kv_conector",
        ),
        (
            ["--kv-transfer-config", '{"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}'],
            "P2pNcclConnector' is not supported",
        ),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "kv_role must be set"),
        (["--kv-transfer-config", '{"kv_role": "kv_producer"}'], "kv_connector must be set"),
        (
            [
                "--kv-transfer-config",
                '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "x"}',
            ],
            "kv_load_failure_policy",
        ),
        (
            [
                "--kv-transfer-config",
                '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                '"kv_connector_extra_config": {"lease_seconds": -1}}',
            ],
            "lease_seconds must be a positive",
        ),
        (
            ["--compilation-config", '{"cudagraph_capture_sizes": "1,2"}'],
            "cudagraph_capture_sizes: expected a list",
        ),
    ],
)
def test_nested_config_errors_name_the_field(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


@pytest.mark.parametrize(("name", "unused", "what"), UNSUPPORTED)
def test_unsupported_features_are_rejected_naming_the_flag(tiny_model, name, unused, what):
    f = next(x for x in dataclasses.fields(EngineArgs) if x.name == name)
    value = non_default_value(name, typing.get_type_hints(EngineArgs)[name], unused)
    if name.endswith("_size"):
        value = 2
    args = EngineArgs(model=tiny_model, **{f.name: value})
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag}.*not supported by pdfleet"):
        args.create_engine_config()


def test_engine_args_accept_dicts_for_nested_configs():
    args = EngineArgs(
        kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_both"},
        compilation_config={"cudagraph_capture_sizes": [4]},
    )
    assert isinstance(args.kv_transfer_config, KVTransferConfig)
    assert args.compilation_config.cudagraph_capture_sizes == [4]
    with pytest.raises(ValueError, match="unknown field"):
        EngineArgs(kv_transfer_config={"bogus": 1})


def test_a_subcommand_folds_the_dotted_keys_of_its_grouped_json_flags():
    # `pdfleet serve`'s JSON flags live in argument groups of a subcommand's
    # parser: each is recorded as it is added, and the parser reads no
    # private argparse state to find them.
    from pdfleet.engine.cli import build_parser
    from pdfleet.engine.config.parser import FlexibleArgumentParser

    top = build_parser()
    assert "--kv-transfer-config" in top._json_flags()
    args = top.parse_args(
        [
            "serve",
            "--model",
            "m",
            "--kv_transfer_config.kv_role",
            "kv_consumer",
            "--kv-transfer-config.kv_connector=NixlConnector",
        ]
    )
    assert (args.kv_transfer_config.kv_role, args.kv_transfer_config.kv_connector) == (
        "kv_consumer",
        "NixlConnector",
    )
    assert FlexibleArgumentParser(prog="bare").json_flags == set()
