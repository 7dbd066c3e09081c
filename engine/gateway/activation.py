"""Activation of pools scaled to zero: the gateway's side.

A role with ``minReplicas: 0`` may have no engine at all. A request that finds
no routable engine of a role is *wanted* here:

* decode: the proxy holds the request (up to ``--hold-timeout``, then a 503
  with ``Retry-After``) until an engine is routable;
* prefill: the request is served decode-only meanwhile (``Conditional`` and
  ``Always`` modes alike), so nothing waits for a prefill cold start.

Each wanted request increments ``pdfleet_gateway_activation_requests_total
{role}`` on the gateway's ``/metrics``. That counter is the activation signal,
as Knative's and KServe's activator report held requests to their
autoscaler: the autoscaler (the operator's, or ``pdfleet up``'s) scrapes the
gateway, and a rise for a role at zero replicas starts one
(docs/autoscaling.md). Nothing else is needed from the gateway, so it works
with any actuator that can read Prometheus text.
"""

from __future__ import annotations

from typing import Any

ROLES = ("prefill", "decode")


class Activation:
    """Counts requests that wanted a role with no routable engine."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        for role in ROLES:
            counter.labels(role)  # both series exist from the start (at 0)

    def wanted(self, role: str) -> None:
        """A request found no routable engine of ``role``."""
        self.counter.labels(role).inc()
