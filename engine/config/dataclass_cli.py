"""Command-line flags of any config dataclass, one flag per field.

The engine and the benchmark derive their flags from their config classes;
this does the same for the smaller commands (``pdfleet sim``, ``pdfleet up``):
the type, default and help of each flag come from the field (its attribute
docstring is the help), so the flags and the library cannot disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, get_args, get_origin

from .fields import argparse_kwargs, attr_docs, default_of, flag_name, resolved_fields

T = TypeVar("T")


def _tuple_kwargs(tp: Any, default: Any, help_text: str) -> dict[str, Any] | None:
    """``tuple[float, float]`` -> two values after one flag (``--x LOW HIGH``)."""
    if get_origin(tp) is not tuple:
        return None
    elems = get_args(tp)
    if not elems or Ellipsis in elems or len(set(elems)) != 1:
        raise TypeError(f"no CLI mapping for {tp!r}: use tuple[T, T, ...] of one type")
    return {
        "nargs": len(elems),
        "type": elems[0],
        "default": default,
        "help": help_text.replace("%", "%%"),
    }


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    flags: Mapping[str, str] | None = None,
    skip: Iterable[str] = (),
    metavars: Mapping[str, Any] | None = None,
) -> list[argparse.Action]:
    """Add ``--FLAG`` for each field of ``cls`` (``dest`` is the field name);
    returns the actions added, in field order.

    ``flags`` renames a field's flag (``duration_seconds`` -> ``duration``);
    the default is the field name with dashes. ``skip`` leaves fields out;
    ``metavars`` sets the placeholder shown in ``--help``.
    """
    flags, metavars, skipped = flags or {}, metavars or {}, set(skip)
    docs = attr_docs(cls)
    added = []
    for f, tp in resolved_fields(cls):
        if f.name in skipped:
            continue
        default, help_text = default_of(f), docs.get(f.name, "")
        kwargs = _tuple_kwargs(tp, default, help_text) or argparse_kwargs(
            f.name, tp, default, help_text
        )
        if default is not None and not isinstance(default, bool):
            kwargs["help"] += " (default: %(default)s)"
        if f.name in metavars:
            kwargs["metavar"] = metavars[f.name]
        name = flags.get(f.name, flag_name(f.name))
        if "type" in kwargs and "choices" not in kwargs and "nargs" not in kwargs:
            kwargs.setdefault("metavar", name.upper().replace("-", "_"))
        added.append(parser.add_argument(f"--{name}", dest=f.name, **kwargs))
    return added


def dataclass_from_arguments(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from parsed flags (fields without a flag keep their default)."""
    values: dict[str, Any] = {}
    for f, tp in resolved_fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    values.update(overrides)
    return cls(**values)
