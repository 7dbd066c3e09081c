"""kopf handlers: thin wiring of the pure builders to the API server.

* create / update / resume -> :func:`reconcile`: check the spec (an invalid
  one gets ``Ready=False`` and events naming field and fix; nothing is
  created), apply every child in the coherent order, write the status.
* a timer per InferenceService -> :func:`refresh`: scrape the engine pods,
  let the autoscaling policy decide (every ``autoscaling.periodSeconds``),
  actuate, and refresh the status.
* deletion only forgets the service's in-memory state: every child has an
  owner reference, and the garbage collector removes them with it.
* startup / cleanup start and stop the identity endpoint
  (:mod:`.identity_endpoint`), where engine pods get their identities.

``register()`` adds the handlers to a registry, so tests run them against an
in-memory API server and the CLI against a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import CollectorRegistry

from ..engine.contracts import metrics as m
from ..engine.contracts import security
from .adapter_sync import sync_adapters
from .autoscaling.decisions import AutoscalerMetrics
from .cluster_autoscaler import (
    DecideFn,
    PolicyDecider,
    actuate,
    advise,
    decide_scaling,
)
from .compat import compat_hash
from .fleet_secret import FleetSecretError, ensure_fleet_secret, secret_version
from .headline import merge_role_load
from .identity_authority import (
    IdentityAuthorityError,
    authority_version,
    ensure_identity_authority,
)
from .identity_endpoint import IdentityEndpoint, IdentityEndpointConfig
from .kube import KubeClient, KubeError
from .manifests import (
    ANNOTATION_FLEET_SECRET,
    ANNOTATION_IDENTITY,
    LABEL_SERVICE,
    OperatorInstall,
    Owner,
    build_identity_configmap,
    desired_replicas,
    identity_enabled,
    service_url,
)
from .reconcile import (
    InvalidSpec,
    WaitingForRollout,
    apply_children,
    autoscaled_replicas,
    checked_spec,
    pod_templates,
    read_deployments,
)
from .resource import GROUP, PLURAL, VERSION, InferenceServiceSpec
from .scrape import KVHealth, KVVerdict, PodSample, scrape_pods
from .status import autoscaling_status, build_status, invalid_status

MAX_EVENTS_PER_REVISION = 5
# Seconds a running refresh may go on after SIGTERM, and the hard bound on the exit.
STOP_SECONDS = 2.0
EXIT_SECONDS = 20.0


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class OperatorConfig:
    """What the operator needs besides the cluster."""

    default_image: str | None = None
    """Engine/gateway image for InferenceServices without spec.image."""
    timer_interval_seconds: float = 15.0
    """How often each InferenceService's status is refreshed and its pods scraped."""
    scrape_timeout_seconds: float = 2.0
    """Bound on one pod's /metrics request."""
    rollout_poll_seconds: float = 10.0
    """How often a waiting coherent rollout step is retried."""
    retry_seconds: float = 30.0
    """Delay before retrying after an API error."""
    decide: DecideFn = decide_scaling
    """The autoscaling policy (the seam)."""
    install: OperatorInstall = field(default_factory=OperatorInstall)
    """Where the operator runs and the gateway role (for NetworkPolicies, RBAC)."""
    kv_window_seconds: float = 300.0
    """Window of the KVTransferHealthy condition (failed vs all KV pulls)."""
    kv_max_failure_ratio: float = 0.05
    """Above this share of failed KV pulls in the window, KVTransferHealthy is False."""
    adapter_timeout_seconds: float = 30.0
    """Bound on each adapter load or unload call to an engine pod (a load reads
    the adapter from disk)."""
    login: Callable[..., Any] | None = None
    """kopf login function; kopf.login_via_client when unset."""
    identity: IdentityEndpointConfig = field(default_factory=IdentityEndpointConfig)
    """The identity endpoint engine pods get their identities from."""


@dataclass
class OperatorState:
    """Shared by all handlers of one operator process."""

    kube: KubeClient | None = None
    kv_health: dict[str, KVHealth] = field(default_factory=dict)
    kv_verdict: dict[str, KVVerdict] = field(default_factory=dict)
    last_decision_at: dict[str, float] = field(default_factory=dict)
    metrics: CollectorRegistry = field(default_factory=CollectorRegistry)
    identity_endpoint: IdentityEndpoint | None = None

    def __post_init__(self) -> None:
        self.reconciles = m.OPERATOR_RECONCILES.create(self.metrics)
        self.scale_changes = m.OPERATOR_SCALE_CHANGES.create(self.metrics)
        self.scrape_failures = m.OPERATOR_SCRAPE_FAILURES.create(self.metrics)
        self.fleet_secrets_created = m.OPERATOR_FLEET_SECRETS_CREATED.create(self.metrics)
        self.identity_authorities_created = m.OPERATOR_IDENTITY_AUTHORITIES_CREATED.create(
            self.metrics
        )
        self.identity_requests = m.OPERATOR_IDENTITY_REQUESTS.create(self.metrics)
        self.adapter_changes = m.OPERATOR_ADAPTER_CHANGES.create(self.metrics)

    def client(self) -> KubeClient:
        if self.kube is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=5)
        return self.kube


def _owner(body: kopf.Body) -> Owner:
    return Owner(name=body["metadata"]["name"], uid=body["metadata"]["uid"])


def _report_invalid(body: kopf.Body, patch: kopf.Patch, problems: list[str], logger: Any) -> None:
    generation = body.get("metadata", {}).get("generation")
    message = "; ".join(problems)
    patch.setdefault("status", {}).update(
        invalid_status(body.get("status"), message, now=now_rfc3339(), generation=generation)
    )
    for problem in problems[:MAX_EVENTS_PER_REVISION]:
        kopf.warn(body, reason="InvalidSpec", message=problem)
    logger.warning("invalid spec, nothing created: %s", message)


async def reconcile(
    state: OperatorState,
    config: OperatorConfig,
    body: kopf.Body,
    patch: kopf.Patch,
    logger: Any,
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        spec = checked_spec(
            name, body.get("spec"), leader_worker_set=config.install.leader_worker_set
        )
    except InvalidSpec as e:
        state.reconciles.labels("invalid").inc()
        _report_invalid(body, patch, e.problems, logger)
        return
    client = state.client()
    autoscaled = autoscaled_replicas(body.get("status")) if spec.autoscaling else None
    try:
        secret = await _fleet_secret(state, body)
        identity_version = await _identity(state, spec, body) if identity_enabled(spec) else None
        await apply_children(
            client,
            name,
            namespace,
            spec,
            owner=_owner(body),
            image=config.default_image,
            autoscaled=autoscaled,
            install=config.install,
            secret_version=secret_version(secret),
            identity_version=identity_version,
        )
    except WaitingForRollout as e:
        state.reconciles.labels("waiting").inc()
        await _write_status(state, spec, body, patch, generation=None, autoscaled=autoscaled)
        raise kopf.TemporaryError(str(e), delay=config.rollout_poll_seconds) from None
    except (KubeError, FleetSecretError, IdentityAuthorityError) as e:
        state.reconciles.labels("error").inc()
        kopf.warn(body, reason="ApplyFailed", message=str(e))
        raise kopf.TemporaryError(str(e), delay=config.retry_seconds) from None
    state.reconciles.labels("ok").inc()
    generation = body.get("metadata", {}).get("generation")
    await _write_status(state, spec, body, patch, generation=generation, autoscaled=autoscaled)


async def _fleet_secret(state: OperatorState, body: kopf.Body) -> bytes:
    """The service's fleet secret, created when absent (first run, rotation)."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    secret, created = await ensure_fleet_secret(state.client(), name, namespace, owner=_owner(body))
    if created:
        state.fleet_secrets_created.inc()
        kopf.info(body, reason="FleetSecretCreated", message=f"created Secret {name}-fleet")
    return secret


async def _identity(
    state: OperatorState, spec: InferenceServiceSpec, body: kopf.Body, *, always: bool = True
) -> str:
    """The service's identity authority (created when absent: first run, rotation)
    and its ConfigMap (applied when ``always`` or the authority is new); returns
    the authority's fingerprint."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    client = state.client()
    endpoint = state.identity_endpoint
    if endpoint is None:
        raise kopf.TemporaryError("the identity endpoint is not serving yet", delay=5)
    authority, created = await ensure_identity_authority(
        client, name, namespace, owner=_owner(body)
    )
    if created:
        state.identity_authorities_created.inc()
        kopf.info(
            body,
            reason="IdentityAuthorityCreated",
            message=f"created Secret {name}-identity (the engines' identity authority)",
        )
    if always or created:
        await client.apply(
            build_identity_configmap(
                name,
                namespace=namespace,
                owner=_owner(body),
                authority=authority.public_key,
                ca_pem=endpoint.ca_pem,
                endpoint=endpoint.url,
            )
        )
    return authority_version(authority)


def _stale_templates(
    deployments: dict[str, dict[str, Any] | None],
    version: str,
    identity_version: str | None = None,
) -> list[str]:
    """Workloads whose pods run with another fleet secret than ``version``, or
    (engine roles) another identity authority than ``identity_version``."""
    stale = []
    for role, deployment in deployments.items():
        if deployment is None:
            continue
        for template in pod_templates(deployment):
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            if annotations.get(ANNOTATION_FLEET_SECRET) != version or (
                role != "gateway"
                and identity_version is not None
                and annotations.get(ANNOTATION_IDENTITY) != identity_version
            ):
                stale.append(role)
                break
    return stale


async def _write_status(
    state: OperatorState,
    spec: InferenceServiceSpec,
    body: kopf.Body,
    patch: kopf.Patch,
    *,
    generation: int | None,
    autoscaled: dict[str, int] | None,
    deployments: dict[str, dict[str, Any] | None] | None = None,
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    kv = state.kv_verdict.get(body["metadata"]["uid"]) or KVVerdict(
        None, "NoMetrics", "not checked yet"
    )
    if deployments is None:
        deployments = await read_deployments(state.client(), name, namespace, spec)
    desired = {r: desired_replicas(spec, r, autoscaled) for r in ("prefill", "decode", "gateway")}
    status = build_status(
        spec,
        url=service_url(name, spec, namespace),
        compat=compat_hash(spec),
        deployments=deployments,
        desired=desired,
        previous=body.get("status"),
        kv_healthy=kv.healthy,
        kv_reason=kv.reason,
        kv_message=kv.message,
        now=now_rfc3339(),
        generation=generation,
    )
    patch.setdefault("status", {}).update(status)


async def refresh(
    state: OperatorState,
    config: OperatorConfig,
    body: kopf.Body,
    patch: kopf.Patch,
    logger: Any,
    *,
    clock: Callable[[], float] = time.time,
) -> None:
    """Scrape, autoscale when due, refresh the status (the timer's body)."""
    name, namespace, uid = (body["metadata"][k] for k in ("name", "namespace", "uid"))
    try:
        spec = checked_spec(
            name, body.get("spec"), leader_worker_set=config.install.leader_worker_set
        )
    except InvalidSpec:
        return  # the reconcile reported it; nothing runs
    client = state.client()
    autoscaled = autoscaled_replicas(body.get("status")) if spec.autoscaling else None
    try:
        secret = await _fleet_secret(state, body)
    except FleetSecretError as e:
        kopf.warn(body, reason="FleetSecretInvalid", message=str(e))
        return
    version = secret_version(secret)
    identity_version = None
    if identity_enabled(spec):
        try:
            identity_version = await _identity(state, spec, body, always=False)
        except IdentityAuthorityError as e:
            kopf.warn(body, reason="IdentityAuthorityInvalid", message=str(e))
            return
    deployments: dict[str, dict[str, Any] | None] | None
    deployments = await read_deployments(client, name, namespace, spec)
    stale = _stale_templates(deployments, version, identity_version)
    if stale:
        # A Secret was replaced (rotation): roll the pods onto the new one.
        logger.info("fleet secret or identity authority changed; rolling %s", ", ".join(stale))
        # While prefill waits for decode, a later tick applies it.
        with contextlib.suppress(WaitingForRollout):
            await apply_children(
                client,
                name,
                namespace,
                spec,
                owner=_owner(body),
                image=config.default_image,
                autoscaled=autoscaled,
                install=config.install,
                secret_version=version,
                identity_version=identity_version,
            )
        deployments = None  # read again after the apply
    pods = await client.list("Pod", namespace, {LABEL_SERVICE: name})
    scraped = await scrape_pods(
        pods,
        timeout_seconds=config.scrape_timeout_seconds,
        clock=clock,
        token=security.fleet_token(secret),
        gateways=True,
    )
    for sample in scraped:
        if sample.error is not None:
            state.scrape_failures.inc()
    await _sync_adapters(state, config, spec, body, pods, security.fleet_token(secret), logger)
    samples = [s for s in scraped if s.role != "gateway"]  # what the autoscaler sees
    health = state.kv_health.get(uid)
    if health is None:
        health = state.kv_health[uid] = KVHealth(
            config.kv_window_seconds, config.kv_max_failure_ratio
        )
    state.kv_verdict[uid] = health.update(scraped)
    if spec.autoscaling is not None:
        # The autoscaler also reads the gateways: their activation counters.
        autoscaled = await _autoscale(
            state, config, spec, body, patch, scraped, autoscaled or {}, clock(), logger
        )
    await _write_status(
        state, spec, body, patch, generation=None, autoscaled=autoscaled, deployments=deployments
    )
    merge_role_load(patch, samples)  # status.roles.*: the headline load figures


async def _sync_adapters(
    state: OperatorState,
    config: OperatorConfig,
    spec: InferenceServiceSpec,
    body: kopf.Body,
    pods: list[dict[str, Any]],
    token: str,
    logger: Any,
) -> None:
    """Load and unload spec.adapters on the running engines (no restart);
    an event per change, a warning event per failure (it is tried again on
    the next tick)."""
    changes = await sync_adapters(
        pods, spec, token=token, timeout_seconds=config.adapter_timeout_seconds
    )
    for change in changes:
        state.adapter_changes.labels(change.action, "error" if change.error else "ok").inc()
        verb = "loaded" if change.action == "load" else "unloaded"
        if change.error is None:
            logger.info("LoRA adapter %s %s on %s", change.adapter, verb, change.pod)
            kopf.info(
                body,
                reason=f"Adapter{change.action.title()}ed",
                message=f"{change.adapter} {verb} on {change.pod}",
            )
        else:
            logger.warning(
                "LoRA adapter %s: %s on %s failed: %s",
                change.adapter,
                change.action,
                change.pod,
                change.error,
            )
            kopf.warn(
                body,
                reason=f"Adapter{change.action.title()}Failed",
                message=f"{change.adapter}: {change.action} on {change.pod} failed: {change.error}",
            )


async def _autoscale(
    state: OperatorState,
    config: OperatorConfig,
    spec: InferenceServiceSpec,
    body: kopf.Body,
    patch: kopf.Patch,
    samples: list[PodSample],
    autoscaled: dict[str, int],
    now: float,
    logger: Any,
) -> dict[str, int]:
    if spec.autoscaling is None:
        raise RuntimeError("broken invariant: spec.autoscaling is not None")
    name, namespace, uid = (body["metadata"][k] for k in ("name", "namespace", "uid"))
    last = state.last_decision_at.get(uid)
    replicas = {r: desired_replicas(spec, r, autoscaled) for r in ("prefill", "decode")}
    # A gateway holding requests for a decode pool at zero: decide now, not a
    # period later (the request waits for a cold start either way).
    activating = replicas["decode"] == 0 and any(
        s.values.get(m.GATEWAY_HELD_REQUESTS.name, 0.0) > 0 for s in samples if s.role == "gateway"
    )
    if last is not None and now - last < spec.autoscaling.period_seconds and not activating:
        return autoscaled
    state.last_decision_at[uid] = now
    decisions = config.decide(f"{namespace}/{name}", spec.autoscaling, samples, replicas, now)
    if not decisions:
        return autoscaled
    if spec.autoscaling.mode == "Advisory":
        # Computed and reported (status, events, metrics), not carried out.
        advised = advise(spec, decisions, replicas, now_rfc3339())
        if advised:
            patch.setdefault("status", {})["autoscaling"] = autoscaling_status(
                body.get("status"), "Advisory", advised
            )
        for record in advised:
            message = (
                f"{record.role} {record.from_} -> {record.to} (advisory, not applied): "
                f"{record.reason}"
            )
            kopf.info(body, reason="ScaleAdvised", message=message)
            logger.info("advised %s", message)
        return autoscaled
    records = await actuate(
        state.client(),
        name=name,
        namespace=namespace,
        spec=spec,
        decisions=decisions,
        replicas=replicas,
        now=now_rfc3339(),
    )
    if not records:
        return autoscaled
    patch.setdefault("status", {})["autoscaling"] = autoscaling_status(
        body.get("status"), "Active", records
    )
    for record in records:
        state.scale_changes.labels(record.role).inc()
        message = f"{record.role} {record.from_} -> {record.to}: {record.reason}"
        kopf.info(body, reason="Scaled", message=message)
        logger.info("scaled %s", message)
        replicas[record.role] = record.to
    return replicas


def register(
    registry: kopf.OperatorRegistry, config: OperatorConfig, state: OperatorState | None = None
) -> OperatorState:
    """Add the operator's handlers to ``registry``; returns their shared state."""
    state = state or OperatorState()
    if isinstance(config.decide, PolicyDecider):  # pdfleet_autoscaler_* on the operator's /metrics
        config.decide.metrics = AutoscalerMetrics(state.metrics)
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = (config.login or kopf.login_via_client)(**kwargs)
        if info is not None:
            if state.kube is not None:
                await state.kube.aclose()
            state.kube = KubeClient.from_connection_info(info)
        return info

    @kopf.on.startup(registry=registry)
    async def start_identity_endpoint(**_: Any) -> None:
        # Before any service is handled: their ConfigMaps carry its URL and CA.
        if state.identity_endpoint is None:
            endpoint = IdentityEndpoint(
                config.identity,
                state.client,
                namespace=config.install.namespace,
                counter=state.identity_requests,
            )
            await endpoint.start()
            state.identity_endpoint = endpoint

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if state.identity_endpoint is not None:
            await state.identity_endpoint.stop()
            state.identity_endpoint = None
        if state.kube is not None:
            await state.kube.aclose()
            state.kube = None
        _cancel_late_timers()

    @kopf.on.resume(*resource, id="reconcile", registry=registry)
    @kopf.on.create(*resource, id="reconcile", registry=registry)
    @kopf.on.update(*resource, id="reconcile", registry=registry)
    async def on_change(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        await reconcile(state, config, body, patch, logger)

    @kopf.on.delete(*resource, id="forget", optional=True, registry=registry)
    async def on_delete(body: kopf.Body, **_: Any) -> None:
        # Per-service state goes with the service: it stays bounded under churn.
        uid = body["metadata"]["uid"]
        for table in (state.kv_health, state.kv_verdict, state.last_decision_at):
            table.pop(uid, None)
        forget = getattr(config.decide, "forget", None)  # the autoscaling loop's state
        if forget is not None:
            meta = body["metadata"]
            forget(f"{meta.get('namespace')}/{meta['name']}")

    @kopf.timer(*resource, id="refresh", interval=config.timer_interval_seconds, registry=registry)
    async def on_timer(body: kopf.Body, patch: kopf.Patch, logger: Any, **kwargs: Any) -> None:
        if state.kube is None:
            return  # logged out (the operator is stopping): skip this tick
        try:
            await _until_stopped(refresh(state, config, body, patch, logger), kwargs["stopped"])
        except KubeError as e:
            logger.warning("status refresh failed: %s", e)

    return state


def _cancel_late_timers() -> None:
    """Cancel timers kopf started after it stopped its timers for the exit.

    After SIGTERM kopf's event workers still drain their queues for a moment, and
    an event handled then starts the refresh timer anew; nothing stops that one
    until kopf cancels every leftover task 5 s later. Cancelling it here, when
    the operator logs out on exit, ends the exit that much sooner."""
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not current and task.get_name() == "runner of refresh":
            task.cancel()


async def _until_stopped(work: Any, stopped: Any, grace: float = STOP_SECONDS) -> None:
    """Run ``work``; once kopf says stop (SIGTERM, or the object goes), give it
    ``grace`` seconds more, then cancel it. A refresh is level-based, so the next
    one redoes what was cut short; an exit waits for no API call to end."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait({task}, timeout=grace)
        if task.done():
            task.result()  # its exception, if any
    finally:
        for t in (task, stop):
            t.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf settings: pdfleet.dev annotations and finalizer (kopf adds the
    finalizer because of the timer, to stop it before an object goes), no
    kopf-specific status fields, bounded API waits."""
    # Resources are discovered once at startup; no watching of CRDs or
    # namespaces, so the operator needs no cluster-scoped read permissions.
    settings.scanning.disabled = True
    settings.persistence.finalizer = "pdfleet.dev/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdfleet.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="pdfleet.dev")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # A bounded exit: what is still running this long after SIGTERM is killed, well
    # inside a pod's default 30 s termination grace period.
    settings.process.ultimate_exiting_timeout = EXIT_SECONDS
