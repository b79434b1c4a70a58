"""The Prometheus text exposition (format 0.0.4) of gauge families, as ``prometheus_client``'s
``generate_latest`` writes it, byte for byte (tests/test_metrics.py compares the two).

The agent's collector (:mod:`gpu_tune.serve.metrics`) makes gauges only, so this is all of the
format it needs: ``# HELP`` (backslash and newline escaped), ``# TYPE NAME gauge``, one line per
sample with its labels sorted by name (backslash, newline and double quote escaped in a value) and
the value as Go prints a float. ``prometheus_client`` itself is not imported by the agent: its
package imports its HTTP servers and push gateway client (``http.server``, ``urllib.request``,
``wsgiref``): about 1.3 MiB resident for the agent's life (benchmarks/bench_rss.py).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence


class Sample(NamedTuple):
    """One series of a family (the fields of ``prometheus_client.samples.Sample`` it needs)."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None
    exemplar: Any = None
    native_histogram: Any = None


class Gauge:
    """A gauge family: ``prometheus_client.core.GaugeMetricFamily``'s shape and ``add_metric``."""

    type = "gauge"
    unit = ""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self._labelnames = tuple(labels)
        self.samples: list[Sample] = []

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | None = None) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels)), value, timestamp))


def go_float(value: float) -> str:
    """A float as Go's ``strconv.FormatFloat(f, 'g', -1, 64)`` (``prometheus_client``'s
    ``floatToGoString``): ``+Inf``, ``-Inf``, ``NaN``, an exponent from 1e7 up."""
    d = float(value)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to an exponent sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _sample_line(s: Sample) -> str:
    labels = ",".join('{}="{}"'.format(k, v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"'))
                      for k, v in sorted(s.labels.items()))
    stamp = f" {int(float(s.timestamp) * 1000):d}" if s.timestamp is not None else ""
    return f"{s.name}{{{labels}}} {go_float(s.value)}{stamp}\n" if labels else f"{s.name} {go_float(s.value)}{stamp}\n"


def render(families: Iterable[Gauge]) -> bytes:
    """The text exposition of ``families``, in their order."""
    out: list[str] = []
    for fam in families:
        out.append("# HELP {} {}\n".format(fam.name, fam.documentation.replace("\\", r"\\").replace("\n", r"\n")))
        out.append(f"# TYPE {fam.name} {fam.type}\n")
        out.extend(_sample_line(s) for s in fam.samples)
    return "".join(out).encode("utf-8")
