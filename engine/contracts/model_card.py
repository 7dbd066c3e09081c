"""The ``/v1/models`` entries (OpenAI's model object, as vLLM extends it): an
engine lists its served names and its loaded LoRA adapters; the gateway
lists its names and every adapter its engines serve; the gateway, the
operator, ``pdfleet up`` and the autoscaling lab read them.

    {"id": str, "object": "model", "created": int, "owned_by": str,
     "root": str | null, "parent": str | null, "max_model_len": int | null,
     "lora_identity": str | null,           # adapters only
     "lora_int_id": int,                    # adapters only (vLLM's unload id)
     "source": str, "revision": str | null}  # adapters loaded from the Hub only

An adapter's card has ``parent``: the base model's name (vLLM's rule); its
``root`` is the directory it was loaded from (for a Hub adapter, its snapshot
in that engine's cache, with ``source`` and ``revision`` saying what was
fetched), and ``lora_identity`` its prefix-cache identity
(``block_hash.lora_identity``). Fields a reader does not know (a vLLM engine's
``permission``) are kept and written back as they came.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_KNOWN = frozenset(
    {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "lora_identity",
        "lora_int_id",
        "source",
        "revision",
    }
)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One ``/v1/models`` entry: a served model or a LoRA adapter (``parent`` set)."""

    id: str
    created: int = 0
    owned_by: str = "pdfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    lora_identity: str | None = None
    lora_int_id: int | None = None
    """An adapter's integer id, which vLLM's unload body may name."""
    source: str | None = None
    """An adapter's ``hf://ORG/NAME`` when the engine fetched it from the Hub."""
    revision: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this carrier does not know, as they came (written back after the known)."""

    @property
    def is_adapter(self) -> bool:
        return self.parent is not None

    def to_wire(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": self.owned_by,
            "root": self.root,
            "parent": self.parent,
            "max_model_len": self.max_model_len,
        }
        if self.is_adapter:
            card["lora_identity"] = self.lora_identity
            if self.lora_int_id is not None:
                card["lora_int_id"] = self.lora_int_id
            if self.source is not None:
                card.update(source=self.source, revision=self.revision)
        card.update(self.extra)
        return card

    @classmethod
    def from_wire(cls, raw: Any) -> ModelCard | None:
        """The card of a decoded JSON entry; None for one that is not an object
        with a string ``id``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            return None
        created, length = raw.get("created"), raw.get("max_model_len")
        int_id = raw.get("lora_int_id")
        return cls(
            id=raw["id"],
            created=created if isinstance(created, int) else 0,
            owned_by=_str(raw.get("owned_by")) or "pdfleet",
            root=_str(raw.get("root")),
            parent=_str(raw.get("parent")),
            max_model_len=length if isinstance(length, int) else None,
            lora_identity=_str(raw.get("lora_identity")),
            lora_int_id=int_id
            if isinstance(int_id, int) and not isinstance(int_id, bool)
            else None,
            source=_str(raw.get("source")),
            revision=_str(raw.get("revision")),
            extra={k: v for k, v in raw.items() if k not in _KNOWN},
        )


def encode_list(cards: Iterable[ModelCard]) -> dict[str, Any]:
    """The ``/v1/models`` answer."""
    return {"object": "list", "data": [c.to_wire() for c in cards]}


def decode_list(raw: Any) -> list[ModelCard]:
    """The cards of a ``/v1/models`` answer (decoded JSON); entries that are
    not cards are dropped. ValueError for an answer that is not a listing."""
    data = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: the answer has no data list")
    return [card for card in map(ModelCard.from_wire, data) if card is not None]
