"""Split-conformal helpers shared by the federated conformal methods.

Stable API (other modules import these names):

- :func:`conformal_rank` -- the 1-based order statistic ``ceil((n + 1)(1 - alpha))``.
- :func:`split_conformal_quantile` -- the split-conformal quantile of a score sample.
- :func:`absolute_residual_scores` -- regression nonconformity scores ``|y - y_hat|``.
- :func:`interval_coverage` -- fraction of scores a threshold covers.
- :func:`check_alpha` -- validation of a miscoverage level (raises ``ConfigError``).

Reference: J. Lei, M. G'Sell, A. Rinaldo, R. J. Tibshirani, L. Wasserman, "Distribution-free
predictive inference for regression", JASA 113 (2018); Vovk et al. (2005). For exchangeable
scores ``s_1..s_n, s_{n+1}`` the threshold ``q = s_(k)`` with ``k = ceil((n+1)(1-alpha))``
gives ``1 - alpha <= P(s_{n+1} <= q) <= 1 - alpha + 1/(n+1)`` (the upper bound when the
scores have no ties).
"""

from __future__ import annotations

import math

import numpy as np

from fedring.validate import real

# (n + 1)(1 - alpha) is an integer in exact arithmetic for common pairs such as n = 9,
# alpha = 0.1; float rounding may put it a hair above, and ceil would then skip a rank.
_RANK_TOL = 1e-9


def check_alpha(alpha: float, key: str = "alpha") -> float:
    """Return ``alpha`` as a float, or raise ``ConfigError`` unless ``0 < alpha < 1``."""
    return real(key, alpha, lo=0, hi=1, lo_open=True, hi_open=True)


def conformal_rank(n: int, alpha: float) -> int:
    """1-based rank ``k = ceil((n + 1)(1 - alpha))`` of the split-conformal order statistic.

    ``k > n`` means the quantile is ``+inf`` (too few scores for level ``1 - alpha``).

    Examples
    --------
    >>> conformal_rank(9, 0.1), conformal_rank(10, 0.1), conformal_rank(8, 0.1)
    (9, 10, 9)
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a = check_alpha(alpha)
    return max(1, math.ceil((n + 1) * (1.0 - a) - _RANK_TOL))


def split_conformal_quantile(scores: np.ndarray, alpha: float) -> float:
    """Split-conformal quantile: the ``ceil((n+1)(1-alpha))``-th smallest score.

    Equivalently the empirical quantile at level ``ceil((n+1)(1-alpha))/n`` with the
    "inverted CDF" rule. Returns ``+inf`` when that rank exceeds ``n`` (including ``n = 0``),
    so that the interval is the whole line and coverage still holds.

    Parameters
    ----------
    scores : array_like
        Nonconformity scores (any shape; flattened), float32 or float64. NaN is rejected.
    alpha : float
        Miscoverage level in (0, 1).

    Returns
    -------
    float
        The threshold ``q`` such that ``{y : s(x, y) <= q}`` has coverage ``>= 1 - alpha``.

    Examples
    --------
    >>> split_conformal_quantile(np.arange(1.0, 11.0), 0.1)   # n=10: rank ceil(9.9)=10
    10.0
    >>> split_conformal_quantile(np.arange(1.0, 10.0), 0.1)   # n=9: rank 9
    9.0
    >>> split_conformal_quantile(np.arange(1.0, 9.0), 0.1)    # n=8: rank 9 > 8
    inf
    """
    s = np.asarray(scores).ravel()
    if s.dtype.kind not in "fiu":
        raise TypeError(f"scores must be numeric, got dtype {s.dtype}")
    k = conformal_rank(s.size, alpha)
    if k > s.size:
        return math.inf
    if s.dtype.kind == "f" and np.isnan(s).any():
        raise ValueError("scores contain NaN")
    return float(np.partition(s, k - 1)[k - 1])


def absolute_residual_scores(y: np.ndarray, y_hat: np.ndarray) -> np.ndarray:
    """Regression nonconformity scores ``|y - y_hat|`` (PRISM-FCP eq. (7))."""
    return np.abs(np.asarray(y) - np.asarray(y_hat))


def interval_coverage(test_scores: np.ndarray, q: float) -> float:
    """Fraction of test scores ``<= q``: the empirical coverage of ``{y : s <= q}``.

    An empty test set has coverage ``nan``.
    """
    s = np.asarray(test_scores).ravel()
    if s.size == 0:
        return math.nan
    return float(np.count_nonzero(s <= q)) / s.size
