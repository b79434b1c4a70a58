"""Statistics of ``gpu-tune gain``: tuned against untuned, per measure, with a 95 % interval. Pure.

The unit of the comparison is the **pair**: one untuned run and one tuned run next to each other
in the interleaved order A/B/B/A…, so that drift, warm-up and a neighbour's load fall on both.
For each measure and pair, ``r = log(tuned / untuned)``; the estimate is the geometric mean of the
pairs' ratios, ``exp(mean r)``, and its 95 % interval is Student's t interval of ``mean r``
(``t(0.975, n-1) · sd / √n``), turned back into ratios.

Why a t interval on log ratios, not a bootstrap or a rank interval: the default is 3 pairs.

- A percentile bootstrap over 3 pairs has 10 distinct resamples; its "95 %" interval is about
  the range of the 3 ratios, which holds the true ratio only ~75 % of the time. It claims more
  than it knows exactly where the samples are few.
- A distribution-free interval (sign test or Wilcoxon signed-rank) cannot reach 95 % below 6
  pairs: with 3 it would always be "inconclusive".
- The t interval is exact when the log ratios are normal and widens honestly with few pairs
  (t = 4.30 for 3 pairs, 2.78 for 5). Throughput ratios of repeated runs are close to log-normal;
  a heavy tail (one disturbed run) shows up as a wide interval, and so as "inconclusive" or
  "no significant difference", never as a false gain.

Verdicts (``higher_is_better`` says which way a measure improves):

- ``inconclusive``: fewer than :data:`MIN_PAIRS` pairs (no ratio is given at all), or the interval
  holds 1 but is wider than ``±tolerance`` (too noisy to tell a difference of that size);
- ``gain`` / ``loss``: the interval lies wholly on the better / worse side of 1;
- ``no significant difference``: the interval holds 1 and lies within ``1 ± tolerance``.

A ratio is never given without its interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

MIN_PAIRS = 3
TOLERANCE = 0.10  # "no significant difference" means: any difference is within ±10 %
CONFIDENCE = 0.95

GAIN, LOSS, SAME, INCONCLUSIVE = "gain", "loss", "no significant difference", "inconclusive"
VERDICTS = (GAIN, LOSS, SAME, INCONCLUSIVE)

# Student's t, 0.975 quantile, for 1..30 degrees of freedom.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (a table to 30, then the
    Cornish-Fisher expansion, within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def median(xs: Sequence[float]) -> float | None:
    v = sorted(float(x) for x in xs)
    if not v:
        return None
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


@dataclass(frozen=True)
class MeasureResult:
    measure: str
    higher_is_better: bool
    pairs: int
    median_untuned: float | None
    median_tuned: float | None
    ratio: float | None  # tuned / untuned (geometric mean of the pairs' ratios); None: too few pairs
    lower: float | None
    upper: float | None
    verdict: str
    reason: str

    def change_text(self) -> str:
        """``+5.1% [+2.0%, +8.3%]`` (the ratio as a change, with its interval), or why there is none."""
        if self.ratio is None or self.lower is None or self.upper is None:
            return f"{self.verdict} ({self.reason})"
        return f"{pct(self.ratio)} [{pct(self.lower)}, {pct(self.upper)}]"

    def as_dict(self) -> dict[str, Any]:
        r = (lambda x: None if x is None else round(x, 4))
        return {"measure": self.measure, "higher_is_better": self.higher_is_better, "pairs": self.pairs,
                "median_untuned": _sig(self.median_untuned), "median_tuned": _sig(self.median_tuned),
                "ratio": r(self.ratio), "ci95": None if self.lower is None else [r(self.lower), r(self.upper)],
                "verdict": self.verdict, "reason": self.reason, "change": self.change_text()}


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.5g}")


def pct(ratio: float) -> str:
    """1.051 -> ``+5.1%``; 0.96 -> ``-4.0%``."""
    return f"{(ratio - 1) * 100:+.1f}%"


def compare(measure: str, untuned: Sequence[float], tuned: Sequence[float], *, higher_is_better: bool = True,
            tolerance: float = TOLERANCE, min_pairs: int = MIN_PAIRS) -> MeasureResult:
    """One measure over paired samples (``untuned[i]`` ran next to ``tuned[i]``)."""
    if len(untuned) != len(tuned):
        raise ValueError("untuned and tuned must have one value per pair")
    pairs = [(float(a), float(b)) for a, b in zip(untuned, tuned)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    n = len(pairs)
    mu, mt = median([a for a, _ in pairs]), median([b for _, b in pairs])
    if n < min_pairs:
        return MeasureResult(measure, higher_is_better, n, mu, mt, None, None, None, INCONCLUSIVE,
                             f"too few pairs: {n} (at least {min_pairs} needed for an interval)")
    logs = [math.log(b / a) for a, b in pairs]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    ratio, lo, hi = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    better_side = lo > 1 if higher_is_better else hi < 1
    worse_side = hi < 1 if higher_is_better else lo > 1
    if better_side:
        verdict, reason = GAIN, "the whole 95% interval is on the better side of no change"
    elif worse_side:
        verdict, reason = LOSS, "the whole 95% interval is on the worse side of no change: the profile hurts here"
    elif lo >= 1 - tolerance and hi <= 1 + tolerance:
        verdict, reason = SAME, f"the 95% interval holds no change and lies within ±{tolerance:.0%}"
    else:
        verdict, reason = INCONCLUSIVE, (f"too noisy: the 95% interval holds no change but is wider than "
                                         f"±{tolerance:.0%}; run more pairs")
    return MeasureResult(measure, higher_is_better, n, mu, mt, ratio, lo, hi, verdict, reason)
