"""The run-time LoRA routes' body and answers (vLLM's ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``), as the gateway, ``pdfleet up`` and the
operator call them and an engine reads them.

Body: a JSON object. A load: ``{"lora_name": str, "lora_path": str,
"revision": str}`` (``revision`` only with an ``hf://ORG/NAME`` path; vLLM's
``load_inplace`` only ``false``). An unload: vLLM's ``{"lora_name": str,
"lora_int_id": int}``, ``lora_int_id`` optional; when given it must be the
id the engine's card of the name (``/v1/models``) reports, else the unload
is refused naming it. Any other field is refused naming it. A load answers 200
(plain text, as vLLM) when it loaded the adapter; an error body
(``errors.py``) otherwise, whose status and ``param`` say what went wrong:

* 400 with ``param: "lora_name"`` (:func:`name_taken`): an adapter is
  already loaded under that name, as vLLM answers (its message says whether
  from the same weights; unload it first to load others). A caller that
  wanted it served may count it a success when the engine's card of the
  name (``/v1/models/NAME``) has the ``lora_identity`` it expects;
* 400 with ``param: "lora_name"`` otherwise: the name cannot be served (not
  a valid adapter name, or the base model's);
* 400 with ``param: "lora_path"``: it cannot be served;
* 400 with ``param`` the field: a malformed body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import ErrorBody

NAME = "lora_name"
PATH = "lora_path"
REVISION = "revision"
INT_ID = "lora_int_id"
INPLACE = "load_inplace"
"""vLLM's: replace the adapter loaded under the name. Only ``false`` (what
a load does anyway) is taken; ``true`` is refused naming it."""
LOAD_FIELDS = frozenset({NAME, PATH, REVISION, INPLACE})
UNLOAD_FIELDS = frozenset({NAME, INT_ID})


class LoRABodyError(ValueError):
    """A malformed body; ``param`` names the field at fault (None: the body itself)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """A load (with ``lora_path``, and a ``revision`` for an ``hf://`` one) or an
    unload (the name, and optionally the id the engine reports for it) of
    one adapter."""

    lora_name: str
    lora_path: str | None = None
    revision: str | None = None
    lora_int_id: int | None = None

    def encode(self) -> bytes:
        """The JSON body."""
        body: dict[str, str | int] = {NAME: self.lora_name}
        if self.lora_path is not None:
            body[PATH] = self.lora_path
        if self.revision is not None:
            body[REVISION] = self.revision
        if self.lora_int_id is not None:
            body[INT_ID] = self.lora_int_id
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, raw: Any, route: str, fields: frozenset[str] = LOAD_FIELDS) -> LoRALoad:
        """The body of a request to ``route`` (already parsed from JSON), which
        takes ``fields``; LoRABodyError naming the field for anything else."""
        if not isinstance(raw, dict):
            raise LoRABodyError(f"{route}: the body must be a JSON object")
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise LoRABodyError(f"{unknown[0]}: unknown field", unknown[0])
        inplace = raw.get(INPLACE, False)
        if not isinstance(inplace, bool):
            raise LoRABodyError(f"{INPLACE}: must be a boolean", INPLACE)
        if inplace:
            raise LoRABodyError(
                f"{INPLACE}: true is not supported; unload the adapter, then load it", INPLACE
            )
        int_id = raw.get(INT_ID)
        if int_id is not None and (
            isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 1
        ):
            raise LoRABodyError(f"{INT_ID}: must be a positive integer", INT_ID)
        name, path, revision = raw.get(NAME), raw.get(PATH), raw.get(REVISION)
        if not isinstance(name, str) or not name:
            raise LoRABodyError(f"{NAME}: a non-empty string is required", NAME)
        if path is not None and (not isinstance(path, str) or not path):
            raise LoRABodyError(f"{PATH}: must be a non-empty string", PATH)
        if revision is not None:
            if not isinstance(revision, str) or not revision:
                raise LoRABodyError(f"{REVISION}: must be a non-empty string", REVISION)
            if not (path or "").startswith("hf://"):
                raise LoRABodyError(
                    f"{REVISION}: only an hf://ORG/NAME lora_path has one", REVISION
                )
        return cls(name, path, revision, int_id)


ALREADY_LOADED = "has already been loaded"
"""The words of a :func:`already_loaded` answer that tell it from the other
400s naming ``lora_name`` (an invalid name, the base model's name)."""


def already_loaded(name: str, same_weights: bool) -> ErrorBody:
    """The answer to a load of a name already loaded (vLLM's status and words)."""
    how = "from the same weights" if same_weights else "with other weights; unload it first"
    return ErrorBody(f"The lora adapter {name!r} {ALREADY_LOADED} ({how}).", 400, NAME)


def load_succeeded(status: int) -> bool:
    """Whether a load's answer means the adapter is now served from the weights
    asked for by that load itself (200). A :func:`name_taken` answer may
    mean it already was: the engine's card of the name says."""
    return status == 200


def name_taken(status: int, body: bytes | str) -> bool:
    """Whether a load's answer says the name was already loaded (400 naming
    ``lora_name`` in :func:`already_loaded`'s words); anything else, a name
    that cannot be served included, is the load's failure."""
    if status != 400:
        return False
    error = ErrorBody.decode(body, status)
    return error is not None and error.param == NAME and ALREADY_LOADED in error.message
