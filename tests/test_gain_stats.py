"""The statistics of `gpu-tune gain` on synthetic paired samples with a known truth."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from gpu_tune.judge.gain.measure import TUNED, UNTUNED, schedule
from gpu_tune.judge.gain.stats import (
    EXACT_UP_TO,
    GAIN,
    INCONCLUSIVE,
    LOSS,
    SAME,
    bonferroni,
    compare,
    pairs_needed,
    pct,
    sign_flip_p,
    t975,
    t_quantile,
)


def paired(truth: float, n: int, noise: float, seed: int, base: float = 1000.0, drift: float = 0.0):
    """n pairs: the untuned run and the tuned one next to it share the drift of their moment;
    each run has its own log-normal noise of ``noise`` (sd of the log)."""
    rng = random.Random(seed)
    untuned, tuned = [], []
    for i in range(n):
        level = base * (1 + drift * i)
        untuned.append(level * math.exp(rng.gauss(0, noise)))
        tuned.append(level * truth * math.exp(rng.gauss(0, noise)))
    return untuned, tuned


def test_known_gain_is_a_gain_and_the_interval_covers_the_truth():
    u, t = paired(1.10, 6, 0.01, seed=1, drift=0.05)  # +10 %, 1 % noise, 5 % drift per pair
    r = compare("images_per_second", u, t)
    assert r.verdict == GAIN
    assert r.lower < 1.10 < r.upper
    assert r.lower > 1.0
    assert r.change_text().startswith("+")


def test_known_loss_is_a_loss():
    u, t = paired(0.85, 6, 0.02, seed=2)
    r = compare("images_per_second", u, t)
    assert r.verdict == LOSS
    assert r.lower < 0.85 < r.upper < 1.0
    assert "hurts" in r.reason


def test_lower_is_better_measures_turn_the_verdict_around():
    u, t = paired(0.80, 6, 0.02, seed=3)  # step time 20 % shorter when tuned
    assert compare("step_p50", u, t, higher_is_better=False).verdict == GAIN
    assert compare("images_per_second", u, t, higher_is_better=True).verdict == LOSS


def test_no_difference_is_said_so_with_an_interval_around_one():
    u, t = paired(1.0, 6, 0.01, seed=4)
    r = compare("images_per_second", u, t)
    assert r.verdict == SAME
    assert r.lower < 1.0 < r.upper
    assert 0.9 <= r.lower and r.upper <= 1.1


def test_noisy_samples_are_inconclusive_not_a_number():
    u, t = paired(1.0, 3, 0.25, seed=5)
    r = compare("images_per_second", u, t)
    assert r.verdict == INCONCLUSIVE
    assert "too noisy" in r.reason
    assert r.lower < 1.0 < r.upper  # the interval is still given, and holds the truth


def test_too_few_pairs_give_no_ratio_at_all():
    r = compare("images_per_second", [100.0, 101.0], [120.0, 121.0])
    assert r.verdict == INCONCLUSIVE
    assert r.ratio is None and r.lower is None and r.upper is None
    assert "too few pairs: 2" in r.change_text()
    assert r.as_dict()["ci95"] is None


def test_unusable_values_do_not_count_as_pairs():
    r = compare("x", [100.0, float("nan"), 0.0, 100.0], [110.0, 110.0, 110.0, 110.0])
    assert r.pairs == 2 and r.verdict == INCONCLUSIVE


@pytest.mark.parametrize("truth,n", [(1.0, 3), (1.05, 5), (0.9, 8)])
def test_interval_coverage_is_near_95_percent(truth, n):
    """Over many synthetic experiments the interval holds the truth about 95 % of the time (the
    bootstrap of 3 pairs would reach only ~75 %)."""
    hits = 0
    trials = 400
    for s in range(trials):
        u, t = paired(truth, n, 0.03, seed=1000 + s)
        r = compare("images_per_second", u, t)
        hits += r.lower <= truth <= r.upper
    assert 0.90 <= hits / trials <= 0.99


def test_t_quantiles():
    assert t975(2) == pytest.approx(4.3027, abs=1e-4)
    assert t975(31) == pytest.approx(2.0395, abs=1e-3)
    assert t975(120) == pytest.approx(1.9799, abs=1e-3)
    assert pct(1.051) == "+5.1%" and pct(0.96) == "-4.0%"


def test_t_quantiles_at_any_level():
    # the Bonferroni level for 6 arms, against published tables (two-sided 0.00833)
    assert t_quantile(1 - 0.05 / 12, 7) == pytest.approx(3.6358, abs=1e-3)
    assert t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-3)
    assert t_quantile(0.025, 9) == pytest.approx(-2.2622, abs=1e-3)
    assert bonferroni(1) == 0.95 and bonferroni(5) == pytest.approx(0.99)


def test_the_reason_says_which_sign_flip_test_ran():
    """Up to 16 pairs every sign pattern is counted: an exact test. Beyond, a sample of them:
    the reason says so, never "exact" (--pairs goes up to 50)."""
    u, t = paired(1.10, 12, 0.01, seed=11)
    r = compare("images_per_second", u, t)
    assert r.verdict == GAIN and "exact sign-flip test p=" in r.reason and r.test == "exact sign-flip"
    assert r.as_dict()["test"] == "exact sign-flip"
    for n, verdict in ((EXACT_UP_TO + 1, GAIN), (50, GAIN)):
        u, t = paired(1.10, n, 0.01, seed=12)
        r = compare("images_per_second", u, t)
        assert r.verdict == verdict and "exact" not in r.reason, r.reason
        assert "sign-flip test on 20,000 random sign patterns p=" in r.reason
        assert r.test == r.as_dict()["test"] == "sign-flip, 20,000 random sign patterns"
    u, t = paired(0.85, 20, 0.01, seed=13)
    r = compare("images_per_second", u, t)
    assert r.verdict == LOSS and "exact" not in r.reason and "20,000 random sign patterns" in r.reason
    u, t = paired(0.85, 5, 0.01, seed=7)  # not confirmed: says by which test
    assert "the exact sign-flip test does not confirm it" in compare("images_per_second", u, t).reason


def test_the_exact_test_counts_sign_patterns():
    assert sign_flip_p([1.0, 2.0, 3.0]) == (1.0, 0.125)  # all 8 patterns: only the observed one is this high
    assert sign_flip_p([-0.1] * 6) == (1 / 64, 1.0)
    assert sign_flip_p([]) == (1.0, 1.0)
    assert pairs_needed() == 6 and pairs_needed(bonferroni(6)) == 8
    lo, hi = sign_flip_p([0.01 * (i % 3 - 1) for i in range(24)])  # Monte Carlo beyond 16 pairs
    assert 0.3 < lo < 0.8 and 0.3 < hi < 0.8


def test_few_pairs_that_all_agree_are_not_enough_to_call_a_loss():
    """Five pairs all 15 % slower: the t interval lies below 1, but 1 in 32 sign patterns is as
    extreme, above the 2.5 % the verdict promises: inconclusive, with the pairs it needs."""
    u, t = paired(0.85, 5, 0.01, seed=7)
    r = compare("images_per_second", u, t)
    assert r.upper < 1.0 and r.verdict == INCONCLUSIVE
    assert "exact sign-flip test does not confirm" in r.reason and "at least 6 pairs" in r.reason
    assert compare("images_per_second", *paired(0.85, 6, 0.01, seed=7)).verdict == LOSS


# -- A/A: both sides the same, under the noise and load shapes of a busy node ------------------
def _noise(kind: str, rng: random.Random) -> float:
    """One run's log-noise."""
    if kind == "normal":
        return rng.gauss(0, 0.05)
    if kind == "heavy":  # a t(2)-like tail: now and then a run disturbed a lot
        return rng.gauss(0, 0.05) / max(0.05, abs(rng.gauss(0, 1)))
    if kind == "skewed":  # runs only ever get slower: a neighbour steals CPU time from some of them
        return -rng.expovariate(1 / 0.15) if rng.random() < 0.4 else rng.gauss(0, 0.02)
    raise ValueError(kind)


def aa_experiment(n: int, kind: str, load: str, seed: int) -> tuple[list[float], list[float]]:
    """n A/A pairs run in the order ``gpu-tune gain`` runs them (:func:`schedule`, each round's
    order drawn at random from a seed of its own per experiment); ``load`` shapes the level the
    runs of a moment share: ``steady``, ``drift`` (the node gets 5 % slower per pair), ``bursts``
    (a neighbour's job comes and goes: half-speed stretches of a few runs), ``hogs`` (every CPU
    busy: half speed, more noise) or ``periodic`` (every fourth run 15 % slower: a timer, a
    neighbour's job with the period of the old fixed A B, B A order, which fell on one arm every
    time)."""
    rng = random.Random(seed)
    level, burst = 1.0, 0
    a: list[float] = [0.0] * n
    b: list[float] = [0.0] * n
    for k, (pair, arm) in enumerate(schedule([UNTUNED, TUNED], n, rng.getrandbits(32))):
        if load == "drift" and k:
            level *= 0.975
        elif load == "bursts":
            if burst == 0 and rng.random() < 0.3:
                burst = rng.randint(1, 4)
            level = 0.5 if burst else 1.0
            burst = max(0, burst - 1)
        elif load == "periodic":
            level = 0.85 if k % 4 == 1 else 1.0
        scale = 0.5 if load == "hogs" else 1.0
        noise = _noise(kind, rng) * (2.0 if load == "hogs" else 1.0)
        (a if arm == UNTUNED else b)[pair] = 1000 * level * scale * math.exp(noise)
    return a, b


def test_the_aa_model_runs_the_order_gain_runs():
    """The experiments below take their run order from gpu-tune gain's own schedule: each pair
    once per round, in either order, both orders about equally often."""
    first = {UNTUNED: 0, TUNED: 0}
    for s in range(200):
        order = schedule([UNTUNED, TUNED], 6, s)
        assert sorted(order) == sorted((p, arm) for p in range(6) for arm in (UNTUNED, TUNED))
        for i in range(0, 12, 2):
            assert order[i][0] == order[i + 1][0]
            first[order[i][1]] += 1
    assert 500 < first[UNTUNED] < 700 and first[UNTUNED] + first[TUNED] == 1200


@pytest.mark.parametrize("kind", ["normal", "heavy", "skewed"])
@pytest.mark.parametrize("load", ["steady", "drift", "bursts", "hogs", "periodic"])
@pytest.mark.parametrize("n", [3, 6, 12])
def test_aa_false_loss_rate_stays_within_what_the_interval_promises(kind, load, n):
    """Both sides identical: over 400 experiments per shape, a LOSS (or a gain) is said at most at
    the rate a one-sided 95 % verdict promises (2.5 %; the bound allows the binomial noise of 400
    trials: 2.5 % + 2.5 standard errors = 4.5 %)."""
    trials = 400
    loss = gain = 0
    for s in range(trials):
        a, b = aa_experiment(n, kind, load, seed=zlib.crc32(f"{kind}/{load}/{n}/{s}".encode()))
        v = compare("images_per_second", a, b).verdict
        loss += v == LOSS
        gain += v == GAIN
    assert loss / trials <= 0.045, (loss, trials)
    assert gain / trials <= 0.045, (gain, trials)


def test_aa_with_six_arms_holds_together():
    """Six arms against one control, each judged at the Bonferroni level: a LOSS in any of them,
    when none differs, at most at 5 % of the experiments (+ binomial noise)."""
    trials, any_loss = 300, 0
    level = bonferroni(6)
    for s in range(trials):
        rng = random.Random(s)
        n = 8
        control = [1000 * math.exp(_noise("skewed", rng)) for _ in range(n)]
        arms = [[1000 * math.exp(_noise("skewed", rng)) for _ in range(n)] for _ in range(6)]
        any_loss += any(compare("x", control, arm, confidence=level).verdict == LOSS for arm in arms)
    assert any_loss / trials <= 0.08, any_loss


def test_a_confirmed_but_small_difference_is_no_difference_that_counts():
    u = [1000.0 + i for i in range(8)]
    t = [x * 0.992 for x in u]  # 0.8 % slower in every pair, no noise: certain, and too small to matter
    r = compare("images_per_second", u, t)
    assert r.upper < 1.0 and r.verdict == SAME and "small difference" in r.reason
    assert compare("images_per_second", u, [x * 0.97 for x in u]).verdict == LOSS
