"""Put the full MNIST set (Keras' mnist.npz) in data/ so that the image build bakes it in.

    python tools/fetch_mnist.py                  # download it (needs the internet, once)
    python tools/fetch_mnist.py --from FILE      # copy one you have (~/.keras/datasets/mnist.npz)

Either way the file is checked against Keras' published SHA-256 first (the build checks it
again). Without data/mnist.npz the image carries the 5,000-image subset instead (data/README.md).
Standard library only: runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
DEST = Path(__file__).resolve().parent.parent / "data" / "mnist.npz"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", default=None, help="an mnist.npz already here")
    ap.add_argument("--dest", default=str(DEST))
    a = ap.parse_args(argv)
    dest = Path(a.dest)
    fd, tmp = tempfile.mkstemp(prefix=".mnist-", suffix=".npz", dir=dest.parent)
    os.close(fd)
    try:
        if a.src:
            try:
                shutil.copyfile(a.src, tmp)
            except OSError as exc:
                print(f"fetch_mnist: --from {a.src}: {exc.strerror or exc}", file=sys.stderr)
                return 2
        else:
            try:
                with urllib.request.urlopen(URL, timeout=60) as r, open(tmp, "wb") as out:
                    shutil.copyfileobj(r, out)
            except OSError as exc:
                print(f"fetch_mnist: {URL}: {exc} (no internet here? copy the file in with --from)",
                      file=sys.stderr)
                return 1
        got = sha256(Path(tmp))
        if got != SHA256:
            print(f"fetch_mnist: {a.src or URL}: SHA-256 {got}, expected {SHA256}: not Keras' mnist.npz",
                  file=sys.stderr)
            return 2
        os.replace(tmp, dest)
        print(f"{dest}: {dest.stat().st_size} bytes, SHA-256 verified")
        return 0
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


if __name__ == "__main__":
    sys.exit(main())
