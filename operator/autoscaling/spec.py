"""The ``autoscaling`` section of an InferenceService, as pydantic models.

The same schema system as the rest of the resource
(:class:`pdfleet.operator.spec_model.SpecModel`): attributes are snake_case,
keys their camelCase form (``min_replicas`` <-> ``minReplicas``) unless an
alias names the key (``targetKVCacheUsage``); constant bounds are ``Field``
constraints (the CRD's ``minimum``/``maximum``); cross-field checks are model
validators, with their CEL twins in :mod:`pdfleet.operator.crd`. Every field
carries an attribute docstring: the CRD is generated from these classes, so
the docstring is what ``kubectl explain`` prints.

Durations are seconds; replica counts are whole replicas of one role.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from ..engine_spec import FieldPathError
from ..spec_model import SpecModel, format_validation_error

__all__ = [
    "AutoscalingSpec",
    "DecodeScaling",
    "PrefillScaling",
    "RatioBounds",
    "RoleScaling",
]


def _not_below(
    value: float | None, floor: float | None, key: str, names: str, why: str = ""
) -> None:
    """``value >= floor`` unless either is unset; else a problem naming ``key``."""
    if value is None or floor is None or value >= floor:
        return
    tail = f" ({why})" if why else ""
    raise FieldPathError(key, f"must be at least {names} ({floor:g}), got {value:g}{tail}")


class RatioBounds(SpecModel):
    """Bounds on the ratio prefill replicas : decode replicas."""

    min: float | None = Field(default=None, gt=0)
    """Lowest allowed prefill/decode replica ratio (e.g. 0.25 for 1:4); null for
    no lower bound. When the roles' own recommendations fall below it, prefill
    is raised (or decode lowered when prefill is at its maximum)."""
    max: float | None = Field(default=None, gt=0)
    """Highest allowed prefill/decode replica ratio (e.g. 4 for 4:1); null for
    no upper bound. When exceeded, decode is raised (or prefill lowered when
    decode is at its maximum)."""

    @model_validator(mode="after")
    def _max_not_below_min(self) -> RatioBounds:
        _not_below(self.max, self.min, "max", "min")
        return self


class RoleScaling(SpecModel):
    """Bounds and pacing shared by both roles."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas of this role. 0 lets the role scale to zero once it has
    been idle for scaleToZeroAfterSeconds; a request arriving then is held by
    the gateway (decode) or served decode-only (prefill), and the gateway's
    activation signal brings one replica back (docs/autoscaling.md)."""
    max_replicas: int = Field(default=4, ge=1)
    """Most replicas of this role."""
    target_waiting_per_replica: float = Field(default=4, gt=0)
    """Requests allowed to wait (queued, not yet running) per replica."""
    scale_up_stabilization_seconds: float = Field(default=0, ge=0)
    """Window over which scale-up takes the lowest recommendation (0: act on
    the latest one at once)."""
    scale_down_stabilization_seconds: float = Field(default=90, ge=0)
    """Window over which scale-down takes the highest recommendation: replicas
    are removed only after the load has stayed low for this long. The policy
    sizes from models with their own margins (and a scale-down keeps a few
    percent of headroom), so this window only has to outlast the load's
    noise, not the whole variability of a metric against a fixed target."""
    max_scale_up_step: int = Field(default=4, ge=1)
    """Most replicas added in one period."""
    max_scale_down_step: int = Field(default=1, ge=1)
    """Most replicas removed in one period."""
    scale_to_zero_after_seconds: float = Field(default=300, gt=0)
    """With minReplicas 0: seconds without any request arriving, queued or
    running on the role after which it goes to zero replicas."""

    @model_validator(mode="after")
    def _max_not_below_min(self) -> RoleScaling:
        _not_below(self.max_replicas, self.min_replicas, "maxReplicas", "minReplicas")
        return self


class PrefillScaling(RoleScaling):
    """Prefill scales on a queueing model of its TTFT: the fewest replicas
    at which, at the forecast arrival rate and the measured service time per
    request, few enough requests wait past the TTFT objective; more while a
    queue beyond what the model expects drains. Engines without the
    service-time series scale on their waiting queue."""

    ttft_target_seconds: float = Field(default=2.0, gt=0)
    """Time-to-first-token objective in seconds. The prefill queueing model
    sizes for it, less decode's first step and a small reserve for the KV
    transfer and the gateway."""
    prefill_tokens_per_second: float | None = Field(default=None, gt=0)
    """Prompt tokens per second one prefill replica processes, used until the
    engines' metrics have measured it (prompt tokens processed / busy prefill
    seconds). null: until measured, prefill scales on its waiting queue and
    busy time only."""


class DecodeScaling(RoleScaling):
    """Decode scales on the KV its requests hold, summed over its replicas:
    each replica runs at the KV usage at which its step time (fitted to the
    replicas' measured inter-token latency against their KV usage) meets the
    ITL target, at most targetKVCacheUsage; queued requests add the KV they
    would hold."""

    itl_target_seconds: float = Field(default=0.05, gt=0)
    """Inter-token latency objective in seconds (a request's mean gap between
    output tokens). The policy keeps each decode replica's step time under
    it, with a small margin."""
    target_kv_cache_usage: float = Field(default=0.7, gt=0, le=1, alias="targetKVCacheUsage")
    """The most of each decode replica's KV cache (0 to 1) the policy plans to
    fill, whatever the ITL target allows: room for the requests admitted
    before the next replica serves."""


class AutoscalingSpec(SpecModel):
    """Autoscaling of the prefill and decode roles from live engine metrics."""

    mode: Literal["Active", "Advisory"] = "Active"
    """Active: the autoscaler sets the roles' replicas. Advisory: it computes
    and reports every decision (status.autoscaling, Kubernetes events, its
    metrics, pdfleet up's log and fleet.json) and changes nothing, so its
    decisions can be judged before it is trusted."""
    period_seconds: float = Field(default=15, gt=0)
    """Seconds between two decisions (and two metric scrapes)."""
    max_total_replicas: int | None = Field(default=None, ge=1)
    """Budget on prefill + decode replicas together; null for none."""
    prefill_decode_ratio: RatioBounds = Field(default_factory=RatioBounds)
    """Guardrail on prefill replicas : decode replicas."""
    metrics_stale_seconds: float = Field(default=45, gt=0)
    """A replica whose latest sample is older than this counts as having no
    metrics; while any ready replica of a role has none, the role does not
    scale down."""
    activation_timeout_seconds: float = Field(default=120, gt=0)
    """With decode at minReplicas 0: seconds the gateway holds a request while
    the decode pool comes back from zero (about one cold start) before it
    answers 503 with Retry-After."""
    prefill: PrefillScaling = Field(default_factory=PrefillScaling)
    """Scaling of the prefill role."""
    decode: DecodeScaling = Field(default_factory=DecodeScaling)
    """Scaling of the decode role."""

    @model_validator(mode="after")
    def _cross_field(self) -> AutoscalingSpec:
        _not_below(
            self.metrics_stale_seconds,
            self.period_seconds,
            "metricsStaleSeconds",
            "periodSeconds",
            "a sample is one period old",
        )
        _not_below(
            self.max_total_replicas,
            self.prefill.min_replicas + self.decode.min_replicas,
            "maxTotalReplicas",
            "prefill.minReplicas + decode.minReplicas",
        )
        return self

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

    @classmethod
    def from_spec(cls, data: dict[str, Any] | None) -> AutoscalingSpec:
        """Build from the resource's camelCase section; unknown keys and bad values
        raise ``ValueError`` naming the key (``autoscaling.decode.maxReplicas: ...``)."""
        try:
            return cls.model_validate(data or {}, by_name=False)
        except ValidationError as e:
            raise ValueError(format_validation_error(e, "autoscaling", cls)) from None

    def to_spec(self) -> dict[str, Any]:
        """The camelCase section (all keys, defaults included)."""
        return self.model_dump(by_alias=True)
