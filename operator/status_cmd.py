"""``pdfleet status``: one line per engine of a local or Kubernetes fleet.

Local: the newest run of ``--run-dir`` (``pdfleet up``'s), from its
``fleet.json`` and each engine's ``/metrics``, with the token of the run's
``fleet-secret`` file (owner-only; ``$PDFLEET_FLEET_SECRET`` wins when set). A
run whose ``pdfleet up`` is gone is shown ``stopped``, whatever its file last
said; a gateway that refuses connections is ``down``. Cluster (``--namespace``): the
InferenceServices' status, and each engine pod's ``/metrics`` through the API
server's pod proxy. Two scrapes (``--interval`` apart, or consecutive
``--watch`` refreshes) give the per-second figures. See docs/observability.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from ..engine.config.fields import bounded_seconds
from ..engine.contracts import metrics as m
from ..engine.contracts.gateway_view import EnginesView, TenantView
from ..engine.contracts.security import fleet_secret_from_env, fleet_token
from .local.state import SECRET_FILE, STATE_FILE, STOPPED, read_state, supervisor_alive
from .manifests import LABEL_ROLE, LABEL_SERVICE
from .parallelism import LABEL_GROUP_ROLE, WORKER
from .resource import InferenceServiceStatus
from .scrape import parse_metrics, pod_ready

logger = logging.getLogger("pdfleet.status")

WIDTH = 80
RUNNING = m.ENGINE_NUM_REQUESTS_RUNNING.name
WAITING = m.ENGINE_NUM_REQUESTS_WAITING.name
KV_USAGE = m.ENGINE_KV_CACHE_USAGE.name
PREFIX_HITS = m.ENGINE_PREFIX_CACHE_HITS.name
PREFIX_QUERIES = m.ENGINE_PREFIX_CACHE_QUERIES.name
TRANSFERS = m.ENGINE_KV_TRANSFERS.name
SCRAPE_TIMEOUT = 3.0
ENGINE_PORT = 8000  # the container port named http (operator/manifests/pods.py)
GROUP, VERSION, PLURAL = "pdfleet.dev", "v1alpha1", "inferenceservices"


class _EveryInterval:
    """`--watch` without SECONDS: refresh every --interval. Not a string, so
    argparse never runs it through the flag's ``type``."""

    def __repr__(self) -> str:
        return "EVERY_INTERVAL"


EVERY_INTERVAL = _EveryInterval()
# Exit statuses (docs/observability.md): 0 shown (a running fleet, whatever its
# engines' states), 2 a usage error or no run to show, 3 the run is stopped
# (as `systemctl status` answers for a unit that is not running).
EXIT_STOPPED = 3
# Refresh periods a user may ask for: a tenth of a second to a day.
WATCH_SECONDS = bounded_seconds(0.1, 86400.0)


@dataclass
class Sample:
    """One scrape of one engine: its metric values, or why there are none."""

    at: float
    values: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class EngineRow:
    name: str
    role: str
    state: str
    sample: Sample | None = None
    previous: Sample | None = None

    def value(self, name: str) -> float | None:
        if self.sample is None or self.sample.error is not None:
            return None
        return self.sample.values.get(name)

    def prefix_hit_rate(self) -> float | None:
        """Hits over lookups between the two scrapes, else since the engine started."""
        hits, queries = self.value(PREFIX_HITS), self.value(PREFIX_QUERIES)
        if hits is None or not queries:
            return None
        prev = self.previous
        if prev is not None and prev.error is None:
            dq = queries - prev.values.get(PREFIX_QUERIES, 0.0)
            if dq > 0:
                return (hits - prev.values.get(PREFIX_HITS, 0.0)) / dq
        return hits / queries

    def transfers_per_second(self) -> float | None:
        now, prev, sample = self.value(TRANSFERS), self.previous, self.sample
        if now is None or prev is None or sample is None or prev.error is not None:
            return None
        dt = sample.at - prev.at
        if dt <= 0:
            return None
        return max(0.0, now - prev.values.get(TRANSFERS, 0.0)) / dt


@dataclass
class FleetView:
    """What one InferenceService's block of the status shows."""

    service: str
    where: str
    gateway: str
    rows: list[EngineRow]
    decision: Mapping[str, Any] | None = None
    stopped: bool = False
    """A local run whose ``pdfleet up`` is gone (the exit status says so)."""
    peer_pull: str | None = None
    """The gateway's peer-pull line (``--peer-pull``; None: off or not read)."""
    tenants: list[TenantView] | None = None
    """The gateway's tenants (its ``/engines``): in flight, queued, queue time."""


# -- rendering --------------------------------------------------------------------------


def _fit(text: str, width: int) -> str:
    """Cut to ``width`` keeping the end (pod names differ in their suffix)."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def render_row(row: EngineRow) -> str:
    if row.sample is not None and row.sample.error is not None and row.state == "ready":
        state = "denied" if row.sample.error == UNAUTHORIZED else "down"
    else:
        state = row.state
    rw = f"{_count(row.value(RUNNING))}/{_count(row.value(WAITING))}"
    xfer = row.transfers_per_second()
    return (
        f"{_fit(row.name, 26):<26} {row.role[:7]:<7} {state[:8]:<8} {rw:>9} "
        f"{_pct(row.value(KV_USAGE)):>5} {_pct(row.prefix_hit_rate()):>7} "
        f"{'-' if xfer is None else f'{xfer:.2f}':>7}"
    ).rstrip()


HEADER = (
    f"{'ENGINE':<26} {'ROLE':<7} {'STATE':<8} {'RUN/WAIT':>9} {'KV%':>5} {'PREFIX%':>7} "
    f"{'XFER/S':>7}"
)


TENANT_HEADER = (
    f"{'TENANT':<26} {'BAND':>4} {'WEIGHT':>6} {'INFLIGHT':>8} {'TOKENS':>8} {'QUEUED':>6} "
    f"{'QUEUE-S':>7}"
)


def render_tenant(t: TenantView) -> str:
    """One tenant of the gateway: its band and weight, what it has in flight
    (requests, tokens), waiting, and the recent mean wait of its queued requests."""

    def num(v: float | None, fmt: str = "{:.0f}") -> str:
        return "-" if v is None else fmt.format(v)

    return (
        f"{_fit(t.tenant, 26):<26} {num(t.priority):>4} "
        f"{num(t.weight, '{:g}'):>6} {num(t.inflight):>8} "
        f"{num(t.inflight_tokens):>8} {num(t.queued):>6} "
        f"{num(t.queue_s, '{:.2f}'):>7}"
    ).rstrip()


def describe_decision(d: Mapping[str, Any]) -> str:
    when = d.get("time")
    if isinstance(when, (int, float)):
        when = time.strftime("%H:%M:%S", time.localtime(when))
    return f"{d.get('role')} {d.get('from')} -> {d.get('to')} at {when}: {d.get('reason')}"


def render(views: list[FleetView], width: int = WIDTH) -> str:
    lines: list[str] = []
    for view in views:
        if lines:
            lines.append("")
        lines.append(f"{view.service}  {view.where}  {view.gateway}")
        lines.append(HEADER)
        lines.extend(render_row(r) for r in view.rows)
        if not view.rows:
            lines.append("(no engines)")
        if view.tenants:
            lines.append(TENANT_HEADER)
            lines.extend(render_tenant(t) for t in view.tenants)
        last = "none yet" if view.decision is None else describe_decision(view.decision)
        lines.append(f"autoscaler: {last}")
        if view.peer_pull is not None:
            lines.append(view.peer_pull)
        if any(r.sample is not None and r.sample.error == UNAUTHORIZED for r in view.rows):
            lines.append(
                f"denied: run as the user who ran `pdfleet up` (its run's {SECRET_FILE} file)"
            )
            lines.append("        or set PDFLEET_FLEET_SECRET to the fleet's secret")
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in lines)


def peer_pull_line(text: str) -> str | None:
    """``peer pulls: crossover N tokens; pull a, holder b, recompute c`` from a
    gateway's /metrics (docs/peer-pull.md); None when its peer pulls are off."""
    scrape = m.parse_metrics(
        text, only=(m.GATEWAY_PEER_PULL_FLEET_CROSSOVER.name, m.GATEWAY_PEER_PULL_DECISIONS.name)
    )
    crossover = scrape.total(m.GATEWAY_PEER_PULL_FLEET_CROSSOVER.name)
    if not crossover:  # absent, or 0: the gateway's peer pulls are off
        return None
    counts: dict[str, float] = {}
    for labels, value in scrape.samples.get(m.GATEWAY_PEER_PULL_DECISIONS.name, ()):
        decision = labels.get(m.DECISION, "?")
        counts[decision] = counts.get(decision, 0.0) + value
    if crossover < 0:
        where = "crossover not measured yet"
    elif crossover == float("inf"):
        where = "crossover: pulling never wins"
    else:
        where = f"crossover {crossover:.0f} tokens"
    done = ", ".join(f"{d} {counts.get(d, 0.0):.0f}" for d in m.PEER_PULL_DECISIONS)
    return f"peer pulls: {where}; {done}"


# -- scraping ---------------------------------------------------------------------------


def metrics_headers(run: Path | None = None) -> dict[str, str]:
    """The engines' bearer token (the fleet secret's derived key): from
    $PDFLEET_FLEET_SECRET (or its _FILE) when set, else from the run directory's
    secret file (readable by the user who ran `pdfleet up` only); none otherwise."""
    secret = fleet_secret_from_env()
    if secret is None and run is not None:
        try:
            secret = (run / SECRET_FILE).read_bytes().strip() or None
        except OSError:  # another user's run, or a run from before the file existed
            secret = None
    return {"authorization": f"Bearer {fleet_token(secret)}"} if secret else {}


UNAUTHORIZED = "unauthorized"


def scrape(get: Callable[[], str], clock: Callable[[], float] = time.time) -> Sample:
    at = clock()
    try:
        return Sample(at, parse_metrics(get()))
    except Exception as e:  # unreachable, refused, not Prometheus text: shown as down
        status = getattr(getattr(e, "response", None), "status_code", None) or getattr(
            e, "status", None
        )
        if status in (401, 403):
            return Sample(at, error=UNAUTHORIZED)
        return Sample(at, error=f"{type(e).__name__}: {e}")


# -- local ------------------------------------------------------------------------------


def find_run(run_dir: Path) -> Path:
    """``run_dir`` itself when it is a run, else its newest run."""
    if (run_dir / STATE_FILE).exists():
        return run_dir
    runs = sorted((p for p in run_dir.glob(f"*/{STATE_FILE}")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise ValueError(
            f"no pdfleet up run in {run_dir} (no */{STATE_FILE}); give --run-dir the "
            "directory `pdfleet up --run-dir` used, or --namespace for a cluster"
        )
    return runs[-1].parent


class LocalSource:
    def __init__(self, run_dir: Path) -> None:
        self.run = find_run(run_dir)
        self.client = httpx.Client(timeout=SCRAPE_TIMEOUT, headers=metrics_headers(self.run))

    def views(self, previous: Mapping[str, Sample]) -> list[FleetView]:
        state = read_state(self.run)  # fleet.json, its carrier's refusals name the field
        alive = supervisor_alive(state)
        rows = []
        for e in state.engines:
            engine_state = e.state if alive else STOPPED
            row = EngineRow(e.name, e.role, engine_state, previous=previous.get(e.name))
            if engine_state in ("ready", "draining"):
                row.sample = scrape(functools.partial(self._get, e.url))
            rows.append(row)
        gw = state.gateway
        gw_state = gw.state if alive else STOPPED
        if gw_state == "ready" and gw.url and not self._answers(gw.url):
            gw_state = "down"
        tenants = self._tenants(gw.url) if gw_state == "ready" else None
        decisions = state.last_decisions
        peer = None
        if gw_state == "ready" and gw.url:
            try:
                peer = peer_pull_line(self._get(gw.url))
            except (httpx.HTTPError, ValueError):
                peer = None
        return [
            FleetView(
                state.service,
                self.run.name,  # the run's directory name: fits the line
                f"gateway {gw.url or '-'} {gw_state}".rstrip(),
                rows,
                decisions[-1] if decisions else None,
                stopped=not alive,
                peer_pull=peer,
                tenants=tenants,
            )
        ]

    def _tenants(self, url: str) -> list[TenantView] | None:
        """The gateway's tenants (its /engines, which the fleet token may read)."""
        try:
            resp = self.client.get(url + "/engines")
            resp.raise_for_status()
            return EnginesView.decode(resp.content).tenants
        except (httpx.HTTPError, ValueError):
            return None

    def _answers(self, url: str) -> bool:
        """Whether the gateway accepts a connection and answers /health (any status:
        503 there means no routable decode engine, which the rows show)."""
        try:
            self.client.get(url + "/health")
        except httpx.HTTPError:
            return False
        return True

    def _get(self, url: str) -> str:
        resp = self.client.get(url + "/metrics")
        resp.raise_for_status()
        return resp.text

    def close(self) -> None:
        self.client.close()


# -- cluster ----------------------------------------------------------------------------


def pod_state(pod: Mapping[str, Any]) -> str:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "draining"
    if status.get("phase") in ("Failed", "Succeeded"):
        return "down"
    for c in status.get("containerStatuses") or []:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            return "crashing"
    return "ready" if pod_ready(pod) else "starting"


def pod_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return ENGINE_PORT


def cluster_views(
    get: Callable[[str], str],
    namespace: str,
    name: str | None,
    previous: Mapping[str, Sample],
) -> list[FleetView]:
    """Views of the InferenceServices of ``namespace``; ``get(path)`` reads an API path."""
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    if name:
        services = [json.loads(get(f"{base}/{name}"))]
    else:
        services = json.loads(get(base)).get("items") or []
    views = []
    for svc in services:
        svc_name = svc["metadata"]["name"]
        status = read_status(svc.get("status"))
        # Engines, less the workers of multi-node groups (their leader serves /metrics).
        selector = (
            f"{LABEL_SERVICE}={svc_name},{LABEL_ROLE} in (prefill,decode),"
            f"{LABEL_GROUP_ROLE}!={WORKER}"
        )
        pods = (
            json.loads(
                get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={_quote(selector)}")
            ).get("items")
            or []
        )
        rows = []
        for pod in sorted(
            pods, key=lambda p: (p["metadata"]["labels"].get(LABEL_ROLE, ""), p["metadata"]["name"])
        ):
            pod_name = pod["metadata"]["name"]
            role = pod["metadata"]["labels"].get(LABEL_ROLE, "?")
            row = EngineRow(pod_name, role, pod_state(pod), previous=previous.get(pod_name))
            if row.state in ("ready", "draining"):
                path = (
                    f"/api/v1/namespaces/{namespace}/pods/{pod_name}:{pod_port(pod)}/proxy/metrics"
                )
                row.sample = scrape(functools.partial(get, path))
            rows.append(row)
        decisions = status.autoscaling.last_decisions if status is not None else []
        phase = (
            status.phase if status is not None and "phase" in status.model_fields_set else "Unknown"
        )
        roles = status.roles if status is not None else None
        summary = " ".join(
            f"{r} {getattr(roles, r).summary}"
            for r in ("prefill", "decode", "gateway")
            if roles is not None and r in roles.model_fields_set
        )
        views.append(
            FleetView(
                svc_name,
                f"ns/{namespace} {phase}",
                summary or ((status.url if status is not None else None) or ""),
                rows,
                decisions[-1].model_dump(by_alias=True, mode="json") if decisions else None,
            )
        )
    return views


def read_status(raw: Any) -> InferenceServiceStatus | None:
    """An InferenceService's status as the operator wrote it; None when there
    is none yet or it cannot be read (another operator version's)."""
    if not raw:
        return None
    try:
        return InferenceServiceStatus.model_validate(raw)
    except ValidationError as e:
        logger.debug("unreadable InferenceService status: %s", e)
        return None


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="=,")


class ClusterSource:
    """Reads through the API server with the kubeconfig (or in-cluster) credentials."""

    def __init__(self, namespace: str, name: str | None) -> None:
        from kubernetes import client, config

        try:
            config.load_kube_config()
        except Exception:
            try:
                config.load_incluster_config()
            except Exception as e:
                raise ValueError(
                    f"no Kubernetes credentials (kubeconfig or in-cluster): {e}; set KUBECONFIG "
                    "or use --run-dir for a local fleet"
                ) from None
        self.api = client.ApiClient()
        self.namespace, self.name = namespace, name

    def _get(self, path: str) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            status, reason, data = self._request(path)
        except ApiException as e:
            status, reason, data = e.status, e.reason, b""
        if status == 404 and "/proxy/" not in path:
            raise ValueError(f"not found: {path} (wrong --namespace or --name?)")
        if not 200 <= (status or 0) < 300:
            raise ApiException(status=status, reason=reason)
        return data.decode()

    def _request(self, path: str) -> tuple[int, str, bytes]:
        """GET ``path`` with the client's credentials: (status, reason, body)."""
        api: Any = self.api
        if not hasattr(api, "param_serialize"):  # older clients: call_api does it all
            data, status, _headers = api.call_api(
                path,
                "GET",
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=SCRAPE_TIMEOUT,
            )
            return status, "", data.data
        method, url, headers, body, post = api.param_serialize(
            "GET", path, auth_settings=["BearerToken"]
        )
        resp = api.call_api(
            method,
            url,
            header_params=headers,
            body=body,
            post_params=post,
            _request_timeout=SCRAPE_TIMEOUT,
        )
        return resp.status, resp.reason, resp.read()

    def views(self, previous: Mapping[str, Sample]) -> list[FleetView]:
        return cluster_views(self._get, self.namespace, self.name, previous)

    def close(self) -> None:
        self.api.close()


# -- command ----------------------------------------------------------------------------


def collect(source: Any, previous: dict[str, Sample]) -> list[FleetView]:
    """One refresh; remembers each engine's sample for the next one's rates."""
    views: list[FleetView] = source.views(previous)
    previous.clear()
    for view in views:
        for row in view.rows:
            if row.sample is not None and row.sample.error is None:
                previous[row.name] = row.sample
    return views


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "status",
        help="one line per engine of a local or Kubernetes fleet",
        description="Role, state, running/waiting requests, KV-cache usage, prefix-cache hit "
        "rate and KV transfers/s of every engine, and the autoscaler's last decision. Local "
        "(a `pdfleet up` run directory) by default; --namespace reads a cluster through the "
        "API server. See docs/observability.md.",
    )
    parser.add_argument(
        "--run-dir",
        default="runs",
        help="`pdfleet up`'s --run-dir (its newest run) or one run's directory (default runs).",
    )
    parser.add_argument(
        "--namespace",
        default=None,
        help="Read the InferenceServices of this Kubernetes namespace instead.",
    )
    parser.add_argument("--name", default=None, help="Only this InferenceService (--namespace).")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=WATCH_SECONDS,
        const=EVERY_INTERVAL,  # given without SECONDS
        default=None,
        metavar="SECONDS",
        help="Refresh in place every SECONDS (default: --interval) until Ctrl-C.",
    )
    parser.add_argument(
        "--interval",
        type=WATCH_SECONDS,
        default=2.0,
        help="Seconds between refreshes with a bare --watch; without --watch, the two "
        "scrapes that give XFER/S are min(1, interval) apart (default 2).",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # httpx logs every scrape at INFO, which would scroll the table away.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.watch is not None and args.watch is not EVERY_INTERVAL:
        args.interval = args.watch  # (both bounded by their argparse type)
    if args.name and not args.namespace:
        raise ValueError("--name needs --namespace (it names an InferenceService)")
    source: Any = (
        ClusterSource(args.namespace, args.name)
        if args.namespace
        else LocalSource(Path(args.run_dir))
    )
    previous: dict[str, Sample] = {}
    try:
        if args.watch is None:
            collect(source, previous)
            time.sleep(min(1.0, args.interval))
            views = collect(source, previous)
            print(render(views))
            return EXIT_STOPPED if views and all(v.stopped for v in views) else 0
        while True:
            text = render(collect(source, previous))
            stamp = time.strftime("%H:%M:%S")
            # Home, clear to the end: redraw in place without scrolling.
            sys.stdout.write(
                f"\x1b[H\x1b[2J{text}\n\n(every {args.interval:g}s, {stamp}; Ctrl-C stops)\n"
            )
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        source.close()
