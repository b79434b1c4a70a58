"""The statistics of `gpu-tune gain` on synthetic paired samples with a known truth."""

from __future__ import annotations

import math
import random

import pytest

from gpu_tune.judge.gain.stats import GAIN, INCONCLUSIVE, LOSS, SAME, compare, pct, t975


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
    u, t = paired(1.10, 5, 0.01, seed=1, drift=0.05)  # +10 %, 1 % noise, 5 % drift per pair
    r = compare("images_per_second", u, t)
    assert r.verdict == GAIN
    assert r.lower < 1.10 < r.upper
    assert r.lower > 1.0
    assert r.change_text().startswith("+")


def test_known_loss_is_a_loss():
    u, t = paired(0.85, 4, 0.02, seed=2)
    r = compare("images_per_second", u, t)
    assert r.verdict == LOSS
    assert r.lower < 0.85 < r.upper < 1.0
    assert "hurts" in r.reason


def test_lower_is_better_measures_turn_the_verdict_around():
    u, t = paired(0.80, 5, 0.02, seed=3)  # step time 20 % shorter when tuned
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
