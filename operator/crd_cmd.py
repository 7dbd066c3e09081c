"""``pdfleet crd``: print the InferenceService CustomResourceDefinition."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "crd",
        help="print the InferenceService CRD (YAML)",
        description="Print the InferenceService CustomResourceDefinition generated from the "
        "resource model and the engine's configuration fields. `pdfleet crd | kubectl apply "
        "-f -` installs it; crds/ and the Helm chart hold the same file.",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    print(crd_yaml(), end="")
    return 0
