"""Statistics of ``gpu-tune gain``: one arm against the untuned control, per measure. Pure.

The unit of the comparison is the **pair**: one control (untuned) run and one run of the arm next
to it, in an order drawn at random for each pair, so that drift, warm-up and a neighbour's load fall on
either side by chance, never on one by design. For each measure and pair, ``r = log(arm / control)``; the estimate is the geometric mean of
the pairs' ratios, ``exp(mean r)``.

Two things must agree before a difference is called one:

1. **Student's t interval** of ``mean r`` at the stated confidence (95 % for one arm; for several
   arms measured against one control, ``1 − 0.05/k``, Bonferroni, so that the k intervals hold
   together at 95 %), turned back into ratios. It is what the table shows: exact for normal log
   ratios, honest about few pairs (t = 4.30 at 3 pairs), and it widens with a disturbed run.
2. **A sign-flip (randomization) test** of the same pairs: under "no difference" the two
   runs of a pair are exchangeable, so each of the 2ⁿ sign patterns of the ``r`` values is as
   likely as the one observed; the one-sided p-value is the share of patterns whose mean is at
   least as far out. Up to :data:`EXACT_UP_TO` (16) pairs every pattern is counted: an exact
   test. Beyond (``--pairs`` goes up to 50) :data:`MONTE_CARLO` (20,000) patterns drawn at random
   (seeded) are counted, the observed one added once: a valid p-value, not an exact one, and the
   reason says which of the two ran (:attr:`MeasureResult.test`). It needs no distributional
   assumption, which a busy node's bursty, skewed run times break: an A/A run (both sides
   identical, ``gpu-tune gain --null``) cannot be called a gain or a loss more often than the
   stated error rate, whatever the noise. Its cost: with n pairs no p-value is below 2⁻ⁿ, so a
   verdict needs ``n ≥ log2(2/α)`` pairs (6 at 95 %, 8 for k = 6 arms): :func:`pairs_needed`.

Verdicts (``higher_is_better`` says which way a measure improves):

- ``gain`` / ``loss``: the interval lies wholly on the better / worse side of 1, and the sign-flip
  test agrees at the same level;
- ``no significant difference``: the interval holds 1 and lies within ``1 ± tolerance``, or a
  confirmed difference is smaller than :data:`MIN_EFFECT` (±2 %: real, but nothing to alert on or
  to drop a setting for);
- ``inconclusive``: fewer than :data:`MIN_PAIRS` pairs (no ratio at all), an interval that holds 1
  but is wider than ``±tolerance`` (too noisy here), or an interval off 1 that the sign-flip test
  does not confirm (too few pairs agree to rule out chance).

A ratio is never given without its interval.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

MIN_PAIRS = 3
TOLERANCE = 0.10  # "no significant difference" means: any difference is within ±10 %
MIN_EFFECT = 0.02  # a confirmed difference smaller than ±2 % is reported as no difference that counts
CONFIDENCE = 0.95
EXACT_UP_TO = 16  # pairs enumerated exactly (2**16 sign patterns); beyond, a seeded Monte Carlo
MONTE_CARLO = 20_000

GAIN, LOSS, SAME, INCONCLUSIVE = "gain", "loss", "no significant difference", "inconclusive"
VERDICTS = (GAIN, LOSS, SAME, INCONCLUSIVE)


# -- Student's t ----------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`, to 1e-10)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    if not 0.0 < p < 1.0:
        raise ValueError("p must be within (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2.0


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t (a 95 % two-sided interval)."""
    return t_quantile(0.975, df)


# -- the sign-flip test ----------------------------------------------------------------------------
EXACT_TEST = "exact sign-flip"
SAMPLED_TEST = f"sign-flip, {MONTE_CARLO:,} random sign patterns"


def sign_flip_test(n: int) -> str:
    """Which sign-flip test :func:`sign_flip_p` runs for ``n`` values, in words."""
    return EXACT_TEST if n <= EXACT_UP_TO else SAMPLED_TEST


def _test_words(n: int) -> str:
    """The test as the reason names it: ``exact sign-flip test`` or ``sign-flip test on 20,000
    random sign patterns``."""
    return "exact sign-flip test" if n <= EXACT_UP_TO else f"sign-flip test on {MONTE_CARLO:,} random sign patterns"


def sign_flip_p(values: Sequence[float], *, seed: int = 0) -> tuple[float, float]:
    """One-sided p-values of the sign-flip test of ``mean(values) == 0``: (p that the mean is this
    low or lower, p that it is this high or higher), the observed pattern counted. Exact up to
    :data:`EXACT_UP_TO` values, a seeded Monte Carlo of :data:`MONTE_CARLO` patterns beyond."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return 1.0, 1.0
    observed = sum(xs)
    eps = 1e-12 * (sum(abs(x) for x in xs) or 1.0)
    low = high = total = 0
    if n <= EXACT_UP_TO:
        patterns: Any = itertools.product((1.0, -1.0), repeat=n)
    else:
        rng = random.Random(seed)
        patterns = ([rng.choice((1.0, -1.0)) for _ in range(n)] for _ in range(MONTE_CARLO))
    for signs in patterns:
        s = sum(sg * x for sg, x in zip(signs, xs))
        total += 1
        low += s <= observed + eps
        high += s >= observed - eps
    if n > EXACT_UP_TO:  # the observed pattern itself, counted once (a valid Monte Carlo p-value)
        return (low + 1) / (total + 1), (high + 1) / (total + 1)
    return low / total, high / total


def pairs_needed(confidence: float = CONFIDENCE) -> int:
    """The fewest pairs whose sign-flip test can reach a one-sided ``(1 − confidence)/2``."""
    alpha = (1.0 - confidence) / 2.0
    return max(MIN_PAIRS, math.ceil(math.log2(1.0 / alpha)))


def bonferroni(arms: int, confidence: float = CONFIDENCE) -> float:
    """The confidence of each of ``arms`` intervals so that they hold together at ``confidence``."""
    return 1.0 - (1.0 - confidence) / max(1, int(arms))


# -- one measure ------------------------------------------------------------------------------------
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
    ratio: float | None  # arm / control (geometric mean of the pairs' ratios); None: too few pairs
    lower: float | None
    upper: float | None
    verdict: str
    reason: str
    confidence: float = CONFIDENCE
    p_worse: float | None = None  # the sign-flip test's one-sided p-value toward "worse"
    p_better: float | None = None
    # Which sign-flip test gave them: "exact sign-flip" (every pattern, up to 16 pairs) or
    # "sign-flip, 20,000 random sign patterns"; "" when none ran (too few pairs).
    test: str = ""

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
                "confidence": round(self.confidence, 5),
                "p_worse": None if self.p_worse is None else round(self.p_worse, 5),
                "p_better": None if self.p_better is None else round(self.p_better, 5),
                "test": self.test or None, "verdict": self.verdict, "reason": self.reason, "change": self.change_text()}


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.5g}")


def pct(ratio: float) -> str:
    """1.051 -> ``+5.1%``; 0.96 -> ``-4.0%``."""
    return f"{(ratio - 1) * 100:+.1f}%"


def compare(measure: str, untuned: Sequence[float], tuned: Sequence[float], *, higher_is_better: bool = True,
            tolerance: float = TOLERANCE, min_pairs: int = MIN_PAIRS,
            confidence: float = CONFIDENCE) -> MeasureResult:
    """One measure over paired samples (``untuned[i]`` ran next to ``tuned[i]``)."""
    if len(untuned) != len(tuned):
        raise ValueError("untuned and tuned must have one value per pair")
    if not 0.5 < confidence < 1.0:
        raise ValueError("confidence must be within (0.5, 1)")
    pairs = [(float(a), float(b)) for a, b in zip(untuned, tuned)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    n = len(pairs)
    mu, mt = median([a for a, _ in pairs]), median([b for _, b in pairs])
    if n < min_pairs:
        return MeasureResult(measure, higher_is_better, n, mu, mt, None, None, None, INCONCLUSIVE,
                             f"too few pairs: {n} (at least {min_pairs} needed for an interval)", confidence)
    logs = [math.log(b / a) for a, b in pairs]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    ratio, lo, hi = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    p_low, p_high = sign_flip_p(logs)
    test = _test_words(n)  # what ran, as the reason says it
    p_better, p_worse = (p_high, p_low) if higher_is_better else (p_low, p_high)
    alpha = (1.0 - confidence) / 2.0
    better_side = lo > 1 if higher_is_better else hi < 1
    worse_side = hi < 1 if higher_is_better else lo > 1
    level = f"{confidence:.4g}".rstrip("0").rstrip(".")
    what = f"the whole {float(level) * 100:g}% interval"
    if ((better_side and p_better <= alpha) or (worse_side and p_worse <= alpha)) and abs(ratio - 1) < MIN_EFFECT:
        verdict = SAME
        reason = (f"a confirmed but small difference ({pct(ratio)}), below the ±{MIN_EFFECT:.0%} that counts "
                  f"as a gain or a loss")
    elif (better_side and p_better <= alpha) or (worse_side and p_worse <= alpha):
        agree = sum(1 for x in logs if (x > 0) == (ratio > 1))
        if better_side:
            verdict = GAIN
            reason = f"{what} is on the better side of no change ({agree} of {n} pairs; {test} p={p_better:.3g})"
        else:
            verdict = LOSS
            reason = (f"{what} is on the worse side of no change ({agree} of {n} pairs; {test} p={p_worse:.3g}): "
                      "the profile hurts here")
    elif better_side or worse_side:
        need = pairs_needed(confidence)
        verdict = INCONCLUSIVE
        reason = (f"the interval excludes no change but the {test} does not confirm it "
                  f"(p={min(p_better, p_worse):.3g} > {alpha:.3g}"
                  + (f"; at least {need} pairs are needed for it" if n < need else "") + "): run more pairs")
    elif lo >= 1 - tolerance and hi <= 1 + tolerance:
        verdict, reason = SAME, f"the interval holds no change and lies within ±{tolerance:.0%}"
    else:
        verdict, reason = INCONCLUSIVE, (f"too noisy here: the interval holds no change but is wider than "
                                         f"±{tolerance:.0%}; run more pairs, or on a quieter node")
    return MeasureResult(measure, higher_is_better, n, mu, mt, ratio, lo, hi, verdict, reason, confidence,
                         p_worse, p_better, sign_flip_test(n))
