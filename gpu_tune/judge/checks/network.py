"""The node's InfiniBand / RoCE ports: the GPUs' path to each other across nodes.

- ``network.infiniband`` (fatal): every expected port is ``ACTIVE`` and ``LinkUp`` at the expected
  rate. Expected: the ports the profile names (``readiness.expect.ib_ports``, a list such as
  ``[mlx5_0/1, mlx5_1]``, or a number: at least that many up), else every port whose link layer
  is InfiniBand (a RoCE port is judged when named). Rate: ``readiness.expect.ib_rate_gbps``
  (e.g. 400 for NDR), else not judged. Passes again by itself when the port is back up.
- ``network.link_flaps`` (warning): a port went down and up again within the last hour (its
  ``counters/link_downed`` grew, or its state changed between passes).
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, listed


def _expected(ports, want) -> tuple[list, list[str]]:
    """(the ports judged, named ports that do not exist)."""
    if isinstance(want, tuple):
        names = set(want)
        picked = [p for p in ports if p.name in names or p.device in names]
        found = {p.name for p in picked} | {p.device for p in picked}
        return picked, [n for n in want if n not in found]
    return [p for p in ports if (p.link_layer or "").lower() == "infiniband"], []


class Network(Family):
    name = "network"
    category = "network"
    source = "sysfs"
    reads = "/sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer,counters/link_downed}"
    thresholds = ("state ACTIVE, phys_state LinkUp, rate >= readiness.expect.ib_rate_gbps; "
                  "flaps (warning): any within an hour")
    remedy = "check the cable, the transceiver and the switch port (ibstat, mlxlink); drain the node while it is down"
    checks = ("network.infiniband", "network.link_flaps")

    def evaluate(self, facts: Facts) -> list[Check]:
        host = facts.host
        ports = list(getattr(host, "ib_ports", ()) or ())
        want = facts.expect.ib_ports
        if not ports and not want:
            return []
        out = []
        judged, absent = _expected(ports, want)
        problems = [f"{n}: no such port" for n in absent]
        rate = facts.expect.ib_rate_gbps
        for p in judged:
            if not p.up:
                problems.append(f"{p.name} is {p.state or '?'} / {p.phys_state or '?'}")
            elif rate is not None and p.rate_gbps is not None and p.rate_gbps < rate:
                problems.append(f"{p.name} runs at {p.rate_gbps:g} Gb/s of {rate:g}")
        if isinstance(want, int) and not isinstance(want, bool):
            up = sum(1 for p in ports if p.up)
            if up < want:
                problems.insert(0, f"{up} of {want} expected ports up")
            judged = ports
        if problems:
            out.append(self.check("network.infiniband", False, listed(problems) + ": check the cable, the transceiver "
                                  "and the switch port (ibstat, mlxlink); drain the node while it is down",
                                  listed(problems, 3)))
        elif judged:
            speeds = sorted({f"{p.rate_gbps:g}" for p in judged if p.rate_gbps is not None})
            out.append(self.check("network.infiniband", True, f"{len(judged)} port(s) ACTIVE/LinkUp"
                                  + (f" at {'/'.join(speeds)} Gb/s" if speeds else "")))
        flaps = {name: n for name, n in (getattr(facts.history, "ib_flaps", {}) or {}).items() if n}
        if flaps:
            texts = [f"{name}: {n} flap(s)" for name, n in sorted(flaps.items())]
            out.append(self.check("network.link_flaps", False, listed(texts) + " within the last hour: check the "
                                  "cable and the switch port", listed(texts, 3), severity=WARNING))
        return out
