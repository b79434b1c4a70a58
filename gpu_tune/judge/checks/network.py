"""The node's InfiniBand / RoCE ports: the GPUs' path to each other across nodes.

- ``network.infiniband`` (fatal): every expected port is ``ACTIVE`` and ``LinkUp``, at its rate,
  and readable. Expected: the ports the profile names (``readiness.expect.ib_ports``, a list such
  as ``[mlx5_0/1, mlx5_1]``, or a number: at least that many up), else every physical function's
  port whose link layer is InfiniBand (a RoCE port, or an SR-IOV virtual function's, is judged
  when named). Passes again by itself when the port is back up.

  Rate, the first of these that applies (the detail says which):

  1. ``readiness.expect.ib_rate_gbps`` of the profile: every expected port at least that fast;
  2. the GPU model's ``expect: {ib_rate_gbps, ib_ports_at_rate}`` in ``policies/baselines.yaml``
     (HGX H100/H200: 8 compute ports at 400 Gb/s, GPUd's defaults): at least that many of the
     expected ports (or all of them, when the node has fewer) at that rate. A port that trained
     down to 200 Gb/s among eight at 400 fails the node; storage ports beyond the compute eight may
     run slower;
  3. the node's own ports: a port slower than the rate a strict majority of the expected ports of
     its link layer run at (one of eight at 200 while seven run at 400) fails the node. A node
     whose ports run at two rates by design names its compute ports or their rate in the profile.

  A trained-down compute port halves what every collective through it can move; GPUd fails such a
  node, and so does this check: fatal.
- ``network.link_flaps`` (warning): a port went down and up again within the last hour (its
  ``counters/link_downed`` grew, or its state changed between passes), or that counter cannot be read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, listed

REMEDY = "check the cable, the transceiver and the switch port (ibstat, mlxlink); drain the node while it is down"


def named_ports(profile: Any) -> tuple[str, ...]:
    """The ports a profile names in ``readiness.expect.ib_ports`` (read first, whatever the bounds)."""
    want = getattr(getattr(getattr(profile, "readiness", None), "expect", None), "ib_ports", None)
    return tuple(want) if isinstance(want, (list, tuple)) else ()


def _expected(ports, want) -> tuple[list, list[str]]:
    """(the ports judged, named ports that do not exist)."""
    if isinstance(want, tuple):
        names = set(want)
        picked = [p for p in ports if p.name in names or p.device in names]
        found = {p.name for p in picked} | {p.device for p in picked}
        return picked, [n for n in want if n not in found]
    # a port whose link layer is missing or unreadable is judged as InfiniBand (its problem then
    # fails it): only a port the kernel says is Ethernet (or Unknown) is left to the profile to name
    return [p for p in ports if (p.link_layer or "InfiniBand").lower() == "infiniband"
            and not getattr(p, "virtual", False)], []


def _gbps(x: float) -> str:
    return f"{x:g} Gb/s"


def rate_problems(judged: list, expect: Any) -> tuple[list[str], str]:
    """(the ports below their rate, in words; where the rate came from, for the passing detail)."""
    up = [p for p in judged if p.up and p.rate_gbps is not None]
    if expect.ib_rate_gbps is not None:
        rate = expect.ib_rate_gbps
        why = f"readiness.expect.ib_rate_gbps {_gbps(rate)}"
        return [f"{p.name} runs at {_gbps(p.rate_gbps)} of {rate:g} ({why})" for p in up if p.rate_gbps < rate], why
    if expect.ib_default_rate_gbps is not None:
        rate, at_least = expect.ib_default_rate_gbps, expect.ib_default_ports or 0
        why = (f"{expect.ib_default_source or 'the GPU model'}: at least {at_least} port(s) at {_gbps(rate)}"
               if at_least else f"{expect.ib_default_source or 'the GPU model'}: {_gbps(rate)}")
        need = min(at_least, len(judged)) if at_least else len(judged)
        fast = [p for p in up if p.rate_gbps >= rate]
        if len(fast) >= need:
            return [], why
        slow = [f"{p.name} runs at {_gbps(p.rate_gbps)} of {rate:g}" for p in up if p.rate_gbps < rate]
        return [f"{len(fast)} of {need} expected port(s) at {_gbps(rate)} or more ({why})"] + slow, why
    out, whys = [], []
    for layer in sorted({p.link_layer or "?" for p in up}):
        mine = [p for p in up if (p.link_layer or "?") == layer]
        if len(mine) < 2:
            continue
        rate, n = Counter(p.rate_gbps for p in mine).most_common(1)[0]
        if 2 * n <= len(mine):
            continue  # no rate most of them share: nothing to compare with
        whys.append(f"the node's {layer} ports: {n} of {len(mine)} at {_gbps(rate)}")
        out += [f"{p.name} runs at {_gbps(p.rate_gbps)} while {n} of the node's {len(mine)} {layer} ports run at "
                f"{rate:g} (trained down?)" for p in mine if p.rate_gbps < rate]
    return out, "; ".join(whys) or "rate not judged (no rate set, and no rate most ports share)"


class Network(Family):
    name = "network"
    category = "network"
    source = "sysfs"
    reads = "/sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer,counters/link_downed}"
    thresholds = ("state ACTIVE, phys_state LinkUp; rate >= readiness.expect.ib_rate_gbps, else the GPU model's "
                  "(policies/baselines.yaml), else the rate most of the node's ports of that link layer run at; "
                  "flaps (warning): any within an hour")
    remedy = REMEDY
    checks = ("network.infiniband", "network.link_flaps")

    def evaluate(self, facts: Facts) -> list[Check]:
        host = facts.host
        ports = list(getattr(host, "ib_ports", ()) or ())
        want = facts.expect.ib_ports
        unread = int(getattr(host, "ib_unread_physical", 0) or 0)
        if not ports and not want and not unread:
            return []
        out = []
        judged, absent = _expected(ports, want)
        unread_named = tuple(getattr(host, "ib_unread_named", ()) or ())
        problems = [f"{n}: no such port" for n in absent if n not in unread_named]
        for p in judged:
            problems += list(getattr(p, "unreadable", ()) or ())
            if not p.up:
                problems.append(f"{p.name} is {p.state or '?'} / {p.phys_state or '?'}")
        slow, rate_source = rate_problems(judged, facts.expect)
        problems += slow
        short = False
        if isinstance(want, int) and not isinstance(want, bool):
            up = sum(1 for p in ports if p.up)
            if up < want:
                problems.insert(0, f"{up} of {want} expected ports up")
                short = True
            judged = ports
        not_read = list(getattr(host, "ib_not_read", ()) or ())
        # a port left unread that may be an expected one is never passed: every InfiniBand port of a
        # physical function (no list in the profile), a port or device the profile names, or any
        # port while fewer than the expected number are up. Ports past the bound beside every
        # named one read are said in the passing detail.
        if unread and (want is None or unread_named or short):
            named = f"{', '.join(unread_named[:8])} among them; " if unread_named else ""
            problems.append(f"not judged: {named}{'; '.join(t for t in not_read if 'virtual function' not in t)}"
                            + ("" if want is not None else " (name the node's ports in readiness.expect.ib_ports "
                               "to judge those alone)"))
        if problems:
            out.append(self.check("network.infiniband", False, listed(problems) + ": " + REMEDY, listed(problems, 3)))
        elif judged:
            speeds = sorted({f"{p.rate_gbps:g}" for p in judged if p.rate_gbps is not None})
            extra = "".join(f"; {t}" for t in not_read)
            out.append(self.check("network.infiniband", True, f"{len(judged)} port(s) ACTIVE/LinkUp"
                                  + (f" at {'/'.join(speeds)} Gb/s" if speeds else "") + f" (rate: {rate_source})"
                                  + extra))
        flaps = {name: n for name, n in (getattr(facts.history, "ib_flaps", {}) or {}).items() if n}
        texts = [f"{name}: {n} flap(s) within the last hour" for name, n in sorted(flaps.items())]
        texts += [p.downed_problem for p in ports if getattr(p, "downed_problem", None)]
        if texts:
            out.append(self.check("network.link_flaps", False, listed(texts) + ": check the cable and the switch "
                                  "port", listed(texts, 3), severity=WARNING))
        return out
