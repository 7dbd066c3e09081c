"""Validate built-in Kubernetes objects offline against the API's own schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

# Oldest Kubernetes minor the manifests target (the pod-deletion-cost
# annotation, CEL rules with fieldPath and policy/v1 are all there).
KUBERNETES_VERSION = "1.30"


def validate(obj: dict[str, Any]) -> None:
    """Raise if ``obj`` is not a valid object of its kind (unknown fields included)."""
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
