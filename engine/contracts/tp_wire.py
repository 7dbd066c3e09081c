"""What the tensor-parallel main process and its rank processes exchange
(msgpack: nothing is unpickled). ``worker/tp_executor.py`` sends, and
``worker/tp_rank.py`` answers, these:

* :class:`Step`, once per engine step to every rank (one broadcast over the
  control group, after a ``[nbytes, STEP]`` header; ``[0, STOP]`` ends the
  ranks): msgpack ``[new, cached, num_scheduled_tokens, total, finished,
  commands]``, a new request ``[req_id, prompt_token_ids, output_token_ids,
  sampling, block_ids, num_computed_tokens, lora_name, lora_path, lora_id]``
  (``sampling``: a :class:`StepSampling`, a map of the ``SamplingParams``
  fields by name), a cached one
  ``[req_id, new_block_ids, num_computed_tokens]``, ``commands`` the KV shard
  commands (``kv_connector.py``) or nil;
* :class:`StepResult`, from rank 0 only (every rank samples the same tokens):
  ``[sampled, logprobs, prompt_logprobs, finished_sending, finished_recving,
  failed_recving, forward_seconds, failed_requests]`` (plus, with LoRA on, rank 0's caches:
  :class:`StepLoRA`), logprobs ``[token_ids, logprobs, rank]``;
* :class:`LoRALoad`, when the engine loads a LoRA adapter (one broadcast
  after a ``[nbytes, LORA_LOAD]`` header): msgpack ``[lora_name, lora_id,
  lora_path, digest]``; every rank reads and checks its shard of the adapter
  then and answers in one gather over the control group, a
  :data:`LORA_STATUS_BYTES` status each (:func:`lora_status`: empty when
  its shard is in its host cache, else why not, UTF-8); ``[nbytes,
  LORA_DROP]`` + msgpack ``[lora_id, keep]`` drops an adapter (a load the
  other ranks refused, or an unloaded one; ``keep``: requests the main
  process admitted still need it, so its shards stay until a later drop
  without ``keep``);
* on a rank's pipe, one tagged message at a time (:func:`rank_message`):
  :data:`READY` + :class:`RankReady` (``[num_blocks, max_model_len,
  shard_info, layout]``), :data:`RESULT` + a :class:`StepResult`,
  :data:`ERROR` + why (UTF-8);
* in the rendezvous store, for ranks on other nodes: the leader's
  :class:`KVAgentSpec` (or nil) under :data:`KV_AGENT_KEY`, and each headless
  rank's :class:`RankReady`, or ``{"error": why}`` (:class:`RankFailure`),
  under :data:`READY_KEY`.

The rows (:class:`StepRequest`, :class:`StepCached`, :class:`StepLogprobs`)
are named tuples, packed as the arrays they are; :class:`StepCached` is the
scheduler's ``CachedRequestData`` itself, so the running requests, the bulk
of every step, cross without a copy.

Decoders raise ``ValueError`` naming what is malformed. They check every
field's shape and scalar types; the lists of token and block ids inside are
taken as lists (checking each id would cost the step a pass over its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack as _msgpack  # private: other modules use the carriers, never msgpack

from .kv_connector import RankCommand, ShardInfo, decode_rank_commands, encode_rank_commands

READY, RESULT, ERROR = b"Y", b"R", b"E"
"""Tags of a rank's pipe messages (the first byte)."""
STEP, STOP, LORA_LOAD, LORA_DROP = 0, 1, 2, 3
"""Kinds of the control broadcast's header ``[nbytes, kind]``."""
LORA_STATUS_BYTES = 1024
"""Bytes of a rank's answer to a :class:`LoRALoad` (its error text, cut to fit)."""
KV_AGENT_KEY = "pdfleet/kv-agent"
"""Store key of the leader's :class:`KVAgentSpec` (msgpack; nil without a connector)."""
READY_KEY = "pdfleet/ready/{rank}"
"""Store key of a headless rank's readiness (:class:`RankReady` or :class:`RankFailure`)."""
MAX_ERROR_CHARS = 64 * 1024
"""A rank's error text is cut to this (a traceback's last line is what it sends)."""


def _pack(obj: Any) -> bytes:
    packed: bytes = _msgpack.packb(obj, use_bin_type=True)  # msgpack ships no types
    return packed


def _unpack(data: bytes | memoryview, what: str) -> Any:
    try:
        return _msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several kinds for bad bytes
        raise ValueError(f"malformed {what}: not msgpack ({e})") from None


def _row(value: Any, n: int, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"malformed {what}: not a list of {n} items")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"malformed {what}: not an integer")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"malformed {what}: not a list")
    return value


def _str(value: Any, what: str, optional: bool = False) -> Any:
    if not (isinstance(value, str) or (optional and value is None)):
        raise ValueError(f"malformed {what}: not a string")
    return value


def _map(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"malformed {what}: not a map")
    return value


_FLOAT = (int, float)


@dataclass(frozen=True, slots=True)
class StepSampling:
    """A new request's sampling parameters: the fields ``SamplingParams`` takes,
    in its order, packed as a map of them by name (``worker/step_wire.py``
    maps one to the other; a test keeps the two field lists equal)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int | None
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    structured_outputs: None
    """Always nil: a grammar needs an in-process model runner (the TP executor
    refuses a request with one)."""
    logit_bias: list[tuple[int, float]] | None
    """(token id, bias) pairs; they decode as two-item lists."""
    cache_salt: str | None
    resumed_token_ids: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SAMPLING_FIELDS}

    @classmethod
    def from_wire(cls, value: Any) -> StepSampling:
        """The carrier of a step request's sampling map; ValueError naming an
        unknown field (the sender runs another version), a missing one, or one
        of the wrong type. Values are kept as they came (an integer
        temperature stays one), so a step re-encodes to the same bytes."""
        if type(value) is not dict:
            raise ValueError("malformed step sampling: not a map")
        if value.keys() != _SAMPLING_TYPES.keys():
            unknown = sorted(str(k) for k in value.keys() - _SAMPLING_TYPES.keys())
            missing = sorted(_SAMPLING_TYPES.keys() - value.keys())
            raise ValueError(
                f"malformed step sampling: unknown fields {unknown}, missing fields {missing}"
            )
        for name, kinds in _SAMPLING_TYPES.items():
            v = value[name]
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise ValueError(f"malformed step sampling: {name} is {type(v).__name__}")
        return cls(**value)


_SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "n": (int,),
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": (int,),
    "min_p": _FLOAT,
    "seed": (int, type(None)),
    "presence_penalty": _FLOAT,
    "frequency_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "max_tokens": (int, type(None)),
    "min_tokens": (int,),
    "stop": (list,),
    "stop_token_ids": (list,),
    "include_stop_str_in_output": (bool,),
    "ignore_eos": (bool,),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "structured_outputs": (type(None),),
    "logit_bias": (list, type(None)),
    "cache_salt": (str, type(None)),
    "resumed_token_ids": (list,),
}
"""Each field's wire types (a bool is no number here)."""
_SAMPLING_FIELDS = tuple(_SAMPLING_TYPES)


class StepRequest(NamedTuple):
    """A request a step schedules for the first time (``NewRequestData``). A
    tuple, packed as the array it is: the step is packed once per engine step,
    so its rows cost no more than the lists they replace."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: StepSampling
    block_ids: list[int]
    num_computed_tokens: int
    lora_name: str | None = None
    lora_path: str | None = None
    lora_id: int = 0


class StepCached(NamedTuple):
    """A request a step continues (``CachedRequestData``)."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


_tuple_new = tuple.__new__
"""Builds a row's carrier from the checked list without another pass over its fields."""


def _new_rows(rows: Any) -> list[StepRequest]:
    out: list[StepRequest] = []
    append = out.append
    for row in _list(rows, "step new requests"):
        # Exact types (``type(x) is int`` also refuses a bool), one test each: a
        # step carries every running request, so this loop is on every step's path.
        if type(row) is not list or len(row) != 9:
            raise ValueError("malformed step request: not a list of 9 items")
        rid, prompt, output, sampling, blocks, computed, name, path, lid = row
        if (
            type(rid) is not str
            or type(prompt) is not list
            or type(output) is not list
            or type(blocks) is not list
            or type(computed) is not int
            or not (name is None or type(name) is str)
            or not (path is None or type(path) is str)
            or type(lid) is not int
        ):
            raise ValueError(
                "malformed step request: not [req_id, prompt_token_ids, output_token_ids, "
                "sampling, block_ids, num_computed_tokens, lora_name, lora_path, lora_id]"
            )
        row[3] = StepSampling.from_wire(sampling)
        append(_tuple_new(StepRequest, row))
    return out


def _cached_rows(rows: Any) -> list[StepCached]:
    out: list[StepCached] = []
    append = out.append
    for row in _list(rows, "step cached requests"):
        if type(row) is not list or len(row) != 3:
            raise ValueError("malformed cached request: not a list of 3 items")
        rid, blocks, computed = row
        if type(rid) is not str or type(blocks) is not list or type(computed) is not int:
            raise ValueError(
                "malformed cached request: not [req_id, new_block_ids, num_computed_tokens]"
            )
        append(_tuple_new(StepCached, row))
    return out


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step, as every rank runs it."""

    new: list[StepRequest]
    cached: list[StepCached]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished: list[str]
    """Request ids finished since the last step (sorted)."""
    commands: list[RankCommand]
    """For the ranks' KV shard agents."""

    def encode(self) -> bytes:
        return _pack(
            [
                # A row's sampling goes as its map; the rest of the row as it is.
                [[*r[:3], r.sampling.to_wire(), *r[4:]] for r in self.new],
                self.cached,
                self.num_scheduled_tokens,
                self.total_num_scheduled_tokens,
                self.finished,
                encode_rank_commands(self.commands) if self.commands else None,
            ]
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Step:
        new, cached, num, total, finished, commands = _row(_unpack(data, "step"), 6, "step")
        return cls(
            _new_rows(new),
            _cached_rows(cached),
            _map(num, "step num_scheduled_tokens"),
            _int(total, "step total_num_scheduled_tokens"),
            _list(finished, "step finished"),
            decode_rank_commands(_list(commands or [], "step commands")),
        )


class StepLogprobs(NamedTuple):
    """``Logprobs``: the top token ids, their logprobs, the sampled token's rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


def _lps(row: Any) -> StepLogprobs:
    if type(row) is not list or len(row) != 3:
        raise ValueError("malformed logprobs: not a list of 3 items")
    if type(row[0]) is not list or type(row[1]) is not list or type(row[2]) is not int:
        raise ValueError("malformed logprobs: not [token_ids, logprobs, rank]")
    return _tuple_new(StepLogprobs, row)


class StepLoRA(NamedTuple):
    """Rank 0's LoRA caches after a step (``lora/manager.py``'s ``LoRAStats``):
    every rank's evolve alike (the same steps, the same loads)."""

    loads: int
    load_seconds: float
    cpu_evictions: int
    gpu_evictions: int
    slot_loads: int
    loaded: list[str]
    cached: list[str]
    resident: dict[str, str]


def _step_lora(row: Any) -> StepLoRA:
    loads, seconds, cpu, gpu, slots, loaded, cached, resident = _row(row, 8, "step LoRA stats")
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise ValueError("malformed step LoRA stats: load_seconds is not a number")
    return StepLoRA(
        _int(loads, "step LoRA loads"),
        float(seconds),
        _int(cpu, "step LoRA cpu_evictions"),
        _int(gpu, "step LoRA gpu_evictions"),
        _int(slots, "step LoRA slot_loads"),
        [_str(x, "step LoRA loaded") for x in _list(loaded, "step LoRA loaded")],
        [_str(x, "step LoRA cached") for x in _list(cached, "step LoRA cached")],
        {
            _str(k, "step LoRA resident"): _str(v, "step LoRA resident")
            for k, v in _map(resident, "step LoRA resident").items()
        },
    )


@dataclass(frozen=True, slots=True)
class StepResult:
    """What rank 0 answers a step with (``ModelRunnerOutput``)."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, StepLogprobs]
    prompt_logprobs: dict[str, list[StepLogprobs | None]]
    finished_sending: list[str]
    finished_recving: list[str]
    failed_recving: list[str]
    forward_seconds: float
    failed_requests: dict[str, str] = field(default_factory=dict)
    """req_id -> why it could not run (its LoRA adapter could not be read)."""
    lora: StepLoRA | None = None
    """Rank 0's LoRA caches (engines with --enable-lora; else nil, or absent)."""

    def encode(self) -> bytes:
        row = [
            self.sampled_token_ids,
            self.logprobs,
            self.prompt_logprobs,
            self.finished_sending,
            self.finished_recving,
            self.failed_recving,
            self.forward_seconds,
            self.failed_requests,
        ]
        if self.lora is not None:
            row.append(list(self.lora))
        return _pack(row)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> StepResult:
        wire = _unpack(data, "step result")
        lora = None
        if isinstance(wire, list) and len(wire) == 9:
            lora = _step_lora(wire.pop())
        sampled, lps, prompt_lps, sending, recving, failed, seconds, failures = _row(
            wire, 8, "step result"
        )
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise ValueError("malformed step result: forward_seconds is not a number")
        return cls(
            _map(sampled, "sampled_token_ids"),
            {k: _lps(v) for k, v in _map(lps, "logprobs").items()},
            {
                k: [None if x is None else _lps(x) for x in _list(v, "prompt logprobs")]
                for k, v in _map(prompt_lps, "prompt_logprobs").items()
            },
            _list(sending, "finished_sending"),
            _list(recving, "finished_recving"),
            _list(failed, "failed_recving"),
            float(seconds),
            {
                _str(k, "failed_requests"): _str(v, "failed_requests")
                for k, v in _map(failures, "failed_requests").items()
            },
            lora,
        )


@dataclass(frozen=True, slots=True)
class KVAgentSpec:
    """How each rank process sets up its own KV shard's transfer agent
    (``kv_transfer/nixl_shard.ShardAgent``): its name prefix, its backends,
    whether it reports its ended reads each step (a consumer's)."""

    name: str
    backends: list[str]
    report: bool

    @staticmethod
    def encode(spec: KVAgentSpec | None) -> bytes:
        """The store record: a map, or nil without a connector's agent."""
        if spec is None:
            return _pack(None)
        return _pack({"name": spec.name, "backends": spec.backends, "report": spec.report})

    @classmethod
    def decode(cls, data: bytes | memoryview) -> KVAgentSpec | None:
        wire = _unpack(data, "KV agent spec")
        if wire is None:
            return None
        wire = _map(wire, "KV agent spec")
        backends = _list(wire.get("backends"), "KV agent backends")
        if not all(isinstance(b, str) for b in backends):
            raise ValueError("malformed KV agent backends: not strings")
        report = wire.get("report")
        if not isinstance(report, bool):
            raise ValueError("malformed KV agent report: not a boolean")
        return cls(_str(wire.get("name"), "KV agent name"), backends, report)


@dataclass(frozen=True, slots=True)
class RankReady:
    """A rank that loaded its shard: its KV blocks, the longest sequence they
    hold, and (with a connector's agent) its KV shard's agent info and layout."""

    num_blocks: int
    max_model_len: int
    shard_info: ShardInfo | None = None
    layout: dict[str, Any] | None = None

    def encode(self) -> bytes:
        info = None if self.shard_info is None else self.shard_info.to_wire()
        return _pack([self.num_blocks, self.max_model_len, info, self.layout])

    @classmethod
    def from_wire(cls, wire: Any) -> RankReady:
        blocks, max_len, info, layout = _row(wire, 4, "ready message")
        return cls(
            _int(blocks, "ready num_blocks"),
            _int(max_len, "ready max_model_len"),
            None if info is None else ShardInfo.from_wire(info, "ready shard info"),
            None if layout is None else _map(layout, "ready layout"),
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RankReady:
        return cls.from_wire(_unpack(data, "ready message"))


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """A LoRA adapter every rank reads its shard of, now: the main process
    read and checked the whole of it, and ``digest`` is the sha256 of the
    bytes it read (a rank that reads other bytes refuses the load)."""

    lora_name: str
    lora_id: int
    lora_path: str
    digest: str

    def encode(self) -> bytes:
        return _pack([self.lora_name, self.lora_id, self.lora_path, self.digest])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> LoRALoad:
        name, lora_id, path, digest = _row(_unpack(data, "LoRA load"), 4, "LoRA load")
        return cls(
            _str(name, "LoRA load lora_name"),
            _int(lora_id, "LoRA load lora_id"),
            _str(path, "LoRA load lora_path"),
            _str(digest, "LoRA load digest"),
        )


def encode_lora_drop(lora_id: int, keep: bool = False) -> bytes:
    return _pack([lora_id, keep])


def decode_lora_drop(data: bytes | memoryview) -> tuple[int, bool]:
    """``(lora_id, keep)``: keep its shards while requests admitted by the
    main process still need it (dropped by a later ``keep`` false)."""
    lora_id, keep = _row(_unpack(data, "LoRA drop"), 2, "LoRA drop")
    if not isinstance(keep, bool):
        raise ValueError("malformed LoRA drop: keep is not a bool")
    return _int(lora_id, "LoRA drop lora_id"), keep


def lora_status(error: str | None) -> bytes:
    """A rank's answer to a :class:`LoRALoad`: :data:`LORA_STATUS_BYTES`
    bytes, the error text (cut to fit) then zeros; all zeros: loaded."""
    raw = (error or "").encode()[: LORA_STATUS_BYTES - 1]
    if error and not raw:
        raw = b"?"
    return raw.ljust(LORA_STATUS_BYTES, b"\0")


def lora_status_error(status: bytes) -> str | None:
    """The error of a :func:`lora_status` answer; None: loaded."""
    if len(status) != LORA_STATUS_BYTES:
        raise ValueError(f"malformed LoRA status: {len(status)} bytes, not {LORA_STATUS_BYTES}")
    text = status.rstrip(b"\0")
    return text.decode(errors="replace") if text else None


@dataclass(frozen=True, slots=True)
class RankFailure:
    """A headless rank that failed to start, as its store record says."""

    error: str

    def encode(self) -> bytes:
        return _pack({"error": self.error[:MAX_ERROR_CHARS]})


def ready_record(data: bytes | memoryview) -> RankReady | RankFailure:
    """A headless rank's store record (:data:`READY_KEY`)."""
    wire = _unpack(data, "ready record")
    if isinstance(wire, dict):
        return RankFailure(str(wire.get("error"))[:MAX_ERROR_CHARS])
    return RankReady.from_wire(wire)


def rank_message(tag: bytes, body: bytes = b"") -> bytes:
    """One message on a rank's pipe: the tag byte, then the body."""
    if tag not in (READY, RESULT, ERROR):
        raise ValueError(f"unknown rank message tag {tag!r}")
    return tag + body


def rank_error(detail: str) -> bytes:
    """An :data:`ERROR` message: why the rank failed."""
    return rank_message(ERROR, detail[:MAX_ERROR_CHARS].encode())


def read_rank_message(msg: bytes) -> tuple[bytes, bytes]:
    """(tag, body) of a pipe message; ValueError for an unknown tag."""
    tag = msg[:1]
    if tag not in (READY, RESULT, ERROR):
        raise ValueError(f"unknown rank message tag {tag!r}")
    return tag, msg[1:]


def error_text(body: bytes) -> str:
    """The detail of an :data:`ERROR` message's body."""
    return body[:MAX_ERROR_CHARS].decode(errors="replace")
