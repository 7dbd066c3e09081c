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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfleet.engine.config.dataclass_cli import add_dataclass_arguments
from pdfleet.engine.config.launch import python_module

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


def resolve_model(uri: str, revision: str | None, say) -> str:
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
    """Torch threads per engine (default: CPU cores / engines)."""
    timeout: float = 600.0
    """Seconds to wait for every process to become ready."""
    direct_engine_access: bool = False
    """Engines accept the client API keys too (for clients that call an engine
    directly); without it only the gateway does. A client key never may send
    internal fields (kv_transfer_params) to an engine."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "up",
        help="run an InferenceService on this machine (gateway + prefill + decode engines)",
        description="Start the gateway and the prefill and decode engines of an InferenceService "
        "as local processes, print the endpoint, and supervise them until Ctrl-C. With no file: "
        "SmolLM2-135M-Instruct (builtin://smollm2-135m-instruct), one prefill and one decode "
        "engine, Conditional mode.",
    )
    parser.add_argument("file", nargs="?", metavar="FILE.yaml", help="an InferenceService")
    add_dataclass_arguments(parser, UpOptions)
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
    from ..compat import check_service
    from ..resource import load_inference_service
    from .fleet import LocalFleet, fleet_credentials, free_port
    from .process_autoscaler import LocalAutoscaler
    from .state import FleetStateWriter

    def say(msg: str) -> None:
        print(msg, flush=True)

    # Health checks and scrapes every half second would drown the progress lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    service = load_inference_service(args.file if args.file else default_service())
    problems = [str(p) for p in check_service(service.spec)]
    problems += [
        f"spec.{role}.nodesPerReplica: pdfleet up runs every engine on this machine "
        "(its tensor-parallel ranks as local processes); set nodesPerReplica: 1"
        for role in ("prefill", "decode")
        if service.spec.role(role).nodes_per_replica > 1
    ]
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    fleet_secret, api_keys = fleet_credentials()
    model_path = resolve_model(service.spec.model.uri, service.spec.model.revision, say)
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
    )
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    say(f"pdfleet up: {service.name} ({service.spec.model.name}) — logs in {run_dir}")
    try:
        fleet.start(timeout=args.timeout)
        url = f"http://{args.host}:{port}"
        say(f"\nready: {url}/v1  (model {service.spec.model.name!r})")
        say(
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{service.spec.model.name}", "prompt": "Hello", '
            f'"max_tokens": 16}}\''
        )
        say(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{service.spec.model.name}", "messages": [{{"role": "user", '
            f'"content": "What is the capital of France?"}}]}}\''
        )
        say("Ctrl-C stops every process.\n")
        scaling = service.spec.autoscaling
        autoscaler = LocalAutoscaler(fleet, scaling) if scaling is not None else None
        state = FleetStateWriter(fleet)  # fleet.json, for `pdfleet status`
        next_scale = time.monotonic()
        while not stop.wait(0.5):
            fleet.tick()
            if autoscaler is not None and (
                time.monotonic() >= next_scale or autoscaler.activation_pending()
            ):
                next_scale = time.monotonic() + autoscaler.spec.period_seconds
                autoscaler.step()
            state.write(autoscaler)
    except (RuntimeError, TimeoutError) as e:
        say(f"pdfleet up: {e}")
        fleet.stop()
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    say("stopping ...")
    fleet.stop()
    say("stopped")
    return 0
