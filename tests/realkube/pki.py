"""Certificates for a test cluster, made with the ``openssl`` command (P-256 keys: fast).

One CA signs everything: the API server's serving certificate, the client certificates of the
admin (``O=system:masters``), the controller-manager, the scheduler, the kubelet
(``CN=system:node:NAME, O=system:nodes``) and the API server's own kubelet client; plus a key
pair for ServiceAccount tokens. Valid for two days: a test cluster lives minutes.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.realkube.binaries import tool

DAYS = "2"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _conf(path: Path, cn: str, org: str | None, ext: list[str]) -> Path:
    lines = ["[req]", "distinguished_name = dn", "prompt = no", "x509_extensions = ext", "[dn]"]
    if org:
        lines.append(f"O = {org}")
    lines += [f"CN = {cn}", "[ext]", *ext, ""]
    path.write_text("\n".join(lines))
    return path


def _run(args: list[str]) -> None:
    proc = subprocess.run([tool("openssl", "openssl"), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])}: {proc.stderr.strip()[-500:]}")


class PKI:
    """``PKI(folder)`` makes the CA at once; :meth:`issue` the rest, by name."""

    def __init__(self, folder: Path) -> None:
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = Pair(self.dir / "ca.crt", self.dir / "ca.key")
        if not self.ca.cert.exists():
            conf = _conf(self.dir / "ca.cnf", "gpu-tune-test-ca", None,
                         ["basicConstraints = critical, CA:TRUE", "keyUsage = critical, keyCertSign, cRLSign, "
                          "digitalSignature", "subjectKeyIdentifier = hash"])
            _run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", str(self.ca.key), "-out", str(self.ca.cert), "-days", DAYS, "-config", str(conf)])
        self.sa_key = self.dir / "sa.key"
        if not self.sa_key.exists():
            _run(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                  "-out", str(self.sa_key)])
        self.sa_pub = self.dir / "sa.pub"
        if not self.sa_pub.exists():
            _run(["pkey", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub)])

    def issue(self, name: str, cn: str, *, org: str | None = None, hosts: tuple[str, ...] = (),
              server: bool = False) -> Pair:
        """A certificate (and key) signed by the CA: a client one, or with ``server`` a serving
        one for ``hosts`` (IP addresses and DNS names)."""
        pair = Pair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        if pair.cert.exists():
            return pair
        ext = ["basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature, keyEncipherment",
               "extendedKeyUsage = " + ("serverAuth, clientAuth" if server else "clientAuth")]
        if hosts:
            sans = [("IP:" if h.replace(".", "").isdigit() else "DNS:") + h for h in hosts]
            ext.append("subjectAltName = " + ", ".join(sans))
        conf = _conf(self.dir / f"{name}.cnf", cn, org, ext)
        _run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", str(pair.key), "-out", str(pair.cert), "-days", DAYS, "-config", str(conf),
              "-CA", str(self.ca.cert), "-CAkey", str(self.ca.key)])
        return pair
