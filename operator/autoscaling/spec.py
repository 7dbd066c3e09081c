"""The ``autoscaling`` section of an InferenceService, as typed dataclasses.

Attributes are snake_case; the resource's keys are their camelCase form
(``min_replicas`` <-> ``minReplicas``), except where a field's metadata names
the key (``targetKVCacheUsage``). Every field carries an attribute docstring:
the CRD schema is generated from these classes, so the docstring is what
``kubectl explain`` prints.

Durations are seconds; replica counts are whole replicas of one role.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from pdfleet.engine.config.fields import ConfigValueError, coerce, resolved_fields


def spec_key(f: dataclasses.Field) -> str:
    """The resource key of a dataclass field (camelCase unless metadata names it)."""
    if "key" in f.metadata:
        return f.metadata["key"]
    head, *rest = f.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclass
class RatioBounds:
    """Bounds on the ratio prefill replicas : decode replicas."""

    min: float | None = None
    """Lowest allowed prefill/decode replica ratio (e.g. 0.25 for 1:4); null for
    no lower bound. When the roles' own recommendations fall below it, prefill
    is raised (or decode lowered when prefill is at its maximum)."""
    max: float | None = None
    """Highest allowed prefill/decode replica ratio (e.g. 4 for 4:1); null for
    no upper bound. When exceeded, decode is raised (or prefill lowered when
    decode is at its maximum)."""


@dataclass
class RoleScaling:
    """Bounds and pacing shared by both roles."""

    min_replicas: int = 1
    """Fewest replicas of this role (at least 1: with no replica there is no
    metric to scale up from)."""
    max_replicas: int = 4
    """Most replicas of this role."""
    target_waiting_per_replica: float = 4
    """Requests allowed to wait (queued, not yet running) per replica."""
    scale_up_stabilization_seconds: float = 0
    """Window over which scale-up takes the lowest recommendation (0: act on
    the latest one at once)."""
    scale_down_stabilization_seconds: float = 300
    """Window over which scale-down takes the highest recommendation: replicas
    are removed only after the load has stayed low for this long."""
    max_scale_up_step: int = 4
    """Most replicas added in one period."""
    max_scale_down_step: int = 1
    """Most replicas removed in one period."""


@dataclass
class PrefillScaling(RoleScaling):
    """Prefill scales on its backlog: queued uncached prompt tokens divided by
    the prompt tokens per second one replica processes, against a target
    derived from the TTFT objective; and on its waiting queue."""

    ttft_target_seconds: float = 2.0
    """Time-to-first-token objective in seconds. Half of it is the backlog
    (seconds of queued prefill work per replica) the policy allows before
    adding replicas; the other half is left for the request's own prefill,
    the KV transfer and the first decode step."""
    prefill_tokens_per_second: float | None = None
    """Prompt tokens per second one prefill replica processes, used until the
    engines' metrics have measured it (prompt tokens processed / busy prefill
    seconds). null: until measured, prefill scales on its waiting queue and
    busy time only."""


@dataclass
class DecodeScaling(RoleScaling):
    """Decode scales on KV-cache usage summed over its replicas (not averaged),
    against a per-replica target; queued requests beyond
    `targetWaitingPerReplica` count as KV demand at the measured KV share of a
    running request."""

    target_kv_cache_usage: float = field(default=0.7, metadata={"key": "targetKVCacheUsage"})
    """Fraction of each decode replica's KV cache (0 to 1) the policy aims to
    fill; desired replicas = total usage over all replicas / this target."""


@dataclass
class AutoscalingSpec:
    """Autoscaling of the prefill and decode roles from live engine metrics."""

    period_seconds: float = 15
    """Seconds between two decisions (and two metric scrapes)."""
    max_total_replicas: int | None = None
    """Budget on prefill + decode replicas together; null for none."""
    prefill_decode_ratio: RatioBounds = field(default_factory=RatioBounds)
    """Guardrail on prefill replicas : decode replicas."""
    metrics_stale_seconds: float = 45
    """A replica whose latest sample is older than this counts as having no
    metrics; while any ready replica of a role has none, the role does not
    scale down."""
    prefill: PrefillScaling = field(default_factory=PrefillScaling)
    """Scaling of the prefill role."""
    decode: DecodeScaling = field(default_factory=DecodeScaling)
    """Scaling of the decode role."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending key if a value is out of range."""
        path = "autoscaling"
        if self.period_seconds <= 0:
            raise ValueError(f"{path}.periodSeconds must be > 0, got {self.period_seconds}")
        if self.metrics_stale_seconds < self.period_seconds:
            raise ValueError(
                f"{path}.metricsStaleSeconds ({self.metrics_stale_seconds:g}) must be at least "
                f"periodSeconds ({self.period_seconds:g}): a sample is at least one period old"
            )
        for role in ("prefill", "decode"):
            _validate_role(getattr(self, role), f"{path}.{role}")
        if self.prefill.ttft_target_seconds <= 0:
            raise ValueError(
                f"{path}.prefill.ttftTargetSeconds must be > 0, got {self.prefill.ttft_target_seconds}"
            )
        rate = self.prefill.prefill_tokens_per_second
        if rate is not None and rate <= 0:
            raise ValueError(
                f"{path}.prefill.prefillTokensPerSecond must be > 0 or null, got {rate}"
            )
        if not 0 < self.decode.target_kv_cache_usage <= 1:
            raise ValueError(
                f"{path}.decode.targetKVCacheUsage must be in (0, 1], "
                f"got {self.decode.target_kv_cache_usage}"
            )
        lo, hi = self.prefill_decode_ratio.min, self.prefill_decode_ratio.max
        for name, value in (("min", lo), ("max", hi)):
            if value is not None and value <= 0:
                raise ValueError(f"{path}.prefillDecodeRatio.{name} must be > 0, got {value}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"{path}.prefillDecodeRatio.min ({lo:g}) must not exceed "
                f"prefillDecodeRatio.max ({hi:g})"
            )
        budget = self.max_total_replicas
        floor = self.prefill.min_replicas + self.decode.min_replicas
        if budget is not None and budget < floor:
            raise ValueError(
                f"{path}.maxTotalReplicas ({budget}) must be at least prefill.minReplicas + "
                f"decode.minReplicas ({floor})"
            )

    @classmethod
    def from_spec(cls, data: dict[str, Any] | None) -> AutoscalingSpec:
        """Build from the resource's camelCase section; unknown keys and bad values
        raise ``ValueError`` naming the key (``autoscaling.decode.maxReplicas``)."""
        return _from_camel(cls, data or {}, "autoscaling")

    def to_spec(self) -> dict[str, Any]:
        """The camelCase section (all keys, defaults included)."""
        return _to_camel(self)


def _validate_role(role: RoleScaling, path: str) -> None:
    if role.min_replicas < 1:
        raise ValueError(f"{path}.minReplicas must be >= 1, got {role.min_replicas}")
    if role.max_replicas < role.min_replicas:
        raise ValueError(
            f"{path}.maxReplicas ({role.max_replicas}) must be >= minReplicas ({role.min_replicas})"
        )
    if role.target_waiting_per_replica <= 0:
        raise ValueError(
            f"{path}.targetWaitingPerReplica must be > 0, got {role.target_waiting_per_replica}"
        )
    for name in ("scale_up_stabilization_seconds", "scale_down_stabilization_seconds"):
        if getattr(role, name) < 0:
            key = spec_key(next(f for f in dataclasses.fields(role) if f.name == name))
            raise ValueError(f"{path}.{key} must be >= 0, got {getattr(role, name)}")
    if role.max_scale_up_step < 1:
        raise ValueError(f"{path}.maxScaleUpStep must be >= 1, got {role.max_scale_up_step}")
    if role.max_scale_down_step < 1:
        raise ValueError(f"{path}.maxScaleDownStep must be >= 1, got {role.max_scale_down_step}")


def _from_camel(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object, got {data!r}")
    fields = {spec_key(f): (f, tp) for f, tp in resolved_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"{path}.{key}: unknown setting{hint}; known: {', '.join(sorted(fields))}"
            )
        f, tp = fields[key]
        if dataclasses.is_dataclass(tp) and value is not None:
            kwargs[f.name] = _from_camel(tp, value, f"{path}.{key}")
            continue
        try:
            kwargs[f.name] = coerce(tp, value, f"{path}.{key}")
        except ConfigValueError as e:
            raise ValueError(str(e)) from None
    return cls(**kwargs)


def _to_camel(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[spec_key(f)] = _to_camel(value) if dataclasses.is_dataclass(value) else value
    return out
