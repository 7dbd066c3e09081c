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
from typing import Any, ClassVar, Literal

from ...engine.config.fields import ConfigValueError, coerce, resolved_fields
from .rules import BOUNDS, Bound, NotBelow, SpecValueError, check_section, spec_key

__all__ = [
    "AutoscalingSpec",
    "DecodeScaling",
    "PrefillScaling",
    "RatioBounds",
    "RoleScaling",
    "SpecValueError",
    "spec_key",
]

POSITIVE = (Bound(">", 0),)
AT_LEAST_ONE = (Bound(">=", 1),)
NOT_NEGATIVE = (Bound(">=", 0),)
FRACTION = (Bound(">", 0), Bound("<=", 1))


def bounded(default: Any, bounds: tuple[Bound, ...], **metadata: Any) -> Any:
    """A field with a default and constant bounds (checked by ``validate()`` and
    emitted as the CRD's minimum/maximum)."""
    return field(default=default, metadata={BOUNDS: bounds, **metadata})


@dataclass
class RatioBounds:
    """Bounds on the ratio prefill replicas : decode replicas."""

    RULES: ClassVar[tuple[NotBelow, ...]] = (NotBelow("max", ("min",)),)

    min: float | None = bounded(None, POSITIVE)
    """Lowest allowed prefill/decode replica ratio (e.g. 0.25 for 1:4); null for
    no lower bound. When the roles' own recommendations fall below it, prefill
    is raised (or decode lowered when prefill is at its maximum)."""
    max: float | None = bounded(None, POSITIVE)
    """Highest allowed prefill/decode replica ratio (e.g. 4 for 4:1); null for
    no upper bound. When exceeded, decode is raised (or prefill lowered when
    decode is at its maximum)."""


@dataclass
class RoleScaling:
    """Bounds and pacing shared by both roles."""

    RULES: ClassVar[tuple[NotBelow, ...]] = (NotBelow("max_replicas", ("min_replicas",)),)

    min_replicas: int = bounded(1, NOT_NEGATIVE)
    """Fewest replicas of this role. 0 lets the role scale to zero once it has
    been idle for scaleToZeroAfterSeconds; a request arriving then is held by
    the gateway (decode) or served decode-only (prefill), and the gateway's
    activation signal brings one replica back (docs/autoscaling.md)."""
    max_replicas: int = bounded(4, AT_LEAST_ONE)
    """Most replicas of this role."""
    target_waiting_per_replica: float = bounded(4, POSITIVE)
    """Requests allowed to wait (queued, not yet running) per replica."""
    scale_up_stabilization_seconds: float = bounded(0, NOT_NEGATIVE)
    """Window over which scale-up takes the lowest recommendation (0: act on
    the latest one at once)."""
    scale_down_stabilization_seconds: float = bounded(90, NOT_NEGATIVE)
    """Window over which scale-down takes the highest recommendation: replicas
    are removed only after the load has stayed low for this long. The policy
    sizes from models with their own margins (and a scale-down keeps a few
    percent of headroom), so this window only has to outlast the load's
    noise, not the whole variability of a metric against a fixed target."""
    max_scale_up_step: int = bounded(4, AT_LEAST_ONE)
    """Most replicas added in one period."""
    max_scale_down_step: int = bounded(1, AT_LEAST_ONE)
    """Most replicas removed in one period."""
    scale_to_zero_after_seconds: float = bounded(300, POSITIVE)
    """With minReplicas 0: seconds without any request arriving, queued or
    running on the role after which it goes to zero replicas."""


@dataclass
class PrefillScaling(RoleScaling):
    """Prefill scales on a queueing model of its TTFT: the fewest replicas
    at which, at the forecast arrival rate and the measured service time per
    request, few enough requests wait past the TTFT objective; more while a
    queue beyond what the model expects drains. Engines without the
    service-time series scale on their waiting queue."""

    ttft_target_seconds: float = bounded(2.0, POSITIVE)
    """Time-to-first-token objective in seconds. The prefill queueing model
    sizes for it, less decode's first step and a small reserve for the KV
    transfer and the gateway."""
    prefill_tokens_per_second: float | None = bounded(None, POSITIVE)
    """Prompt tokens per second one prefill replica processes, used until the
    engines' metrics have measured it (prompt tokens processed / busy prefill
    seconds). null: until measured, prefill scales on its waiting queue and
    busy time only."""


@dataclass
class DecodeScaling(RoleScaling):
    """Decode scales on the KV its requests hold, summed over its replicas:
    each replica runs at the KV usage at which its step time (fitted to the
    replicas' measured inter-token latency against their KV usage) meets the
    ITL target, at most targetKVCacheUsage; queued requests add the KV they
    would hold."""

    itl_target_seconds: float = bounded(0.05, POSITIVE)
    """Inter-token latency objective in seconds (a request's mean gap between
    output tokens). The policy keeps each decode replica's step time under
    it, with a small margin."""
    target_kv_cache_usage: float = bounded(0.7, FRACTION, key="targetKVCacheUsage")
    """The most of each decode replica's KV cache (0 to 1) the policy plans to
    fill, whatever the ITL target allows: room for the requests admitted
    before the next replica serves."""


@dataclass
class AutoscalingSpec:
    """Autoscaling of the prefill and decode roles from live engine metrics."""

    RULES: ClassVar[tuple[NotBelow, ...]] = (
        NotBelow("metrics_stale_seconds", ("period_seconds",), "a sample is one period old"),
        NotBelow("max_total_replicas", ("prefill.min_replicas", "decode.min_replicas")),
    )

    mode: Literal["Active", "Advisory"] = "Active"
    """Active: the autoscaler sets the roles' replicas. Advisory: it computes
    and reports every decision (status.autoscaling, Kubernetes events, its
    metrics, pdfleet up's log and fleet.json) and changes nothing, so its
    decisions can be judged before it is trusted."""
    period_seconds: float = bounded(15, POSITIVE)
    """Seconds between two decisions (and two metric scrapes)."""
    max_total_replicas: int | None = bounded(None, AT_LEAST_ONE)
    """Budget on prefill + decode replicas together; null for none."""
    prefill_decode_ratio: RatioBounds = field(default_factory=RatioBounds)
    """Guardrail on prefill replicas : decode replicas."""
    metrics_stale_seconds: float = bounded(45, POSITIVE)
    """A replica whose latest sample is older than this counts as having no
    metrics; while any ready replica of a role has none, the role does not
    scale down."""
    activation_timeout_seconds: float = bounded(120, POSITIVE)
    """With decode at minReplicas 0: seconds the gateway holds a request while
    the decode pool comes back from zero (about one cold start) before it
    answers 503 with Retry-After."""
    prefill: PrefillScaling = field(default_factory=PrefillScaling)
    """Scaling of the prefill role."""
    decode: DecodeScaling = field(default_factory=DecodeScaling)
    """Scaling of the decode role."""

    def __post_init__(self) -> None:
        self.validate()

    def gateway_settings(self) -> dict[str, Any]:
        """GatewayConfig fields this section implies: with decode able to scale
        to zero, /health stays up without an engine and requests are held for
        ``activationTimeoutSeconds``."""
        if self.decode.min_replicas > 0:
            return {}
        return {"scale_to_zero": True, "hold_timeout": self.activation_timeout_seconds}

    def role(self, name: str) -> RoleScaling:
        """The section of ``name`` (prefill or decode)."""
        if name not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {name!r}")
        return self.prefill if name == "prefill" else self.decode

    def validate(self) -> None:
        """Raise :class:`SpecValueError` (a ``ValueError``) naming the offending key
        if a value breaks a field's bounds or a cross-field rule (``RULES``)."""
        check_section(self, "autoscaling")

    @classmethod
    def from_spec(cls, data: dict[str, Any] | None) -> AutoscalingSpec:
        """Build from the resource's camelCase section; unknown keys and bad values
        raise ``ValueError`` naming the key (``autoscaling.decode.maxReplicas``)."""
        spec: AutoscalingSpec = _from_camel(cls, data or {}, "autoscaling")
        return spec

    def to_spec(self) -> dict[str, Any]:
        """The camelCase section (all keys, defaults included)."""
        return _to_camel(self)


def _from_camel(cls: type, data: Any, root: str, prefix: str = "") -> Any:
    """``null`` means unset (the field's default), as on the API server."""
    if not isinstance(data, dict):
        raise SpecValueError(root, prefix.rstrip("."), f"expected an object, got {data!r}")
    fields = {spec_key(f): (f, tp) for f, tp in resolved_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problem = f"unknown setting{hint}; known: {', '.join(sorted(fields))}"
            raise SpecValueError(root, f"{prefix}{key}", problem)
        if value is None:
            continue
        f, tp = fields[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[f.name] = _from_camel(tp, value, root, f"{prefix}{key}.")
            continue
        try:
            kwargs[f.name] = coerce(tp, value, key)
        except ConfigValueError as e:
            raise SpecValueError(root, f"{prefix}{key}", str(e).removeprefix(f"{key}: ")) from None
    return cls(**kwargs)


def _to_camel(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[spec_key(f)] = _to_camel(value) if dataclasses.is_dataclass(value) else value
    return out
