"""What the proxy asks of flow control for each request: its tenant, its
checks (per-tenant caps, a client's own ``priority``), its cost and band, the
fields the gateway sets on its behalf (``priority`` for the engines,
``cache_salt`` for a tenant that shares no cache), and its admission."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config.gateway import GatewayConfig
from ...contracts.gateway_view import TenantView
from ...contracts.priority import BATCH_BAND, MAX_BAND
from ...contracts.sampling_checks import num_prompts, num_sequences
from ..admission import Admission, Overloaded
from ..metrics import GatewayMetrics
from ..prompt import CHARS_PER_TOKEN, estimated_tokens, first_prompt_estimate
from .control import FlowControl, Ticket
from .tenants import Tenant, Tenants

# The header a batch runner's requests carry (with the fleet token) to run in
# the batch band; a client's own is ignored (only the fleet token may set it).
BATCH_HEADER = "x-pdfleet-batch"


class FlowRefused(Exception):
    """A 400 naming a field (``param``) or a tenant limit's 429 (``overloaded``)."""

    def __init__(
        self, message: str, param: str | None = None, overloaded: Overloaded | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.overloaded = message, param, overloaded


@dataclass
class Admitted:
    ticket: Ticket
    changed: bool
    """The body was changed (``priority``, ``cache_salt``): re-serialize it."""
    seqs: int
    """Sequences the request runs (``n`` or ``best_of``, × prompts)."""


class FlowGate:
    def __init__(
        self,
        config: GatewayConfig,
        tenants: Tenants,
        admission: Admission,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.admission = admission
        self.control = FlowControl(metrics)
        self.metrics = metrics
        metrics.on_collect(self._queued_gauges)
        self._queued_seen: set[str] = set()
        if config.engine_priority:
            # Engines preempt a worse band for a better one: the best band may
            # overflow their capacity a little, when there is a worse band at all.
            bands = {tenants.default.priority, *(t.policy.priority for t in tenants.named.values())}
            if config.data_dir is not None:
                bands.add(BATCH_BAND)
            if len(bands) > 1:
                admission.top_band = min(bands)

    def tenant(self, caller: str) -> Tenant:
        return self.tenants.tenant(caller)

    def caps(self, tenant: Tenant) -> tuple[int, int]:
        """(max n / best_of, max n × max_tokens) of one request of this tenant."""
        p = tenant.policy
        max_n = self.config.max_n if p.max_n is None else min(p.max_n, self.config.max_n)
        out = self.config.max_request_output_tokens
        if p.max_request_output_tokens is not None:
            out = min(out, p.max_request_output_tokens)
        return max_n, out

    @staticmethod
    def seqs(body: dict[str, Any]) -> int:
        """Sequences the request runs: ``n`` (``best_of`` when larger) per prompt."""
        prompt = body.get("prompt")
        prompts = num_prompts(prompt) if type(prompt) is list else 1
        if "n" not in body and "best_of" not in body:
            return prompts  # (the usual body: one sequence a prompt, no call)
        return prompts * num_sequences(body)

    def output_tokens(self, body: dict[str, Any], seqs: int | None = None) -> int:
        """``n × max_tokens`` for every prompt (the output the request may make);
        ``seqs``: the request's :meth:`seqs`, when known."""
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            limit = self.config.flow_default_max_tokens
        return (self.seqs(body) if seqs is None else seqs) * limit

    def cost(self, body: dict[str, Any], prompt_tokens: int) -> float:
        """Prompt tokens plus ``n × max_tokens`` for every prompt (the tokens the
        request may make the engines compute)."""
        return float(prompt_tokens + self.output_tokens(body))

    def admit(
        self,
        tenant: Tenant,
        body: dict[str, Any],
        prompt_tokens: int | None,
        body_bytes: int,
        batch: bool = False,
    ) -> Admitted:
        """Check and admit one request (its body already passed the sampling
        checks); FlowRefused otherwise. ``prompt_tokens``: counted when the
        prompt was analyzed, else estimated from its text (``body_bytes``: the
        body's size, for a prompt in no form the estimate knows). ``batch``:
        a Batch API request (the batch band)."""
        p = tenant.policy
        changed = False
        band = p.priority
        given = body.get("priority", 0)
        if given:  # the sampling checks made it an int
            if p.client_priority != "allow":
                raise FlowRefused(
                    f"priority: tenant {tenant.name!r} may not set a request priority (the "
                    "gateway schedules by tenant: its band is set in the tenants file); "
                    "send 0 or leave it out",
                    "priority",
                )
            band = max(-MAX_BAND, min(MAX_BAND, int(given)))
        if batch:
            band = BATCH_BAND
        if tenant.cache_salt is not None:
            own = body.get("cache_salt")
            body["cache_salt"] = (
                tenant.cache_salt if not isinstance(own, str) else f"{tenant.cache_salt}:{own}"
            )
            changed = True
        tokens = prompt_tokens
        prompt = body.get("prompt")
        if not tokens:
            # Routed without analyzing its prompt: estimated from the prompt's
            # text, not the body's size (whose other fields would charge a
            # short request several times its prompt), each prompt as the
            # engine keeps it (``truncate_prompt_tokens``).
            tokens = estimated_tokens(body)
            if tokens is None:
                tokens = -(-body_bytes // CHARS_PER_TOKEN)
        elif type(prompt) is list and len(prompt) > 1 and type(prompt[0]) in (str, list):
            # A batch of prompts, analyzed by its first: the others are
            # estimated at the first one's measured tokens per estimated
            # token, so the batch costs what all its prompts do.
            whole, first = estimated_tokens(body), first_prompt_estimate(body)
            if whole and first:
                tokens = max(tokens, round(tokens + (whole - first) * max(1.0, tokens / first)))
        seqs = self.seqs(body)
        output = self.output_tokens(body, seqs)
        cost = float(tokens + output)
        share = self.tenants.prompt_token_weight * tokens + output
        try:
            ticket = self.control.admit(
                tenant, cost, band, self.admission.queued_of(tenant.name), share=share
            )
        except Overloaded as o:
            raise FlowRefused(o.message, overloaded=o) from None
        if self.config.engine_priority:
            body["priority"] = ticket.engine_priority
            changed = True
        return Admitted(ticket, changed, seqs)

    def _queued_gauges(self) -> None:
        queued = self.admission.queued_by_tenant()
        for name in self._queued_seen - set(queued):
            self.metrics.tenant_queued.labels(name).set(0)
        for name, n in queued.items():
            self.metrics.tenant_queued.labels(name).set(n)
        self._queued_seen |= set(queued)

    def view(self) -> list[TenantView]:
        return self.control.view(self.admission.queued_by_tenant())
