"""An InferenceService as local processes: engines per role, a gateway, supervision.

The fleet writes the gateway's engines file (atomically) whenever an engine
becomes ready, starts draining or goes away; the gateway re-reads it, so
engines join and leave routing at runtime. A child that dies unexpectedly is
reported and restarted. Scale-down drains: the victim leaves the engines
file; a prefill engine is stopped once it has no running or waiting requests
and no KV leases held for decode engines (a bounded wait), a decode engine
at once (SIGTERM: it hands its streams back to the gateway, which migrates
them; with ``maxMigrations: 0`` it too waits until idle). The autoscaler
(``process_autoscaler.py``, handed this fleet by ``pdfleet up``) decides when.

Every child gets the fleet secret in its environment (``$PDFLEET_FLEET_SECRET``,
given or generated per run); the gateway also gets the client API keys
(``$PDFLEET_API_KEY``, split as every component splits them). Engines get
the client keys only with ``direct_engine_access`` (``pdfleet up
--direct-engine-access``): a client key may then call an engine, but never
send it internal fields (docs/security.md). The fleet's own scrapes present
the fleet token. Every process binds ``host``
(loopback by default), the KV side channel included (docs/local.md).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ...engine.config.gateway import BATCH_DATABASE_ENV, GatewayConfig
from ...engine.contracts import identity, identity_exchange, security
from ...engine.contracts import metrics as m
from ...engine.contracts.engines_file import EngineEntry, EnginesFile
from ...engine.contracts.launch import python_module
from ..parallelism import engine_threads
from ..resource import InferenceService
from ..roles import (
    disaggregating,
    engine_command,
    gateway_peer_pull_settings,
    gateway_request_bounds,
    lends,
    publishes_kv_events,
    role_engine_args,
)
from .process import Child
from .state import SECRET_FILE, write_private

logger = logging.getLogger("pdfleet.up")

ROLES = ("prefill", "decode")
# Give up restarting a child that keeps dying this many times in a row.
MAX_RESTARTS = 5
# Engine identity tokens of a run: the authority lives only in this process, so
# the tokens are worthless after the run whatever their expiry.
IDENTITY_TTL_SECONDS = 365 * 86400.0


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on for a child to bind, below the kernel's
    ephemeral range: a port ``bind(0)`` picks can be taken as the local port of
    an outgoing connection before the child binds it. Never the same port twice
    in one run."""
    low = _ephemeral_low()
    if low > 11000:
        for _ in range(200):
            port = random.randrange(10000, low)  # noqa: S311 (a port pick, not a secret)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def fleet_credentials(environ: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(fleet secret, API keys) of a run: the secret from $PDFLEET_FLEET_SECRET
    (or its _FILE), else a new random one; the keys from $PDFLEET_API_KEY (or
    its _FILE). Raises ValueError naming the variable when one is unusable."""
    environ = dict(os.environ if environ is None else environ)
    secret = security.fleet_secret_from_env(environ)
    keys = security.api_keys_from_env(environ)
    return (secret.decode() if secret is not None else security.generate_secret()), keys


def scrape(
    url: str, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> dict[str, float] | None:
    """Summed samples of an engine's /metrics by name, or None if unreachable."""
    try:
        response = httpx.get(url + "/metrics", timeout=timeout, headers=headers or {})
        response.raise_for_status()
        text = response.text
    except httpx.HTTPError:
        return None
    return m.parse_metrics(text).totals()


def in_flight(sample: dict[str, float] | None) -> float:
    if sample is None:
        return float("inf")
    return (
        sample.get(m.ENGINE_NUM_REQUESTS_RUNNING.name, 0.0)
        + sample.get(m.ENGINE_NUM_REQUESTS_WAITING.name, 0.0)
        + sample.get(m.ENGINE_KV_TRANSFER_HELD_REQUESTS.name, 0.0)
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a cpuset)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


class LocalFleet:
    def __init__(
        self,
        service: InferenceService,
        model_path: str,
        run_dir: Path,
        host: str = "127.0.0.1",
        gateway_port: int | None = None,
        threads_per_engine: int | None = None,
        say: Callable[[str], None] = print,
        fleet_secret: str | None = None,
        api_keys: list[str] | None = None,
        direct_engine_access: bool = False,
        adapter_paths: dict[str, str] | None = None,
    ) -> None:
        """``fleet_secret`` and ``api_keys``: see :func:`fleet_credentials`
        (a new secret when None); ``direct_engine_access``: engines accept the
        client API keys too (else only the gateway does); ``adapter_paths``:
        the local directory of each of spec.adapters (every engine loads them
        at start)."""
        self.service = service
        self.spec = service.spec
        self.model_path = model_path
        self.adapter_paths = dict(adapter_paths or {})
        self.run_dir = run_dir
        self.host = host
        self.say = say
        self.engines_file = run_dir / "engines.json"
        self.tenants_file: str | None = None
        """The gateway's tenants file (``pdfleet up --tenants-file``)."""
        self.roles = ROLES if disaggregating(self.spec) else ("decode",)
        self.engines: list[Child] = []
        self.counters = dict.fromkeys(ROLES, 0)
        # Engine name -> (KV event PUB, replay) endpoints, for the engines file.
        self.kv_events: dict[str, tuple[str, str]] = {}
        self.lock = threading.RLock()
        self.gateway_port = gateway_port or self.spec.gateway.port
        total = sum(self.replicas_in_spec(r) for r in self.roles)
        self.threads = threads_per_engine or engine_threads(usable_cores(), total)
        self.gateway: Child | None = None
        self._stop = threading.Event()
        self.drain_timeout = self.spec.kv_transfer.lease_seconds + 30.0
        secret = fleet_secret or security.generate_secret()
        self.secret = secret
        self.progress: Callable[[], None] = lambda: None
        """Called while :meth:`start` waits (``pdfleet up`` rewrites fleet.json)."""
        # What every child gets: the secret; the gateway also the client keys (one
        # comma-separated list, split with security.split_keys), engines only when
        # asked for direct access. An empty value also hides a key this process has.
        self.child_env = {
            security.FLEET_SECRET_ENV: secret,
            security.API_KEY_ENV: "",
            security.API_KEY_FILE_ENV: "",
        }
        self.gateway_env = {**self.child_env, security.API_KEY_ENV: ",".join(api_keys or [])}
        if direct_engine_access:
            self.child_env[security.API_KEY_ENV] = self.gateway_env[security.API_KEY_ENV]
        token = security.fleet_token(secret.encode())
        self.auth_headers = {"Authorization": f"Bearer {token}"}
        # The identity authority of the run: its private key never leaves this
        # process; each engine gets its own key and token (owner-only file) and
        # the authority's public key (docs/security.md, "Identities").
        self.authority = identity.Authority.generate()

    def replicas_in_spec(self, role: str) -> int:
        if role == "prefill" and not disaggregating(self.spec):
            return 0
        return self.spec.role(role).replicas

    # -- children ---------------------------------------------------------------------

    def _engine_child(self, role: str) -> Child:
        index = self.counters[role]
        self.counters[role] += 1
        name = f"{role}-{index}"
        port = free_port(self.host)
        events = None
        if publishes_kv_events(self.spec, role):
            events = (
                f"tcp://{self.host}:{free_port(self.host)}",
                f"tcp://{self.host}:{free_port(self.host)}",
            )
            self.kv_events[name] = events
        args = role_engine_args(
            self.spec,
            role,
            model_path=self.model_path,
            kv_ip=self.host,
            kv_port=free_port(self.host),
            engine_id=f"{self.service.name}-{name}-{port}",
            kv_events=events,
            adapter_paths=self.adapter_paths,
        )
        argv = python_module(
            "pdfleet.engine.cli",
            *engine_command(args, host=self.host, port=port, serving=self.spec.serving)[1:],
        )
        return Child(
            name,
            role,
            argv,
            port,
            self.run_dir / f"{name}.log",
            env={
                **self.child_env,
                # An engine that lends and pulls (kv_both) is vouched for as both:
                # a prefill engine's identity alone may not claim a peer's lease.
                **self._identity_env(name, "both" if lends(self.spec, role) else role),
                "OMP_NUM_THREADS": str(self.threads),
            },
            host=self.host,
            headers=self.auth_headers,
        )

    def _identity_env(self, name: str, role: str) -> dict[str, str]:
        """A new identity for engine ``name`` (its own key, vouched for by this run's
        authority), in an owner-only file; the variables that point the engine at it.
        With ``kvTransfer.identity: Disabled`` no identity (the fleet secret alone).
        Either way, empty values hide identity variables this process's
        environment may hold."""
        hidden = {
            identity.IDENTITY_FILE_ENV: "",
            identity.IDENTITY_AUTHORITY_ENV: "",
            identity_exchange.ENDPOINT_ENV: "",
        }
        if self.spec.kv_transfer.identity == "Disabled":
            return hidden
        folder = self.run_dir / "identity"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"{name}.json"
        engine = identity.EngineIdentity.issue(
            self.authority,
            f"{self.service.name}/{name}",
            role,
            self.service.name,
            IDENTITY_TTL_SECONDS,
        )
        engine.write(path)
        return {
            **hidden,
            identity.IDENTITY_FILE_ENV: str(path.resolve()),
            identity.IDENTITY_AUTHORITY_ENV: self.authority.public_key,
        }

    def add_engine(self, role: str) -> Child:
        child = self._engine_child(role)
        child.start()
        with self.lock:
            self.engines.append(child)
        self.say(f"  starting {child.name} on {child.url} (log: {child.log_path})")
        return child

    def gateway_config(
        self, service: InferenceService | None = None, model_path: str | None = None
    ) -> GatewayConfig:
        """The gateway's settings for ``service`` (default: the fleet's)."""
        spec = (service or self.service).spec
        # The Batch API's state: the PostgreSQL database this process's environment
        # names (the gateway reads the variable itself), else files and SQLite
        # with the run. A resource that asks for a database names a Kubernetes
        # Secret, which a local run cannot read: it needs the variable.
        database = os.environ.get(BATCH_DATABASE_ENV)
        batch = spec.gateway.batch
        if not database and batch is not None and batch.database_secret is not None:
            raise ValueError(
                "gateway.batch.databaseSecret names a Kubernetes Secret, which pdfleet up "
                f"cannot read: set ${BATCH_DATABASE_ENV} to the database's URL"
            )
        return GatewayConfig(
            host=self.host,
            port=self.gateway_port,
            engines_file=str(self.engines_file),
            disaggregation_mode=spec.disaggregation.mode,
            min_prompt_tokens=spec.disaggregation.min_prompt_tokens,
            tokenizer=model_path or self.model_path,
            # The engines' template: the gateway renders chat prompts with it too.
            chat_template=spec.serving.chat_template,
            served_model_name=[spec.model.name],
            scrape_interval=1.0,
            **(spec.autoscaling.gateway_settings() if spec.autoscaling else {}),
            **gateway_request_bounds(spec),
            trust_client_trace_context=spec.gateway.trust_client_trace_context,
            tenants_file=self.tenants_file,
            data_dir=None if database else str((self.run_dir / "gateway-data").resolve()),
            **spec.gateway.overload_settings(),
            **gateway_peer_pull_settings(spec),
        )

    def gateway_metrics_text(self) -> str | None:
        """The gateway's ``/metrics`` (the autoscaler reads its activation counter)."""
        gateway = self.gateway
        return gateway.metrics_text(timeout=2.0) if gateway is not None else None

    def write_engines_file(self) -> None:
        with self.lock:
            engines = []
            for c in self.engines:
                if not (c.ready and not c.draining and c.alive()):
                    continue
                events, replay = self.kv_events.get(c.name, (None, None))
                engines.append(EngineEntry(c.url, c.role, c.name, events, replay))
            tmp = self.engines_file.with_suffix(".tmp")
            # Owner-only, as the whole run directory: it names every port.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(EnginesFile(tuple(engines)).encode())
            os.replace(tmp, self.engines_file)

    # -- lifecycle --------------------------------------------------------------------

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"

    def start(self, timeout: float = 600.0) -> None:
        # The engines file, the state file and the logs name every port (and the
        # identity files hold private keys): only this user may read them.
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        # For `pdfleet status` run by the same user (0600: nobody else reads it).
        write_private(self.run_dir / SECRET_FILE, self.secret)
        self.write_engines_file()
        for role in self.roles:
            for _ in range(self.replicas_in_spec(role)):
                self.add_engine(role)
        deadline = time.monotonic() + timeout
        pending = list(self.engines)
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise RuntimeError(
                        f"{child.name} exited with code {child.returncode} while loading:\n"
                        f"{child.log_tail()}"
                    )
                if child.healthy():
                    child.mark_ready()
                    pending.remove(child)
                    self.say(f"  {child.name} ready in {time.monotonic() - child.started_at:.1f}s")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"engines not ready after {timeout:.0f}s: {', '.join(c.name for c in pending)}"
                )
            self.progress()
            time.sleep(0.2)
        self.write_engines_file()
        gw = self.gateway_config()
        argv = python_module("pdfleet.engine.cli", "gateway", *gw.to_cli_args())
        self.gateway = Child(
            "gateway",
            "gateway",
            argv,
            self.gateway_port,
            self.run_dir / "gateway.log",
            env=self.gateway_env,
            host=self.host,
            headers=self.auth_headers,
        )
        self.gateway.start()
        while not self.gateway.healthy():
            if not self.gateway.alive():
                raise RuntimeError(
                    f"the gateway exited with code {self.gateway.returncode}:\n"
                    f"{self.gateway.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not become healthy")
            self.progress()
            time.sleep(0.2)
        self.gateway.mark_ready()

    def tick(self) -> None:
        """Promote engines that became ready; report and restart dead children."""
        changed = False
        with self.lock:
            children = [*self.engines, *([self.gateway] if self.gateway else [])]
        for child in children:
            if child.stopping:
                continue
            if not child.alive():
                code = child.returncode
                if child.restarts >= MAX_RESTARTS:
                    self.say(f"! {child.name} keeps exiting (code {code}); giving up on it")
                    child.stopping = True
                    changed = True
                    continue
                child.restarts += 1
                self.say(
                    f"! {child.name} exited with code {code}; restarting "
                    f"(#{child.restarts}, log: {child.log_path})"
                )
                if child is not self.gateway:
                    child.argv = self.restart_argv(child.argv)
                child.start()
                changed = True
            elif not child.ready and child.healthy():
                child.mark_ready()
                changed = True
                self.say(f"  {child.name} ready")
        if changed:
            self.write_engines_file()

    def restart_argv(self, argv: list[str]) -> list[str]:
        """An engine's command line for a restart: as it first started, but
        loading the adapters spec.adapters lists now (``pdfleet apply`` loads
        and unloads them on running engines without changing their command
        lines). Untouched for a service without spec.adapters, whose engine
        section may set --lora-modules itself."""
        with self.lock:
            if not self.spec.adapters or "--enable-lora" not in argv:
                return argv
            modules = [
                f"{a.name}={self.adapter_paths[a.name]}"
                for a in self.spec.adapters
                if a.name in self.adapter_paths
            ]
        out = list(argv)
        if "--lora-modules" in out:
            # Its values run up to the next flag (names and paths never start with "--").
            i = out.index("--lora-modules")
            j = i + 1
            while j < len(out) and not out[j].startswith("--"):
                j += 1
            del out[i:j]
        if modules:
            out += ["--lora-modules", *modules]
        return out

    def role_engines(self, role: str) -> list[Child]:
        with self.lock:
            return [c for c in self.engines if c.role == role and not c.draining and not c.stopping]

    def engines_of(self, role: str) -> list[Child]:
        """Every engine of ``role`` still running: starting, ready or draining."""
        with self.lock:
            return [c for c in self.engines if c.role == role and not c.stopping]

    def drain(self, child: Child, migrate: bool = True) -> threading.Thread:
        """Stop routing to ``child``; stop it once idle (bounded wait).
        ``migrate=False``: a decode engine too is stopped only once idle (its
        streams have no engine of their compatibility hash to move to)."""
        child.draining = True
        self.write_engines_file()
        self.say(f"  draining {child.name}")

        # A decode engine hands its streams back to the gateway on SIGTERM, which
        # resumes them elsewhere (docs/migration.md): no wait for them to end.
        migrates = migrate and child.role == "decode" and self.spec.gateway.max_migrations > 0

        def finish() -> None:
            deadline = time.monotonic() + self.drain_timeout
            # Once the gateway routes nothing new to it, wait for idle.
            self.wait_unrouted(child)
            while not migrates and time.monotonic() < deadline and child.alive():
                if in_flight(scrape(child.url, headers=child.headers)) == 0:
                    break
                time.sleep(0.5)
            code = child.stop(grace=15.0)
            with self.lock:
                if child in self.engines:
                    self.engines.remove(child)
                self.kv_events.pop(child.name, None)
            self.say(f"  {child.name} stopped (exit {code})")

        t = threading.Thread(target=finish, name=f"drain-{child.name}", daemon=True)
        t.start()
        return t

    def wait_unrouted(self, child: Child, timeout: float = 5.0) -> None:
        """Wait until the gateway routes nothing new to ``child`` (bounded): it has
        re-read the engines file without it, which its ``/metrics`` show by
        dropping the engine's series. Without a gateway answering, the bound."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            text = self.gateway_metrics_text()
            if text is not None:
                try:
                    engines = {
                        labels.get(m.ENGINE)
                        for labels, _ in m.parse_metrics(
                            text, only=[m.GATEWAY_ENGINE_HEALTHY.name]
                        ).samples.get(m.GATEWAY_ENGINE_HEALTHY.name, ())
                    }
                except ValueError:
                    engines = {child.url}
                if child.url not in engines:
                    return
            time.sleep(0.1)

    def discard(self, child: Child, grace: float = 15.0) -> None:
        """Stop ``child`` and forget it (an engine that never became ready)."""
        child.stopping = True
        child.stop(grace)
        with self.lock:
            if child in self.engines:
                self.engines.remove(child)
            self.kv_events.pop(child.name, None)
        self.write_engines_file()

    def use(
        self,
        service: InferenceService,
        model_path: str,
        adapter_paths: dict[str, str] | None = None,
    ) -> None:
        """Engines started from now on run ``service`` (from ``model_path``,
        with ``adapter_paths`` when given: each of its adapters' directory);
        running ones keep their command lines, restarts included, except for
        the adapters they load at start (:meth:`restart_argv`)."""
        with self.lock:
            self.service = service
            self.spec = service.spec
            self.model_path = model_path
            if adapter_paths is not None:
                self.adapter_paths = dict(adapter_paths)

    def stop(self, grace: float = 15.0) -> None:
        """Stop every child (gateway first, then engines in parallel), bounded."""
        self._stop.set()
        if self.gateway is not None:
            self.gateway.stop(grace)
        with self.lock:
            children = list(self.engines)
        threads = [threading.Thread(target=c.stop, args=(grace,)) for c in children]
        for t in threads:
            t.start()
        for t in threads:
            t.join(grace + 15)

    def all_children(self) -> list[Child]:
        with self.lock:
            return [*self.engines, *([self.gateway] if self.gateway else [])]
