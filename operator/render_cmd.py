"""``pdfleet render FILE.yaml``: print the manifests the operator would apply."""

from __future__ import annotations

import argparse

from .manifests import add_gateway_role_args


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "render",
        help="print the Kubernetes objects an InferenceService becomes",
        description="Check an InferenceService file and print, as YAML, exactly the objects "
        "the operator creates for it (like `helm template`; owner references are added by "
        "the operator). Exits 2 listing every invalid field.",
    )
    parser.add_argument("file", metavar="FILE.yaml", help="InferenceService manifest.")
    parser.add_argument(
        "--namespace",
        default=None,
        help="Namespace of the objects (default: the file's metadata.namespace, else default).",
    )
    parser.add_argument(
        "--image",
        default=None,
        help="Engine/gateway image when spec.image is unset (default: the operator's default).",
    )
    parser.add_argument(
        "--operator-namespace",
        default="pdfleet",
        metavar="NS",
        help="Namespace of the operator, whose scrapes the engine NetworkPolicies admit "
        "(default: pdfleet).",
    )
    add_gateway_role_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import yaml

    from .compat import check_service
    from .manifests import OperatorInstall, build_children
    from .parallelism import local_model_heads
    from .resource import load_inference_service

    block_dumper = _block_dumper()
    svc = load_inference_service(args.file)
    # A file:// model present here gives its head counts: tensorParallelSize is
    # checked against them before anything is applied.
    violations = check_service(svc.spec, heads=local_model_heads(svc.spec), name=svc.name)
    if violations:
        raise ValueError(f"{args.file}:\n" + "\n".join(str(v) for v in violations))
    namespace = args.namespace or svc.metadata.namespace or "default"
    install = OperatorInstall(
        namespace=args.operator_namespace,
        gateway_role=args.gateway_role,
        gateway_role_kind=args.gateway_role_kind,
    )
    objects = build_children(
        svc.name, svc.spec, namespace=namespace, image=args.image, install=install
    )
    print(yaml.dump_all(objects, Dumper=block_dumper, sort_keys=False, width=100), end="")
    return 0


def _block_dumper() -> type:
    import yaml

    class BlockDumper(yaml.SafeDumper):
        """Multi-line strings (the ConfigMap's JSON) as readable literal blocks."""

    def represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    BlockDumper.add_representer(str, represent_str)
    return BlockDumper
