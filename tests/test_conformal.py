"""Split-conformal helpers: exact order statistics, +inf, and coverage as a statistical claim.

The coverage tests follow MAPIE's ``test_coverage_validity``: many seeded trials per case,
one-sided t-tests that the mean coverage is >= 1 - alpha and <= 1 - alpha + 1/(n + 1),
plus a two-sided test against the exact value k/(n + 1) (k the conformal rank) that holds
for continuous scores. Bonferroni over every test in this file: the family-wise false-alarm
rate of the whole suite is P_FWER = 1e-3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedring.conformal import (
    absolute_residual_scores,
    check_alpha,
    conformal_rank,
    interval_coverage,
    split_conformal_quantile,
)
from fedring.errors import ConfigError

P_FWER = 1e-3
SIZES = (1, 5, 9, 10, 11, 15, 19, 20, 22, 50, 100, 1000)
ALPHAS = (0.1, 0.2, 0.05)
CASES = [(n, a) for n in SIZES for a in ALPHAS]
N_TESTS = 3 * len(CASES)  # lower, upper, exact per case
TRIALS, TEST_POINTS = 400, 200


def test_rank_matches_exact_arithmetic():
    from fractions import Fraction

    for n in range(0, 300):
        for a in ("0.1", "0.05", "0.2", "0.3", "0.01", "0.5"):
            exact = max(1, math.ceil((n + 1) * (1 - Fraction(a))))
            assert conformal_rank(n, float(a)) == exact, (n, a)


def test_quantile_exact_values():
    s = np.array([3.0, 1.0, 2.0, 5.0, 4.0, 9.0, 7.0, 8.0, 6.0, 10.0])
    assert split_conformal_quantile(s, 0.1) == 10.0  # rank ceil(11 * 0.9) = 10
    assert split_conformal_quantile(s, 0.2) == 9.0  # rank ceil(8.8) = 9
    assert split_conformal_quantile(s, 0.5) == 6.0  # rank ceil(5.5) = 6
    assert split_conformal_quantile(s[:9], 0.1) == 9.0  # rank ceil(9.0) = 9, exact product
    assert split_conformal_quantile(s.astype(np.float32), 0.2) == 9.0
    assert split_conformal_quantile(np.arange(10), 0.2) == 8.0  # integer scores
    assert split_conformal_quantile(s.reshape(2, 5), 0.2) == 9.0  # flattened


def test_quantile_infinite_when_rank_exceeds_n():
    assert split_conformal_quantile(np.arange(8.0), 0.1) == math.inf  # rank 9 > 8
    assert split_conformal_quantile(np.empty(0), 0.1) == math.inf
    assert split_conformal_quantile(np.array([1.0]), 0.5) == 1.0  # rank ceil(1.0) = 1
    assert split_conformal_quantile(np.array([1.0]), 0.4) == math.inf  # rank 2 > 1


def test_bad_inputs():
    for a in (0, 1, -0.1, 1.5, float("nan"), "x", None):
        with pytest.raises(ConfigError) as e:
            check_alpha(a)
        assert e.value.key == "alpha"
    with pytest.raises(ValueError):
        split_conformal_quantile(np.array([1.0, np.nan, 2.0] * 10), 0.1)
    with pytest.raises(TypeError):
        split_conformal_quantile(np.array(["a", "b"]), 0.1)


def test_scores_and_coverage_helpers():
    r = absolute_residual_scores(np.array([1.0, -2.0, 0.5]), np.array([0.0, 1.0, 0.5]))
    assert r.tolist() == [1.0, 3.0, 0.0]
    assert interval_coverage(r, 1.0) == 2 / 3
    assert math.isnan(interval_coverage(np.empty(0), 1.0))


def _coverage_trials(n: int, alpha: float, seed: int) -> np.ndarray:
    """Mean coverage of each trial's conformal threshold on fresh test points."""
    rng = np.random.default_rng([seed, n, int(alpha * 1000)])
    # Any continuous score law: a heavy-tailed one here, the guarantee is distribution-free.
    cal = np.abs(rng.standard_t(3, size=(TRIALS, n)))
    test = np.abs(rng.standard_t(3, size=(TRIALS, TEST_POINTS)))
    q = np.array([split_conformal_quantile(c, alpha) for c in cal])
    return (test <= q[:, None]).mean(axis=1)


@pytest.mark.parametrize("n,alpha", CASES)
def test_split_conformal_coverage_is_valid(n, alpha):
    cov = _coverage_trials(n, alpha, seed=20240)
    k = conformal_rank(n, alpha)
    level = P_FWER / N_TESTS
    if k > n:  # infinite threshold: coverage is exactly 1
        assert np.all(cov == 1.0)
        return
    exact = k / (n + 1)  # E[coverage] for continuous exchangeable scores
    assert 1 - alpha <= exact < 1 - alpha + 1 / (n + 1)
    # one-sided: mean >= 1 - alpha (H0 rejected only if significantly below)
    assert stats.ttest_1samp(cov, 1 - alpha, alternative="less").pvalue > level
    # one-sided: mean <= 1 - alpha + 1/(n+1)
    assert stats.ttest_1samp(cov, 1 - alpha + 1 / (n + 1), alternative="greater").pvalue > level
    # two-sided against the exact expectation: catches an off-by-one rank
    assert stats.ttest_1samp(cov, exact).pvalue > level


def test_off_by_one_rank_would_be_caught():
    """The exact-value test has power: the (k-1)-th order statistic is rejected at n = 20."""
    n, alpha = 20, 0.1
    rng = np.random.default_rng(7)
    cal = np.sort(np.abs(rng.standard_t(3, size=(TRIALS, n))), axis=1)
    test = np.abs(rng.standard_t(3, size=(TRIALS, TEST_POINTS)))
    k = conformal_rank(n, alpha)
    wrong = (test <= cal[:, k - 2][:, None]).mean(axis=1)
    assert stats.ttest_1samp(wrong, k / (n + 1)).pvalue < P_FWER / N_TESTS
