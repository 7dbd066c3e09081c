"""The engine sections carry the engine's constant bounds: the CRD's schema
(minimum/maximum/enum, checked by ``helpers.crd_checks.admit``) and the
resource model refuse the same values, each naming the path, and every bound
is one the engine's own configuration makes."""

from __future__ import annotations

import dataclasses

import annotated_types
import pytest
from helpers.crd_checks import admit

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.config.fields import FieldBounds, OneOf, field_bounds, resolved_fields
from pdfleet.engine.config.parallel import ParallelConfig
from pdfleet.operator.engine_spec import camel, spec_fields
from pdfleet.operator.resource import parse_spec

BASE = {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}}
# Bounds the engine checks where a sub-configuration cannot be built alone
# (the model's configuration), or that are the resource's own.
# max_cudagraph_capture_size is checked by EngineConfig when CUDA graphs are used.
NOT_A_SUB_CONFIG_CHECK = {"seed", "max_model_len", "max_logprobs", "max_cudagraph_capture_size"}


BOUNDS = EngineArgs.bounds()


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's annotated_types constraints read back as one range (or enum)."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive: bool = False
    enum: tuple[int, ...] | None = None
    items: bool = False

    @classmethod
    def of(cls, bounds: FieldBounds) -> Range:
        out = cls(items=bool(bounds.items))
        for m in bounds.items or bounds.value:
            if isinstance(m, OneOf):
                out = dataclasses.replace(out, enum=m.values)
            elif isinstance(m, annotated_types.Ge):
                out = dataclasses.replace(out, minimum=m.ge)
            elif isinstance(m, annotated_types.Gt):
                out = dataclasses.replace(out, minimum=m.gt, exclusive=True)
            elif isinstance(m, annotated_types.Le):
                out = dataclasses.replace(out, maximum=m.le)
            else:
                raise AssertionError(f"a bound this test cannot probe: {m!r}")
        return out


RANGES = {name: Range.of(b) for name, b in BOUNDS.items()}


def test_the_bounded_fields():
    # The bounds are the sub-configuration fields' (the resource's 34), and the
    # types the flag and JSON machinery resolves are plain.
    assert len(RANGES) == 34
    assert dict((f.name, tp) for f, tp in resolved_fields(ParallelConfig))["nnodes"] is int
    assert field_bounds(ParallelConfig)["nnodes"] == BOUNDS["nnodes"]
    assert not field_bounds(EngineArgs).get("nnodes")
    assert RANGES["gpu_memory_utilization"] == Range(0, 1, exclusive=True)
    assert RANGES["cudagraph_capture_sizes"] == Range(1, items=True)
    assert RANGES["master_port"] == Range(1, 65535)


def _outside(bound: Range, is_float: bool) -> list[float]:
    """Values just outside the bound (items for a list bound)."""
    out: list[float] = []
    if bound.enum is not None:
        out += [max(bound.enum) + 1, 3 if 3 not in bound.enum else 2]
    if bound.minimum is not None:
        out.append(bound.minimum if bound.exclusive else bound.minimum - (0.5 if is_float else 1))
    if bound.maximum is not None:
        out.append(bound.maximum + (0.5 if is_float else 1))
    return out


def _inside(bound: Range) -> float:
    if bound.enum is not None:
        return bound.enum[-1]
    if bound.maximum is not None:
        return bound.maximum
    return bound.minimum + 1 if bound.exclusive else bound.minimum  # type: ignore[operator]


def _fields():
    by_name = {f.name: (key, tp) for key, (f, tp) in spec_fields().items()}
    for name, bound in RANGES.items():
        key, tp = by_name[name]
        yield name, key, bound, float in getattr(tp, "__args__", (tp,))


def _object(spec: dict) -> dict:
    kind = {"apiVersion": "pdfleet.dev/v1alpha1", "kind": "InferenceService"}
    return {**kind, "metadata": {"name": "demo"}, "spec": spec}


def _problem(spec: dict) -> str | None:
    try:
        parse_spec(spec)
    except ValueError as e:
        return str(e)
    return None


def _value(bound: Range, value: float) -> object:
    return [value] if bound.items else value


def test_the_model_refuses_every_value_out_of_bounds_naming_the_path():
    for _, key, bound, is_float in _fields():
        for value in _outside(bound, is_float):
            engine = {key: _value(bound, value)}
            problem = _problem({**BASE, "engine": engine})
            assert problem and problem.startswith(f"spec.engine.{key}: must be"), (key, problem)
            problem = _problem({**BASE, "decode": {"engine": engine}})
            assert problem and f"spec.decode.engine.{key}: must be" in problem, (key, problem)
        inside = {key: _value(bound, _inside(bound))}
        assert _problem({**BASE, "engine": inside}) is None, key


def test_the_crd_refuses_and_admits_the_same_values():
    # One object per round of bad values (admission is the slow part).
    rounds: list[dict] = [{}, {}, {}]
    for _, key, bound, is_float in _fields():
        for i, value in enumerate(_outside(bound, is_float)):
            rounds[i][key] = _value(bound, value)
    for engine in rounds:
        errors = admit(_object({**BASE, "engine": engine}))[1]
        refused = {e.split(":")[0].removesuffix(".0") for e in errors}
        assert refused == {f"spec.engine.{key}" for key in engine}, errors
    inside = {key: _value(bound, _inside(bound)) for _, key, bound, _ in _fields()}
    assert admit(_object({**BASE, "engine": inside}))[1] == []


# Settings whose edge value needs another setting of the sub-configuration
# to agree (the engine checks them together).
EDGE_COMPANIONS = {
    "max_num_batched_tokens": {"max_num_seqs": 1},
    "grammar_cache_bytes": {"max_grammar_memory_bytes": 1},
}


@pytest.mark.parametrize("name", sorted(set(RANGES) - NOT_A_SUB_CONFIG_CHECK), ids=str)
def test_every_bound_is_the_engines_own(name):
    f = {f.name: f for f in dataclasses.fields(EngineArgs)}[name]
    source, attr = f.metadata["source"]
    bound = RANGES[name]
    is_float = isinstance(getattr(source(), attr), float)
    for value in _outside(bound, is_float):
        bad = [int(value)] if bound.items else (value if is_float else int(value))
        with pytest.raises(ValueError):  # noqa: PT011 (each sub-configuration words its own)
            source(**{attr: bad})
    # ... and no tighter than the engine's: its edges are accepted.
    edges = list(bound.enum or ()) or [
        v for v in (bound.maximum, None if bound.exclusive else bound.minimum) if v is not None
    ]
    for value in edges:
        good = [int(value)] if bound.items else (float(value) if is_float else int(value))
        source(**{attr: good}, **EDGE_COMPANIONS.get(name, {}))


@pytest.mark.parametrize(
    ("engine", "problem"),
    [
        ({"maxNumSeqs": "3"}, "spec.engine.maxNumSeqs: expected an integer, got '3'"),
        ({"tensorParallelSize": "2"}, "spec.engine.tensorParallelSize: expected an integer"),
        ({"cudagraphCaptureSizes": [1, "2"]}, "spec.engine.cudagraphCaptureSizes: expected an"),
        ({"gpuMemoryUtilization": "0.5"}, "spec.engine.gpuMemoryUtilization: expected a number"),
        (
            {"compilationConfig": {"cudagraph_capture_sizes": ["4"]}},
            "spec.engine.compilationConfig: expected an integer",
        ),
        ({"maxNumBatchedTokens": "-1K"}, "spec.engine.maxNumBatchedTokens: "),
    ],
)
def test_engine_values_have_the_crds_types_strictly(engine, problem):
    with pytest.raises(ValueError, match="^" + problem.replace(".", r"\.").replace("[", r"\[")):
        parse_spec({**BASE, "engine": engine})
    # The CRD types a size as int-or-string: a string's bound is the model's.
    assert admit(_object({**BASE, "engine": engine}))[1] or "-1K" in str(engine)


def test_size_fields_still_take_suffixes():
    spec = parse_spec({**BASE, "engine": {"maxNumBatchedTokens": "8K", "maxNumSeqs": 3}})
    assert spec.engine == {"maxNumBatchedTokens": 8192, "maxNumSeqs": 3}
    assert not admit(_object({**BASE, "engine": {"maxNumBatchedTokens": "8K"}}))[1]


def test_the_crd_schema_carries_the_bounds():
    from helpers.crd_checks import crd_schema

    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["maxNumSeqs"]["minimum"] == 1
    assert engine["gpuMemoryUtilization"] == {
        **engine["gpuMemoryUtilization"],
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1,
    }
    assert engine["blockSize"]["enum"] == [1, 8, 16, 32, 64, 128, 256]
    assert engine["cudagraphCaptureSizes"]["items"]["minimum"] == 1
    for name, bound in RANGES.items():
        prop = engine[camel(name)]
        prop = prop["items"] if bound.items else prop
        assert {"minimum", "maximum", "enum"} & set(prop), name


def test_bounds_read_through_optional_lists_and_intervals():
    from typing import Annotated

    from pdfleet.engine.config.fields import bounds_of, bounds_problem

    bounds = bounds_of(Annotated[float, annotated_types.Interval(gt=0, lt=2)] | None)
    assert [bounds_problem(bounds, v) for v in (1.5, 0, 2, float("nan"))] == [
        None,
        "must be > 0, got 0",
        "must be < 2, got 2",
        "must be a finite number, got nan",
    ]
    items = bounds_of(list[Annotated[int, OneOf((1, 8))]] | None)
    assert items == FieldBounds(items=(OneOf((1, 8)),))
    assert bounds_problem(items, [1, 3]) == "must be one of 1, 8, got 3"
    # A constraint neither the CRD nor the resource model would check is refused.
    with pytest.raises(TypeError, match="MultipleOf"):
        bounds_of(Annotated[int, annotated_types.MultipleOf(2)])
