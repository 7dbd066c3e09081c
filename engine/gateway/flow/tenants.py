"""Tenants: who a request's API key belongs to and what that tenant may do.

By default every API key is its own tenant with weight 1, priority 0 and no
limits, so keys share the fleet fairly without any configuration. A tenants
file (``--tenants-file``, JSON or YAML; in Kubernetes a Secret or ConfigMap
named in ``spec.gateway.tenants``) groups keys into named tenants and sets
their weight, priority band, limits and cache sharing (docs/flow-control.md).
The file is read at start; a file that does not parse is an error naming the
entry and the field, never a silently open gateway.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import yaml

from ...contracts.priority import BATCH_BAND as BATCH_BAND  # where the tests look
from ...contracts.priority import MAX_BAND
from ...contracts.security import caller_id

ClientPriority = Literal["refuse", "allow"]
# The tenant of requests without an API key (a gateway without keys).
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class TenantPolicy:
    """What one tenant may do; ``None`` limits are unlimited."""

    weight: float = 1.0
    """Share of the fleet within its band, by tokens (prompt + n × max_tokens)."""
    priority: int = 0
    """Priority band: a lower value is served first (vLLM's convention); bands
    are strict, fair share applies within one."""
    max_inflight_requests: int | None = None
    """Requests the tenant may have on engines at once; more get a 429."""
    max_inflight_tokens: int | None = None
    """Tokens (cost) the tenant may have on engines at once; more get a 429."""
    max_queued: int | None = None
    """Requests the tenant may have waiting for a slot at once; more get a 429."""
    requests_per_second: float | None = None
    """Sustained request rate (burst: one second's worth, at least 1); faster: 429."""
    tokens_per_second: float | None = None
    """Sustained token rate (cost per second, burst one second's worth); faster: 429."""
    share_cache: bool = True
    """False: the tenant's requests carry its own ``cache_salt``, so its prompts
    never hit (or time) prefix-cache blocks another tenant computed."""
    client_priority: ClientPriority = "refuse"
    """A client's own non-zero ``priority``: `refuse` (400 naming it) or `allow`
    (it replaces the tenant's band)."""
    max_n: int | None = None
    """Per-request cap on `n` and `best_of` for this tenant (400 naming the field);
    None: the gateway's --max-n."""
    max_request_output_tokens: int | None = None
    """Per-request cap on n × max_tokens for this tenant (400 naming
    `max_tokens`); None: the gateway's --max-request-output-tokens."""

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, int | float) and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a number, got {self.weight!r}")
        if self.weight <= 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not -MAX_BAND <= self.priority <= MAX_BAND:
            raise ValueError(f"priority must be within ±{MAX_BAND}, got {self.priority}")
        for name in (
            "max_inflight_requests",
            "max_inflight_tokens",
            "max_queued",
            "max_n",
            "max_request_output_tokens",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value is not None and value < (0 if name == "max_queued" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'max_queued' else 1}")
        for name in ("requests_per_second", "tokens_per_second"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.share_cache, bool):
            raise ValueError(f"share_cache must be true or false, got {self.share_cache!r}")
        if self.client_priority not in ("refuse", "allow"):
            raise ValueError(
                f"client_priority must be refuse or allow, got {self.client_priority!r}"
            )

    @classmethod
    def parse(cls, data: Any, where: str, base: TenantPolicy | None = None) -> TenantPolicy:
        """From a mapping of the file (``where`` names it in errors); unset
        fields take ``base``'s values."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = {f.name: getattr(base or cls(), f.name) for f in fields(cls)}
        values.update(data)
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Tenant:
    name: str
    policy: TenantPolicy
    cache_salt: str | None = None
    """Set when ``policy.share_cache`` is False: the salt its requests carry."""


def tenant_salt(name: str) -> str:
    """A tenant's cache salt: stable across gateway replicas and restarts (so the
    tenant keeps its own cache hits), distinct between tenants."""
    return "tenant-" + hashlib.sha256(b"pdfleet-tenant\0" + name.encode()).hexdigest()[:32]


@dataclass
class Tenants:
    """Keys → tenants. Keys are matched by their digest (``caller_id``), so the
    table never holds a key in the clear after loading."""

    default: TenantPolicy = field(default_factory=TenantPolicy)
    """The policy of a key no tenant lists (each such key is its own tenant)."""
    prompt_token_weight: float = 1.0
    """What one prompt token counts for, against one output token, in fair
    share (the file's top-level ``prompt_token_weight``, 0 to 1): a request's
    share is ``prompt_token_weight × prompt tokens + n × max_tokens``. Limits
    (``max_inflight_tokens``, ``tokens_per_second``) count prompt tokens in
    full whatever it is. Below 1 it evens out output tokens between keys whose
    requests spend their cost differently (an ``n=1`` request with a prompt
    as long as its output against an ``n=64`` one); 0 shares output tokens
    alone."""
    by_caller: dict[str, Tenant] = field(default_factory=dict)
    named: dict[str, Tenant] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    """Every key the file lists: the gateway accepts them as API keys."""
    _anonymous: Tenant | None = field(default=None, repr=False, compare=False)
    """The tenant of every caller without a key, once made (of ``default``)."""

    def tenant(self, caller: str) -> Tenant:
        """The tenant of a caller (``caller_id`` of its key; an address when the
        gateway checks no key: one anonymous tenant)."""
        found = self.by_caller.get(caller)
        if found is not None:
            return found
        if not caller.startswith("key:"):
            # Every caller without a key (an address) is the one anonymous
            # tenant: made once, not per request (its salt is a sha256).
            anonymous = self._anonymous
            if anonymous is None or anonymous.policy is not self.default:
                anonymous = self._anonymous = Tenant(
                    ANONYMOUS,
                    self.default,
                    None if self.default.share_cache else tenant_salt(ANONYMOUS),
                )
            return anonymous
        name = caller
        tenant = Tenant(name, self.default, None if self.default.share_cache else tenant_salt(name))
        # Keys are the gateway's configured ones (it checks them first), so
        # this table stays bounded by the configuration.
        self.by_caller[caller] = tenant
        return tenant

    @classmethod
    def load(cls, path: str) -> Tenants:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--tenants-file {path}: {e.strerror}") from None
        try:
            data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:
            raise ValueError(f"--tenants-file {path}: does not parse: {e}") from None
        return cls.parse(data, f"--tenants-file {path}")

    @classmethod
    def parse(cls, data: Any, where: str = "tenants") -> Tenants:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a mapping with `tenants` (and `default`)")
        unknown = sorted(set(data) - {"tenants", "default", "prompt_token_weight"})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        default = TenantPolicy.parse(data.get("default") or {}, f"{where}: default")
        weight = data.get("prompt_token_weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0.0 <= weight <= 1.0
        ):
            raise ValueError(f"{where}: prompt_token_weight must be a number within [0, 1]")
        out = cls(default, prompt_token_weight=float(weight))
        entries = data.get("tenants") or []
        if not isinstance(entries, list):
            raise ValueError(f"{where}: tenants must be a list")
        for i, entry in enumerate(entries):
            at = f"{where}: tenants[{i}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{at}: must be a mapping")
            entry = dict(entry)
            name = entry.pop("name", None)
            keys = entry.pop("keys", None)
            if not isinstance(name, str) or not name or len(name) > 64:
                raise ValueError(f"{at}: name must be a string of 1-64 characters")
            if name in out.named or name == ANONYMOUS or name.startswith("key:"):
                raise ValueError(f"{at}: name {name!r} is taken (or reserved)")
            if (
                not isinstance(keys, list)
                or not keys
                or not all(isinstance(k, str) and k.strip() for k in keys)
            ):
                raise ValueError(f"{at} ({name}): keys must be a non-empty list of API keys")
            policy = TenantPolicy.parse(entry, f"{at} ({name})", default)
            tenant = Tenant(name, policy, None if policy.share_cache else tenant_salt(name))
            out.named[name] = tenant
            for key in keys:
                caller = caller_id(key.strip())
                if caller in out.by_caller:
                    raise ValueError(f"{at} ({name}): a key is listed twice")
                out.by_caller[caller] = tenant
                out.keys.append(key.strip())
        return out
