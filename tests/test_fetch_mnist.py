"""tools/fetch_mnist.py: only a file with Keras' SHA-256 reaches data/mnist.npz."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("fetch_mnist", ROOT / "tools" / "fetch_mnist.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_file_with_another_hash_is_refused_and_nothing_is_written(tmp_path, capsys):
    fm = _load()
    src = tmp_path / "not-mnist.npz"
    src.write_bytes(b"PK\x03\x04 not mnist")
    dest = tmp_path / "data" / "mnist.npz"
    dest.parent.mkdir()
    assert fm.main(["--from", str(src), "--dest", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected " + fm.SHA256 in err
    assert list(dest.parent.iterdir()) == []
    assert fm.main(["--from", str(tmp_path / "absent"), "--dest", str(dest)]) == 2
    assert list(dest.parent.iterdir()) == []


def test_the_published_file_is_copied(tmp_path, monkeypatch):
    fm = _load()
    src = tmp_path / "mnist.npz"
    src.write_bytes(b"stand-in bytes")
    monkeypatch.setattr(fm, "SHA256", hashlib.sha256(b"stand-in bytes").hexdigest())
    dest = tmp_path / "out.npz"
    assert fm.main(["--from", str(src), "--dest", str(dest)]) == 0
    assert dest.read_bytes() == b"stand-in bytes"
