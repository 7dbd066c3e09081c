"""``pdfleet operator``: run the InferenceService operator (kopf)."""

from __future__ import annotations

import argparse

from .manifests import add_gateway_role_args


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "operator",
        help="run the Kubernetes operator for InferenceService resources",
        description="Watch InferenceService resources and run each as a prefill pool, a decode "
        "pool and a gateway. Run one replica (the Helm chart does); it logs in from the pod's "
        "service account or the local kubeconfig.",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="Watch only this namespace (repeatable). Default: every namespace.",
    )
    parser.add_argument(
        "--default-image",
        default=None,
        help="Engine/gateway image for InferenceServices that set no spec.image.",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=8080,
        help="Port of kopf's liveness endpoint /healthz (0: none). Default 8080.",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Port of the operator's Prometheus /metrics (0: none). Default 9090.",
    )
    parser.add_argument(
        "--refresh-seconds",
        type=float,
        default=15.0,
        help="Seconds between status refreshes and metric scrapes of each service. Default 15.",
    )
    parser.add_argument(
        "--operator-namespace",
        default=None,
        metavar="NS",
        help="Namespace the operator runs in: engine NetworkPolicies admit its /metrics "
        "scrapes from there. Default: $POD_NAMESPACE, else pdfleet.",
    )
    parser.add_argument(
        "--leader-worker-set",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Manage LeaderWorkerSets (leaderworkerset.x-k8s.io/v1) for roles with "
        "nodesPerReplica > 1; needs the LeaderWorkerSet controller and the RBAC the chart "
        "adds with leaderWorkerSet.enabled. Without it such specs get Ready=False. "
        "Default off.",
    )
    parser.add_argument(
        "--identity-port",
        type=int,
        default=8443,
        help="Port of the identity endpoint (HTTPS), where engine pods get their identity "
        'tokens (docs/security.md, "Identities"). Default 8443.',
    )
    parser.add_argument(
        "--identity-service",
        default="pdfleet-identity",
        metavar="NAME",
        help="The Service in the operator's namespace that fronts the identity endpoint on "
        "the same port: engines are told https://NAME.NAMESPACE.svc:PORT. The Helm chart "
        "creates it as RELEASE-identity. Default %(default)s.",
    )
    parser.add_argument(
        "--identity-ttl-seconds",
        type=float,
        default=3600.0,
        help="Lifetime of an engine's identity token; engines renew it at half that. Default 3600.",
    )
    add_gateway_role_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import kopf
    from prometheus_client import start_http_server

    from .handlers import OperatorConfig, configure_settings, register
    from .identity_endpoint import IdentityEndpointConfig
    from .manifests import DEFAULT_IMAGE, OperatorInstall

    if args.refresh_seconds <= 0:
        raise ValueError("--refresh-seconds must be positive")
    if not 60 <= args.identity_ttl_seconds <= 86400:
        raise ValueError("--identity-ttl-seconds must be between 60 and 86400")
    if not 1 <= args.identity_port <= 65535:
        raise ValueError("--identity-port must be a port number")
    registry = kopf.OperatorRegistry()
    config = OperatorConfig(
        default_image=args.default_image or DEFAULT_IMAGE,
        timer_interval_seconds=args.refresh_seconds,
        install=OperatorInstall(
            namespace=args.operator_namespace or os.environ.get("POD_NAMESPACE") or "pdfleet",
            gateway_role=args.gateway_role,
            gateway_role_kind=args.gateway_role_kind,
            leader_worker_set=args.leader_worker_set,
        ),
        identity=IdentityEndpointConfig(
            host="0.0.0.0",  # noqa: S104 (the identity endpoint serves every interface of its pod)
            port=args.identity_port,
            service=args.identity_service,
            ttl_seconds=args.identity_ttl_seconds,
        ),
    )
    state = register(registry, config)
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=state.metrics)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        kopf.operator(
            registry=registry,
            settings=settings,
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
        )
    )
    return 0
