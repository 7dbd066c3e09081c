"""``pdfleet up [FILE.yaml]``: run an InferenceService on this machine."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ...engine.config.dataclass_cli import add_dataclass_arguments
from ...engine.config.fields import bounded_seconds, optional_of
from ...engine.config.gateway import FLOAT_BOUNDS, check_float
from ...engine.contracts import security
from ...engine.contracts.launch import python_module
from ..resource import AdapterSpec
from .process import GiB, resident_bytes

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_service() -> dict[str, Any]:
    """The embedded default: SmolLM2-135M-Instruct (shipped with pdfleet), one prefill
    and one decode engine."""
    connector = "NixlConnector" if importlib.util.find_spec("nixl_cu12") else "ZmqConnector"
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smollm2"},
        "spec": {
            "model": {"name": DEFAULT_MODEL, "uri": f"builtin://{DEFAULT_MODEL}"},
            "engine": {"maxModelLen": 2048, "maxNumSeqs": 64},
            "kvTransfer": {"connector": connector},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "disaggregation": {"mode": "Conditional", "minPromptTokens": 32},
            "gateway": {"port": 8000},
        },
    }


def resolve_model(uri: str, revision: str | None, say: Callable[[str], None]) -> str:
    """A local model directory for ``spec.model.uri``: ``builtin://`` models are
    prepared and ``hf://`` models downloaded (into pdfleet's and the Hugging Face
    cache) once, by ``pdfleet fetch-model``, whose progress is shown."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        if not os.path.exists(rest):
            raise ValueError(f"spec.model.uri: {rest!r} does not exist on this machine")
        if not rest.endswith(".gguf"):
            return rest
    elif scheme not in ("builtin", "hf"):
        raise ValueError(
            f"spec.model.uri: {uri!r} only exists in Kubernetes; `pdfleet up` needs "
            "file:///PATH, builtin://NAME or hf://ORG/NAME"
        )
    say(f"preparing {uri} ...")
    command = python_module("pdfleet.engine.cli", "fetch-model", uri)
    if revision and scheme == "hf":
        command += ["--revision", revision]
    # stderr (progress) goes to the terminal; stdout is the directory.
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=3600)
    if done.returncode != 0:
        raise ValueError(f"spec.model.uri: cannot prepare {uri} (see the message above)")
    return done.stdout.strip().splitlines()[-1]


def resolve_adapters(adapters: list[AdapterSpec], say: Callable[[str], None]) -> dict[str, str]:
    """A local directory for each of spec.adapters: file:// as it is (it must
    exist), hf:// downloaded into the Hugging Face cache by ``pdfleet
    fetch-model --adapter``; pvc:// only exists in Kubernetes."""
    paths: dict[str, str] = {}
    for i, adapter in enumerate(adapters):
        scheme, _, rest = adapter.source.partition("://")
        where = f"spec.adapters[{i}].source"
        if scheme == "file":
            if not os.path.isdir(rest):
                raise ValueError(f"{where}: {rest!r} is not a directory on this machine")
            paths[adapter.name] = rest
            continue
        if scheme != "hf":
            raise ValueError(
                f"{where}: {adapter.source!r} only exists in Kubernetes; `pdfleet up` needs "
                "file:///PATH or hf://ORG/NAME"
            )
        say(f"fetching adapter {adapter.name} ({adapter.source}) ...")
        command = python_module("pdfleet.engine.cli", "fetch-model", adapter.source, "--adapter")
        if adapter.revision:
            command += ["--revision", adapter.revision]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=3600)
        if done.returncode != 0:
            raise ValueError(f"{where}: cannot fetch {adapter.source} (see the message above)")
        paths[adapter.name] = done.stdout.strip().splitlines()[-1]
    return paths


@dataclass(frozen=True)
class UpOptions:
    """How ``pdfleet up`` runs the processes (the service itself is the file)."""

    host: str = "127.0.0.1"
    """Address every process binds."""
    port: int | None = None
    """Gateway port (default: spec.gateway.port; a free one if taken)."""
    run_dir: str = "runs"
    """Where logs and the engines file go."""
    threads_per_engine: int | None = None
    """Torch threads per engine (default: (CPU cores - 1) / engines, at least 1)."""
    timeout: float = 600.0
    """Seconds to wait for every process to become ready."""
    direct_engine_access: bool = False
    """Engines accept the client API keys too (for clients that call an engine
    directly); without it only the gateway does. A client key never may send
    internal fields (kv_transfer_params) to an engine."""
    tenants_file: str | None = None
    """The gateway's tenants file (YAML or JSON, docs/flow-control.md): what
    spec.gateway.tenants names in Kubernetes, a Secret or ConfigMap, which
    `pdfleet up` cannot read."""
    stall_timeout: float | None = None
    """The gateway's least stall limit in seconds: an engine with requests in
    flight that sends nothing for longer (and for --stall-step-multiple of its
    longest recent steps) counts as stalled (spec.gateway.stallTimeoutSeconds,
    which this overrides; default 5)."""
    stall_step_multiple: float | None = None
    """How many of an engine's longest recent steps without progress make a
    stall (spec.gateway.stallStepMultiple, which this overrides; default 4)."""
    stall_max_step: float | None = None
    """Seconds one engine step may run before the engine counts as stalled
    although it answers its checks (spec.gateway.stallMaxStepSeconds, which
    this overrides; default max(120, stall timeout × multiple))."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "up",
        help="run an InferenceService on this machine (gateway + prefill + decode engines)",
        description="Start the gateway and the prefill and decode engines of an InferenceService "
        "as local processes, print the endpoint, and supervise them until Ctrl-C. With no file: "
        "SmolLM2-135M-Instruct (builtin://smollm2-135m-instruct), one prefill and one decode "
        "engine, Conditional mode.",
    )
    parser.add_argument("file", nargs="?", metavar="FILE.yaml", help="an InferenceService")
    # The gateway overrides are bounded as the gateway's own flags are.
    for action in add_dataclass_arguments(parser, UpOptions):
        bounds = FLOAT_BOUNDS.get(action.dest)
        if bounds is not None:
            low, high, open_low = bounds
            unit = "a multiple" if action.dest == "stall_step_multiple" else "seconds"
            action.type = optional_of(bounded_seconds(low, high, open_low=open_low, unit=unit))
    parser.set_defaults(func=run)
    return parser


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def run(args: argparse.Namespace) -> int:
    from ..resource import load_inference_service
    from .fleet import LocalFleet, fleet_credentials, free_port
    from .process_autoscaler import LocalAutoscaler
    from .rollout import service_problems
    from .state import FleetStateWriter

    def say(msg: str) -> None:
        print(msg, flush=True)

    # Health checks and scrapes every half second would drown the progress lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    service = load_inference_service(args.file if args.file else default_service())
    problems = service_problems(service)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    apply_gateway_overrides(service, args)
    if service.spec.gateway.tenants is not None and not args.tenants_file:
        raise ValueError(
            "spec.gateway.tenants names a Secret or ConfigMap, which only exists in "
            "Kubernetes: give the file itself with --tenants-file"
        )
    fleet_secret, api_keys = fleet_credentials()
    model_path = resolve_model(service.spec.model.uri, service.spec.model.revision, say)
    adapter_paths = resolve_adapters(service.spec.adapters, say)
    port = args.port or service.spec.gateway.port
    if args.port is None and not _port_free(args.host, port):
        port = free_port(args.host)
    run_dir = Path(args.run_dir) / f"{service.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    fleet = LocalFleet(
        service,
        model_path,
        run_dir,
        host=args.host,
        gateway_port=port,
        threads_per_engine=args.threads_per_engine,
        say=say,
        fleet_secret=fleet_secret,
        api_keys=api_keys,
        direct_engine_access=args.direct_engine_access,
        adapter_paths=adapter_paths,
    )
    if args.tenants_file:
        fleet.tenants_file = str(Path(args.tenants_file).resolve())
    fleet.gateway_config()  # what the gateway would refuse, refused before anything starts
    stop = threading.Event()
    reload = threading.Event()  # SIGHUP: `pdfleet apply` left a new resource

    def on_signal(signum: int, frame: FrameType | None) -> None:
        (reload if signum == signal.SIGHUP else stop).set()

    previous = {
        s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    say(f"pdfleet up: {service.name} ({service.spec.model.name}) — logs in {run_dir}")
    state = FleetStateWriter(fleet)  # fleet.json, for `pdfleet status`
    fleet.progress = state.write
    autoscaler = None
    try:
        fleet.start(timeout=args.timeout)
        state.write()
        url = f"http://{args.host}:{port}"
        say(f"\nready: {url}/v1  (model {service.spec.model.name!r})")
        say(memory_report(fleet))
        say(usage_lines(url, service.spec.model.name, api_keys, os.environ))
        say("Ctrl-C stops every process.\n")
        scaling = service.spec.autoscaling
        autoscaler = LocalAutoscaler(fleet, scaling) if scaling is not None else None
        next_scale = time.monotonic()
        rollout = None
        while not stop.wait(0.5):
            fleet.tick()
            if reload.is_set():
                reload.clear()
                rollout = take_apply(fleet, state, rollout, args, autoscaler is not None, say)
            if rollout is not None and rollout.is_alive():
                state.write(autoscaler)
                continue  # the autoscaler waits for the rollout
            if autoscaler is not None and (
                time.monotonic() >= next_scale or autoscaler.activation_pending()
            ):
                next_scale = time.monotonic() + autoscaler.spec.period_seconds
                autoscaler.step()
            state.write(autoscaler)
    except (RuntimeError, TimeoutError) as e:
        say(f"pdfleet up: {e}")
        fleet.stop()
        state.write(autoscaler, stopped=True)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    say("stopping ...")
    fleet.stop()
    state.write(autoscaler, stopped=True)
    say("stopped")
    return 0


def take_apply(
    fleet: Any,
    state: Any,
    running: Any,
    args: argparse.Namespace,
    autoscaling: bool,
    say: Callable[[str], None],
) -> Any:
    """Start the rollout `pdfleet apply` asked for (its request file in the run
    directory), or record why it is refused (the fleet untouched). The
    rollout that runs afterwards (``running`` when one still runs)."""
    from ..resource import load_inference_service
    from .rollout import ApplyStatus, Rollout, plan, read_request
    from .state import APPLY_FILE

    path = fleet.run_dir / APPLY_FILE
    try:
        text = path.read_text()
        path.unlink()
    except OSError:
        return running  # a stray SIGHUP
    status = ApplyStatus()
    state.apply = status
    try:
        status.id, resource = read_request(text)
        if running is not None and running.is_alive():
            raise ValueError("another apply is still rolling the fleet; wait for it")
        service = load_inference_service(resource)
        # The gateway flags `pdfleet up` was given still override the file.
        apply_gateway_overrides(service, args)

        def resolve(s: Any) -> str:
            return resolve_model(s.spec.model.uri, s.spec.model.revision, say)

        todo = plan(fleet, service, resolve, autoscaling, lambda new: resolve_adapters(new, say))
    except ValueError as e:
        status.state, status.message = "failed", str(e)
        say(f"! apply refused: {e}")
        state.write()
        return running
    say(f"apply: {todo.summary()}")
    rollout = Rollout(fleet, todo, status, ready_timeout=args.timeout)
    rollout.start()
    return rollout


def apply_gateway_overrides(service: Any, args: argparse.Namespace) -> None:
    """Mutates: ``--stall-timeout`` / ``--stall-step-multiple`` /
    ``--stall-max-step`` replace the file's ``spec.gateway`` values (bounded as
    the gateway's flags and the resource bound them)."""
    fields = {
        "stall_timeout": "stall_timeout_seconds",
        "stall_step_multiple": "stall_step_multiple",
        "stall_max_step": "stall_max_step_seconds",
    }
    update = {}
    for flag_field, spec_field in fields.items():
        value = getattr(args, flag_field, None)
        if value is not None:
            low, high, open_low = FLOAT_BOUNDS[flag_field]
            flag = "--" + flag_field.replace("_", "-")
            update[spec_field] = check_float(flag, value, low, high, open_low)
    if update:
        service.spec.gateway = service.spec.gateway.model_copy(update=update)


def usage_lines(url: str, model: str, api_keys: list[str], environ: Mapping[str, str]) -> str:
    """The sample requests printed once the fleet is ready. With API keys they
    carry the key header, naming $PDFLEET_API_KEY when it holds the one key (else a
    $KEY placeholder): a key itself is never printed. Without keys, the warning
    that anyone who can reach the gateway may use it."""
    lines = []
    if not api_keys:
        lines.append(
            f"warning: no API key: anyone who can reach {url} may use it (set "
            f"{security.API_KEY_ENV} or {security.API_KEY_FILE_ENV} before `pdfleet up`)"
        )
        auth = ""
    else:
        one_in_env = security.split_keys(environ.get(security.API_KEY_ENV, "")) == api_keys[:1]
        var = f"${security.API_KEY_ENV}" if one_in_env and len(api_keys) == 1 else "$KEY"
        auth = f' -H "Authorization: Bearer {var}"'
        if var == "$KEY":
            source = (
                security.API_KEY_ENV
                if environ.get(security.API_KEY_ENV)
                else f"the file ${security.API_KEY_FILE_ENV}"
            )
            lines.append(f"(set KEY to one of the API keys in {source})")
    lines.append(
        f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\''
    )
    lines.append(
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}]}}\''
    )
    return "\n".join(lines)


def memory_report(fleet: Any) -> str:
    """Resident memory of every process of the fleet and each engine's KV cache."""
    own = resident_bytes(os.getpid(), tree=False)
    parts, total, caches = [], own, []
    sized = chosen = 0
    for child in fleet.all_children():
        rss = resident_bytes(child.pid) if child.pid else 0
        total += rss
        parts.append(f"{child.name} {rss / GiB:.2f}")
        tokens = kv_cache_tokens(child.metrics_text()) if child.role != "gateway" else None
        if tokens is not None:
            budget = kv_cache_budget(child.argv)
            if budget is None:
                sized += 1
                caches.append(f"{child.name} {tokens:,}")
            else:
                chosen += 1
                caches.append(f"{child.name} {tokens:,} ({budget / GiB:.2f} GiB set)")
    text = (
        f"memory: {total / GiB:.2f} GiB resident in all ({', '.join(parts)}, "
        f"pdfleet up {own / GiB:.2f})"
    )
    if caches:
        how = []
        if chosen:
            how.append("set by kvCacheMemoryBytes" + (" where marked" if sized else ""))
        if sized:
            how.append(
                ("the others " if chosen else "")
                + "sized from the model and the free memory, set spec.engine.kvCacheMemoryBytes "
                "to choose"
            )
        text += f"\nKV cache (tokens): {', '.join(caches)}; {'; '.join(how)} (docs/local.md)"
    return text


def kv_cache_budget(argv: list[str]) -> int | None:
    """The KV cache bytes an engine's command line sets (`--kv-cache-memory-bytes`,
    from kvCacheMemoryBytes); None when it leaves the size to the engine."""
    from ...engine.config.fields import parse_human_int

    for i, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        if flag == "--kv-cache-memory-bytes":
            text = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return parse_human_int(text)
            except ValueError:
                return None
    return None


def kv_cache_tokens(metrics_text: str | None) -> int | None:
    """Tokens an engine's KV cache holds, from its cache_config_info series."""
    if not metrics_text:
        return None
    from ...engine.contracts import metrics as m

    labels = m.parse_metrics(metrics_text).labels(
        m.ENGINE_CACHE_CONFIG.name, m.VLLM_CACHE_CONFIG_INFO.name
    )
    try:
        return int(labels[m.BLOCK_SIZE]) * int(labels[m.NUM_GPU_BLOCKS]) if labels else None
    except (KeyError, ValueError):
        return None
