"""Stable hashes of configuration factors (same value in every process)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .fields import to_jsonable


def hash_factors(factors: Any, length: int = 10) -> str:
    """md5 of the canonical JSON of ``factors``; never Python's salted ``hash()``."""
    text = json.dumps(to_jsonable(factors), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()[:length]


def hash_fields(obj: Any, names: tuple[str, ...]) -> str:
    return hash_factors({name: getattr(obj, name) for name in names})
