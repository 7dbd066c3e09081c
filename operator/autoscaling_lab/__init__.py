"""The autoscaling research lab: the fleet simulator, seeded traces, the
strategies it compares the policy with (fixed peak, HPA, the oracle, the
perfect-foresight reference), the target matrix, its plots, and the
calibration of the simulator's fleet model on running engines (``pdfleet
sim``).

The runtime policy the operator and ``pdfleet up`` run is
:mod:`pdfleet.operator.autoscaling`; this package imports it, never the
reverse, and the operator image does not ship it (docs/autoscaling.md).
"""
