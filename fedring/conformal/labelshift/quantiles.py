"""Weighted quantiles of label-shift DP-FedCP and the smoothed pinball loss of Algorithm 1.

Notation of Plassier et al. (ICML 2023): ``Q_beta(mu) = inf{z : mu((-inf, z]) >= beta}`` is the
``beta``-quantile of a (possibly sub-probability) measure ``mu``. The prediction set of a target
agent for label ``y`` compares a test score with ``Q_{1-alpha}(mu_y)``, where ``mu_y`` weighs
the calibration scores by the likelihood ratios of the labels (eqs. 3, 5, 6, 8):
:func:`label_shift_thresholds` computes it centrally, for every label at once. Algorithm 1
approximates it federatedly by minimising the Moreau envelope of the pinball loss (eqs. 12-19):
:func:`moreau_pinball`, its gradient, and :class:`AtomRows`, which evaluates that gradient for
many local measures at once. ``docs/labelshift.md`` explains the choices made where the paper is
silent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from fedring.conformal.split import split_conformal_quantile

# Cumulative weights are sums of up to ~1e5 floats: a level reached "exactly" in real arithmetic
# (e.g. 9 weights of 1/10 against 0.9) may be missed by rounding. Levels within this distance
# count as reached.
_CUM_TOL = 1e-11


def weighted_quantile(values: np.ndarray, weights: np.ndarray, beta: float) -> float:
    """The ``beta``-quantile ``Q_beta(mu) = inf{z : mu((-inf, z]) >= beta}`` of a weighted measure.

    ``mu = sum_k weights_k delta_{values_k}`` may be a sub-probability measure: the missing mass
    ``1 - sum(weights)`` sits at ``+inf`` (Tibshirani et al. 2019 put the test point there), and
    values may themselves be ``+inf``. The result is ``+inf`` whenever the finite atoms carry
    less than ``beta``: the weights demand a set that is the whole label space.

    Parameters
    ----------
    values : (k,) array
    weights : (k,) array, non-negative, summing to at most 1
    beta : float in (0, 1]

    Examples
    --------
    >>> weighted_quantile([3.0, 1.0, 2.0], [0.2, 0.5, 0.3], 0.8)
    2.0
    >>> weighted_quantile([3.0, 1.0, 2.0], [0.2, 0.5, 0.3], 0.81)
    3.0
    >>> weighted_quantile([1.0, 2.0], [0.3, 0.3], 0.9)   # 0.4 of the mass is at +inf
    inf
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if v.shape != w.shape:
        raise ValueError(f"values ({v.size}) and weights ({w.size}) differ in length")
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if w.size and (not np.all(np.isfinite(w)) or w.min() < 0):
        raise ValueError("weights must be finite and non-negative")
    if np.isnan(v).any():
        raise ValueError("values contain NaN")
    if w.sum() > 1.0 + 1e-9:
        raise ValueError(f"weights sum to {w.sum()} > 1")
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    j = int(np.searchsorted(cum, beta - _CUM_TOL, side="left"))
    return math.inf if j >= v.size else float(v[order][j])


def label_shift_thresholds(
    scores: np.ndarray, labels: np.ndarray, w: np.ndarray, alpha: float, test_atom: float = 1.0
) -> np.ndarray:
    """``Q_{1-alpha}(mu_y)`` for every candidate label ``y`` at once (eqs. 3, 5-6, 8).

    .. math::
        \\mu_{\\mathbf y} = \\frac{w_{\\mathbf y} \\delta_{1} + \\sum_k w_{Y_k} \\delta_{V_k}}
                              {w_{\\mathbf y} + \\sum_k w_{Y_k}}

    (eq. 5 gives the weights ``p_{y, y'}``; eq. 6 the measure). The test point's atom sits at
    ``test_atom`` (1 for APS scores, which never exceed 1; ``inf`` for unbounded scores). With
    ``w`` identically 1 this is the unweighted split-conformal threshold of eq. (2). If all
    weights vanish (normaliser 0) no calibration point informs label ``y``, and the threshold is
    ``test_atom``: the set keeps every label rather than guess (``docs/labelshift.md``).

    Parameters
    ----------
    scores, labels : (m,) arrays
        Calibration scores (all <= ``test_atom``) and their labels.
    w : (C,) array
        Likelihood ratios ``w_y`` (any positive scale; only ratios matter).
    alpha : float

    Returns
    -------
    (C,) array of thresholds.

    Examples
    --------
    >>> label_shift_thresholds([0.1, 0.4, 0.7], [0, 1, 1], np.array([3.0, 1.0]), 0.5).tolist()
    [0.4, 0.1]
    """
    v = np.asarray(scores, dtype=np.float64).reshape(-1)
    lab = np.asarray(labels).reshape(-1)
    w = np.asarray(w, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    vs = v[order]
    cum = np.cumsum(w[lab[order]])
    total = (cum[-1] if cum.size else 0.0) + w
    j = np.searchsorted(cum, (1.0 - alpha) * total - _CUM_TOL * np.maximum(total, 1.0), side="left")
    out = np.full(w.shape, float(test_atom))
    hit = (j < vs.size) & (total > 0)
    out[hit] = vs[j[hit]]
    return out


def unweighted_threshold(scores: np.ndarray, alpha: float) -> float:
    """``Q_{1-alpha}`` of eq. (2): the ``ceil((1-alpha)(N+1))``-th smallest of ``{V_k} u {1}``.

    Used for Unweighted Local (agent ``*``'s scores) and Unweighted Global (all scores). Since
    APS scores are at most 1, this is :func:`fedring.conformal.split_conformal_quantile`
    capped at the test point's atom 1.

    >>> unweighted_threshold(np.linspace(0.05, 0.5, 10), 0.1)   # rank ceil(9.9) = 10
    0.5
    >>> unweighted_threshold(np.linspace(0.05, 0.4, 8), 0.1)    # rank 9 > 8: the atom at 1
    1.0
    """
    return min(split_conformal_quantile(np.asarray(scores, dtype=np.float64), alpha), 1.0)


def moreau_pinball(q, v, alpha: float, gamma: float):
    """Moreau envelope ``S^gamma_{alpha,v}(q)`` of the pinball loss, eq. (18) (Lemma A.1).

    .. math::
        S^\\gamma_{\\alpha,v}(q) = \\begin{cases}
          (1-\\alpha)(v-q) - \\gamma(1-\\alpha)^2/2 & q < v - \\gamma(1-\\alpha) \\\\
          (q-v)^2 / (2\\gamma) & v - \\gamma(1-\\alpha) \\le q \\le v + \\gamma\\alpha \\\\
          \\alpha(q-v) - \\gamma\\alpha^2/2 & q > v + \\gamma\\alpha \\end{cases}

    >>> float(moreau_pinball(0.0, 1.0, 0.1, 0.5))   # 0.9 * 1 - 0.5 * 0.81 / 2
    0.6975
    """
    d = np.asarray(q, dtype=np.float64) - np.asarray(v, dtype=np.float64)
    return np.where(
        d < -gamma * (1 - alpha),
        -(1 - alpha) * d - gamma * (1 - alpha) ** 2 / 2,
        np.where(d > gamma * alpha, alpha * d - gamma * alpha**2 / 2, d * d / (2 * gamma)),
    )


def moreau_pinball_grad(q, v, alpha: float, gamma: float):
    """Derivative of eq. (18) in ``q`` (Lemma A.1): ``clip((q - v) / gamma, -(1-alpha), alpha)``.

    Continuous, ``1/gamma``-Lipschitz, with values in ``[-(1-alpha), alpha]``.

    >>> moreau_pinball_grad(np.array([0.0, 0.5, 1.0]), 0.5, 0.1, 0.1).tolist()
    [-0.9, 0.0, 0.1]
    """
    d = np.asarray(q, dtype=np.float64) - np.asarray(v, dtype=np.float64)
    return np.clip(d / gamma, -(1 - alpha), alpha)


class AtomRows:
    """Many discrete measures ("rows"), each with the gradient of its smoothed pinball loss.

    Row ``r`` is ``sum_k a_{rk} delta_{v_{rk}}`` (an agent's local measure of eq. (14) for one
    query label). :meth:`grad` evaluates, for every row at its own point ``q_r``, the derivative
    of the local loss of eq. (19), ``sum_k a_{rk} dS^gamma_{alpha, v_{rk}}(q_r)``, in
    ``O(log m)`` per row from prefix sums, instead of ``O(m)`` atom by atom:

    .. math::
        \\nabla = \\alpha A(lo) - (1-\\alpha)(W - A(hi)) + [q (A(hi) - A(lo)) - (B(hi) - B(lo))] / \\gamma

    with ``A, B`` the prefix sums of ``a`` and ``a v`` over the sorted atoms, ``W`` the row's
    mass, ``lo = #{v < q - gamma alpha}`` and ``hi = #{v <= q + gamma (1 - alpha)}``.

    Every row's result depends on that row alone, bit for bit (so results do not depend on how
    agents are spread over ranks or trials over batches): prefix sums restart at each row, and
    the one ``searchsorted`` over all rows (row ``r`` shifted by ``r * span``) is followed by an
    exact correction of the counts against the unshifted values.

    Parameters
    ----------
    values, weights : sequences of 1-D arrays, one per row (a row may be empty: gradient 0)
    alpha, gamma : float
    """

    def __init__(self, values: Sequence[np.ndarray], weights: Sequence[np.ndarray], alpha: float, gamma: float):
        if len(values) != len(weights):
            raise ValueError("values and weights must have one entry per row")
        self.alpha, self.gamma = float(alpha), float(gamma)
        self.n_rows = len(values)
        vs = [np.asarray(v, np.float64).reshape(-1) for v in values]
        ws = [np.asarray(a, np.float64).reshape(-1) for a in weights]
        if any(v.shape != a.shape for v, a in zip(vs, ws)):
            raise ValueError("each row needs as many weights as values")
        orders = [np.argsort(v, kind="stable") for v in vs]
        vs = [v[o] for v, o in zip(vs, orders)]
        ws = [a[o] for a, o in zip(ws, orders)]
        lengths = np.array([v.size for v in vs], dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(lengths)])[:-1]
        self.end = self.start + lengths
        self.vals = np.concatenate(vs) if lengths.sum() else np.zeros(0)
        # Row r's prefix sums sit at cstart[r] .. cstart[r] + m_r, starting from 0.
        self.cstart = self.start + np.arange(self.n_rows)
        self.cum_a = np.concatenate([np.zeros(0)] + [np.concatenate([[0.0], np.cumsum(a)]) for a in ws])
        self.cum_b = np.concatenate([np.zeros(0)] + [np.concatenate([[0.0], np.cumsum(a * v)]) for v, a in zip(vs, ws)])
        self.mass = self.cum_a[self.cstart + lengths]
        self.vmin = float(self.vals.min()) if self.vals.size else 0.0
        self.width = (float(self.vals.max()) - self.vmin) if self.vals.size else 0.0
        self.offset = np.arange(self.n_rows) * (self.width + 4.0)
        self.keys = self.vals - np.repeat(self.vmin - self.offset, lengths)

    def _count(self, t: np.ndarray, strict: bool) -> np.ndarray:
        """Per row, ``#{v < t}`` (strict) or ``#{v <= t}``."""
        side: Literal["left", "right"] = "left" if strict else "right"
        # Clipping keeps each search inside its own row's band; beyond the atoms the counts saturate.
        p = np.searchsorted(self.keys, np.clip(t - self.vmin, -1.0, self.width + 1.0) + self.offset, side=side)
        before = np.less if strict else np.less_equal
        last = self.vals.size - 1
        while True:
            down = (p > self.start) & ~before(self.vals[np.maximum(p - 1, 0)], t)
            up = (p < self.end) & before(self.vals[np.minimum(p, last)], t)
            if not (down.any() or up.any()):
                return p - self.start
            p = p - down + up

    def grad(self, q: np.ndarray) -> np.ndarray:
        """Gradient of each row's smoothed loss at ``q`` (shape ``(n_rows,)``)."""
        al, ga = self.alpha, self.gamma
        q = np.asarray(q, dtype=np.float64)
        if self.vals.size == 0:
            return np.zeros(self.n_rows)
        lo = self.cstart + self._count(q - ga * al, strict=True)
        hi = self.cstart + self._count(q + ga * (1 - al), strict=False)
        a_lo, a_hi = self.cum_a[lo], self.cum_a[hi]
        return al * a_lo - (1 - al) * (self.mass - a_hi) + (q * (a_hi - a_lo) - (self.cum_b[hi] - self.cum_b[lo])) / ga


def smoothed_quantile(values: np.ndarray, weights: np.ndarray, alpha: float, gamma: float) -> float:
    """``Q^gamma_{1-alpha}``: the minimiser of the smoothed loss of eq. (13), by bisection.

    The derivative of ``sum_k p_k S^gamma_{alpha, v_k}`` is continuous and non-decreasing, so
    bisection on its sign finds the minimiser (unique when ``1 - alpha`` is not a partial sum of
    the sorted weights, Lemma A.2). Theorem A.3 / 3.1: ``|Q^gamma - Q| <= gamma``, more precisely
    ``Q - gamma (1 - alpha) <= Q^gamma <= Q + gamma alpha``. Reference value for tests and
    reports; the federated method never computes it.
    """
    rows = AtomRows([values], [np.asarray(weights, np.float64) / np.sum(weights)], alpha, gamma)
    lo, hi = float(np.min(values)) - gamma, float(np.max(values)) + gamma
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if rows.grad(np.array([mid]))[0] < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return 0.5 * (lo + hi)
