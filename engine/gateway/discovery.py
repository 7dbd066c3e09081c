"""Where the gateway's engines come from, behind one small interface.

A discovery source answers ``poll()`` with the current list of engine
endpoints; the engine pool (``engines.py``) diffs successive answers, so a
source never has to report additions or removals itself. ``poll`` returns
``None`` when nothing could be learnt this time (a file being rewritten, the
Kubernetes API unreachable): the pool then keeps what it has.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from ..config.gateway import (
    KV_EVENTS_PORT_ANNOTATION,
    KV_REPLAY_PORT_ANNOTATION,
    ROLES,
    GatewayConfig,
)
from ..contracts import pod_labels
from ..contracts.engines_file import EngineEntry, EnginesFile, EnginesFileError

logger = logging.getLogger("pdfleet.gateway")

ROLE_LABEL = pod_labels.LABEL_ROLE
PORT_ANNOTATION = pod_labels.PORT_ANNOTATION
# Pods of a multi-node engine: only the group's leader serves HTTP
# (docs/parallelism-k8s.md); its workers run ranks only.
GROUP_ROLE_LABEL = pod_labels.LABEL_GROUP_ROLE
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


Endpoint = EngineEntry
"""One engine: its base URL, its role (prefill, decode or both), its name and
its KV-event endpoints; the engines file's entry (``contracts/engines_file.py``),
whichever source found it."""


class Discovery(Protocol):
    async def poll(self) -> list[Endpoint] | None:
        """The engines as of now, or None when unknown this time (keep the last)."""
        ...


class StaticDiscovery:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints

    async def poll(self) -> list[Endpoint] | None:
        return list(self.endpoints)


def parse_engines(data: Any, source: str) -> list[Endpoint]:
    """The engines of a parsed engines file (``contracts/engines_file.py``);
    ValueError naming ``source`` and the field for a malformed one."""
    try:
        return list(EnginesFile.from_json(data).engines)
    except EnginesFileError as e:
        raise ValueError(f"{source}: {e}") from None


class EnginesFileDiscovery:
    """A JSON or YAML engines file plus the static flags; re-read on change.

    Writers should replace the file atomically (write a temporary file, then
    rename); a file that does not parse is logged and the last good list kept.
    """

    def __init__(self, path: str, static: list[Endpoint]) -> None:
        self.path = Path(path)
        self.static = static
        self._stamp: tuple[int, int, int] | None = None
        self._from_file: list[Endpoint] = []

    def load(self) -> list[Endpoint]:
        text = self.path.read_text()
        if self.path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return parse_engines(data, str(self.path))

    async def poll(self) -> list[Endpoint] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self._stamp is not None:
                logger.warning("engines file %s disappeared; keeping the last list", self.path)
            return [*self.static, *self._from_file]
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            self._stamp = stamp  # an invalid version is reported once, not every poll
            try:
                self._from_file = self.load()
                logger.info("engines file %s: %d engines", self.path, len(self._from_file))
            except Exception as e:  # bad content, or a YAML/JSON syntax error mid-write
                logger.warning(
                    "engines file %s is invalid (%s); keeping the last list", self.path, e
                )
        return [*self.static, *self._from_file]


# -- Kubernetes ------------------------------------------------------------------


def pod_endpoint(pod: Any, default_port: int) -> Endpoint | None:
    """A Kubernetes pod (``kubernetes.client.V1Pod``) -> its engine endpoint.

    None for pods that cannot serve: terminating (their engine drains), not
    running, without an IP yet, without a valid role label, or the workers of a
    multi-node engine (the leader serves the group). Readiness is
    the gateway's own health check, which runs faster than the kubelet's.
    """
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None
    if status.phase != "Running" or not status.pod_ip:
        return None
    role = (meta.labels or {}).get(ROLE_LABEL)
    if role not in ROLES or (meta.labels or {}).get(GROUP_ROLE_LABEL) == "worker":
        return None
    port_text = (meta.annotations or {}).get(PORT_ANNOTATION)
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        logger.warning(
            "pod %s: annotation %s=%r is not a port", meta.name, PORT_ANNOTATION, port_text
        )
        return None
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    zmq_ports = []
    for key in (KV_EVENTS_PORT_ANNOTATION, KV_REPLAY_PORT_ANNOTATION):
        text = (meta.annotations or {}).get(key)
        zmq_ports.append(f"tcp://{host}:{int(text)}" if text and text.isdigit() else None)
    return Endpoint(f"http://{host}:{port}", role, meta.name or "", *zmq_ports)


def default_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class KubernetesDiscovery:
    """Engine pods matching a label selector, listed every ``interval`` seconds.

    ``api`` is a ``CoreV1Api`` (or anything with ``list_namespaced_pod``); by
    default one is built from the in-cluster service account, else from the
    local kubeconfig. The ``kubernetes`` package is imported only here.
    """

    def __init__(
        self,
        namespace: str | None,
        selector: str,
        port: int,
        interval: float = 5.0,
        api: Any = None,
    ) -> None:
        self.namespace = namespace or default_namespace()
        self.selector = selector
        self.port = port
        self.interval = interval
        self.api = api if api is not None else self._default_api()
        self._last_list = -float("inf")
        self._endpoints: list[Endpoint] | None = None

    @staticmethod
    def _default_api() -> Any:
        try:
            from kubernetes import client, config
        except ImportError:
            raise ValueError(
                "--discovery kubernetes needs the `kubernetes` Python package "
                "(pip install kubernetes, or install pdfleet[operator])"
            ) from None
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except Exception as e:
                raise ValueError(
                    f"--discovery kubernetes: no in-cluster service account and no usable "
                    f"kubeconfig ({e})"
                ) from None
        return client.CoreV1Api()

    def list_now(self) -> list[Endpoint]:
        pods = self.api.list_namespaced_pod(
            self.namespace, label_selector=self.selector, _request_timeout=10
        )
        out = []
        for pod in pods.items:
            ep = pod_endpoint(pod, self.port)
            if ep is not None:
                out.append(ep)
        return sorted(out, key=lambda e: e.url)

    async def poll(self) -> list[Endpoint] | None:
        if time.monotonic() - self._last_list < self.interval:
            return self._endpoints
        self._last_list = time.monotonic()
        try:
            self._endpoints = await asyncio.to_thread(self.list_now)
        except Exception as e:  # API unreachable: keep routing to what we know
            logger.warning("listing engine pods failed (%s); keeping the last list", e)
        return self._endpoints


def make_discovery(config: GatewayConfig) -> Discovery:
    if config.discovery == "kubernetes":
        if config.selector is None:  # checked by GatewayConfig
            raise RuntimeError("broken invariant: config.selector is not None")
        return KubernetesDiscovery(
            config.namespace, config.selector, config.engine_port, config.discovery_interval
        )
    static = [Endpoint(u, "prefill") for u in config.prefill] + [
        Endpoint(u, "decode") for u in config.decode
    ]
    if config.engines_file:
        if not os.path.exists(config.engines_file):
            logger.warning("engines file %s does not exist yet", config.engines_file)
        return EnginesFileDiscovery(config.engines_file, static)
    return StaticDiscovery(static)
