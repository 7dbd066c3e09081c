"""The labels and annotations the operator puts on the pods it makes and the
gateway reads back when it discovers engines in Kubernetes: one name each,
written by the one and read by the other. Torch-free; imports nothing."""

from __future__ import annotations

LABEL_SERVICE = "pdfleet.dev/service"
"""The InferenceService a pod belongs to (the gateway's discovery selector)."""
LABEL_ROLE = "pdfleet.dev/role"
"""prefill, decode or gateway."""
LABEL_GROUP_ROLE = "pdfleet.dev/group-role"
"""Pods of a multi-node engine: which pod of its group a pod is (leader or
worker). The gateway routes to leaders only; the operator scrapes leaders only."""
PORT_ANNOTATION = "pdfleet.dev/port"
"""An engine pod's HTTP port, where it is not the gateway's --engine-port
(the operator's pods use the default and set none; a hand-made pod may)."""
