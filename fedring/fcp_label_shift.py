"""DP-FedCP: federated conformal prediction under label shift, with differential privacy.

Reference: V. Plassier, M. Makni, A. Rubashevskii, E. Moulines, M. Panov, "Conformal Prediction
for Federated Uncertainty Quantification Under Label Shift", ICML 2023 (PMLR 202),
arXiv:2306.05131. Equation numbers below are the paper's; "spec" is
``shared/specs/fcp-label-shift.md``, whose ambiguity list (A1..A25) fixes what the paper leaves
out (its Appendices D and E, with the optimiser settings and eq. (86), are missing).

``n`` agents each hold calibration scores ``V_k^i`` in [0, 1] (randomised APS, :func:`aps_scores`)
whose labels follow agent-specific priors ``P_Y^i`` over a shared ``P_{X|Y}`` (label shift).
For a target agent ``*`` the prediction set is ``{y : V(x, y) <= Q_{1-alpha}(mu_y)}`` where
``mu_y`` reweights the scores by the likelihood ratio ``w_y = P_Y^*(y) / P_Y^cal(y)``:

* weights from label counts, eq. (10), optionally privatised with discrete Gaussian noise
  (Algorithm 2): :func:`privatise_counts`, :func:`mle_weights`;
* a multinomial subsample of ``floor(N/2)`` points makes the pooled points i.i.d. from
  ``P_Y^cal`` (eqs. 5-6): :func:`subsample_sizes`;
* the weighted quantile is computed federatedly by noisy local gradient steps on the
  Moreau envelope of the pinball loss (eqs. 13-19, Algorithm 1 "DP-FedAvgQE"):
  :func:`dp_fedavgqe`;
* the Gaussian gradient noise gives (epsilon, delta)-DP by Theorem 4.4: :func:`sigma_g_min`,
  :func:`epsilon_for_sigma`.

Baselines (paper Section 5): unweighted local (agent ``*`` only), unweighted global (eq. 2, all
scores pooled centrally), oracle weights (the exact ratios, spec A10) and the exact centralised
weighted quantile of eq. (8) that DP-FedCP approximates.

The command line (``python -m fedring conformal labelshift``) is :func:`main`; it runs the
paper's simulated 2-D Gaussian experiment (Section 5) or the CIFAR-10 protocol on any model's
test logits (``--logits F.npz``, or ``--model-from RUN.h5`` for a fedring Fashion-MNIST CNN),
with agents hosted by MPI ranks (:class:`fedring.comm.Layout`) and every protocol byte counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from fedring.conformal import check_alpha, split_conformal_quantile
from fedring.errors import ConfigError

__all__ = [
    "softmax",
    "aps_scores",
    "weighted_quantile",
    "label_shift_thresholds",
    "unweighted_threshold",
    "moreau_pinball",
    "moreau_pinball_grad",
    "AtomRows",
    "smoothed_quantile",
    "label_counts",
    "discrete_gaussian",
    "privatise_counts",
    "mle_weights",
    "oracle_weights",
    "calibration_prior",
    "weight_error",
    "subsample_sizes",
    "select_subset",
    "local_measure",
    "query_decomposition",
    "fedavgqe_local_round",
    "dp_fedavgqe",
    "sigma_g_min",
    "epsilon_for_sigma",
    "count_noise_epsilon",
    "dp_fedcp_thresholds",
    "predict_sets",
    "GaussianExperiment",
    "LogitsExperiment",
    "load_logits_npz",
    "logits_from_run",
    "Config",
    "parse_config",
    "run",
    "main",
]

# Cumulative weights are sums of up to ~1e5 floats: a level reached "exactly" in real arithmetic
# (e.g. 9 weights of 1/10 against 0.9) may be missed by rounding. Levels within this distance
# count as reached.
_CUM_TOL = 1e-11


# ---------------------------------------------------------------------------------------------
# Scores (Section 5; Romano et al. 2020)
# ---------------------------------------------------------------------------------------------


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of ``logits / temperature`` (temperature scaling, paper Section 5).

    >>> softmax(np.array([[0.0, np.log(3.0)]])).round(6).tolist()
    [[0.25, 0.75]]
    """
    if not temperature > 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature!r}")
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def aps_scores(probs: np.ndarray, labels: np.ndarray | None, u: np.ndarray) -> np.ndarray:
    """Randomised APS non-conformity scores (paper Section 5, Romano et al. 2020).

    .. math::
        \\rho(x, y) = \\sum_{y'} p[y'] 1\\{p[y'] > p[y]\\}, \\qquad V(x, y) = \\rho(x, y) + U p[y]

    with ``p = f(x)`` and ``U ~ Uniform[0, 1]``. ``V`` lies in [0, 1] because
    ``rho + U p[y] <= sum(p) = 1``: this is why every weighted measure puts the test point's
    atom at 1.

    Parameters
    ----------
    probs : (m, C) array
        Class probabilities, rows summing to 1 (float32 or float64).
    labels : (m,) int array or None
        With labels: one score per row, ``V(x_k, y_k)``. Without: the ``(m, C)`` matrix of
        scores of every candidate label, with one ``U`` per row shared across labels (spec A14,
        as in the APS reference code; this makes the sets nested in the threshold).
    u : (m,) array
        The uniform draws.

    Examples
    --------
    >>> p = np.array([[0.5, 0.3, 0.2]])
    >>> aps_scores(p, np.array([1]), np.array([0.5])).tolist()   # 0.5 + 0.5 * 0.3
    [0.65]
    >>> aps_scores(p, None, np.array([0.0])).round(12).tolist()
    [[0.0, 0.5, 0.8]]
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be (m, C), got shape {p.shape}")
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    if u.shape[0] != p.shape[0]:
        raise ValueError(f"u has {u.shape[0]} entries for {p.shape[0]} rows")
    m, c = p.shape
    # rho = mass of classes strictly more likely; ties share the mass of their tie group.
    order = np.argsort(-p, axis=1, kind="stable")
    ps = np.take_along_axis(p, order, axis=1)
    before = np.cumsum(ps, axis=1) - ps
    new_group = np.ones((m, c), dtype=bool)
    new_group[:, 1:] = ps[:, 1:] != ps[:, :-1]
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(c), 0), axis=1)
    rho_sorted = np.take_along_axis(before, group_start, axis=1)
    rho = np.empty_like(rho_sorted)
    np.put_along_axis(rho, order, rho_sorted, axis=1)
    # Rows summing to 1 only up to rounding could exceed the test atom at 1 by an ulp.
    if labels is None:
        return np.minimum(rho + u[:, None] * p, 1.0)
    lab = np.asarray(labels).reshape(-1)
    if lab.shape[0] != m:
        raise ValueError(f"labels has {lab.shape[0]} entries for {m} rows")
    rows = np.arange(m)
    return np.minimum(rho[rows, lab] + u * p[rows, lab], 1.0)


# ---------------------------------------------------------------------------------------------
# Weighted quantiles (Section 1 notation; eqs. 2, 3, 5, 6, 8)
# ---------------------------------------------------------------------------------------------


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
    weights vanish (normaliser 0) the threshold is ``test_atom`` (the full set), spec Section 2.4.

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


# ---------------------------------------------------------------------------------------------
# Moreau envelope of the pinball loss (eqs. 12, 13, 18, 19; Lemma A.1)
# ---------------------------------------------------------------------------------------------


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
    ``O(log m)`` per row from prefix sums (spec Section 2.9):

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
        side = "left" if strict else "right"
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


# ---------------------------------------------------------------------------------------------
# Importance weights (eqs. 7, 9, 10; Algorithm 2; Remark 3.2)
# ---------------------------------------------------------------------------------------------


def label_counts(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """``M_y`` = number of labels equal to ``y``, as int64 (length ``n_classes``)."""
    return np.bincount(np.asarray(labels, dtype=np.int64).reshape(-1), minlength=n_classes).astype(np.int64)


def discrete_gaussian(sigma_bar: float, size, rng: np.random.Generator) -> np.ndarray:
    """Samples of the discrete Gaussian ``N_Z(0, sigma_bar^2)``: ``P(z) ∝ exp(-z^2 / (2 sigma_bar^2))``.

    Canonne, Kamath & Steinke (2020), used by Algorithm 2 on the label counts. Sampled by
    inverse CDF on ``[-ceil(12 sigma_bar), ceil(12 sigma_bar)]``; the truncated tail mass is
    below ``exp(-72)``. ``sigma_bar = 0`` gives zeros.
    """
    if sigma_bar < 0:
        raise ConfigError("count-noise", f"must be >= 0, got {sigma_bar}")
    if sigma_bar == 0:
        return np.zeros(size, dtype=np.int64)
    half = math.ceil(12 * sigma_bar)
    support = np.arange(-half, half + 1)
    pmf = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma_bar**2))
    cdf = np.cumsum(pmf / pmf.sum())
    idx = np.searchsorted(cdf, rng.random(size), side="right")
    return support[np.minimum(idx, support.size - 1)]


def privatise_counts(counts: np.ndarray, sigma_bar: float, rng: np.random.Generator) -> np.ndarray:
    """Algorithm 2's released counts ``max(1, M_y + z_y)``, ``z_y ~ N_Z(0, sigma_bar^2)``.

    With ``sigma_bar = 0`` the counts are returned unchanged, without the floor: the floor only
    serves to keep noisy counts positive, and on exact sparse counts it biases the weights
    towards uniform (spec A8, where it drops ImageNet-like coverage from 0.90 to 0.82).
    """
    counts = np.asarray(counts, dtype=np.int64)
    if sigma_bar == 0:
        return counts.copy()
    return np.maximum(1, counts + discrete_gaussian(sigma_bar, counts.shape, rng))


def mle_weights(counts: np.ndarray, star: int) -> np.ndarray:
    """Likelihood-ratio estimates from label counts, eq. (10).

    .. math::
        \\hat w_y = \\frac{M \\, M^\\star_y}{M^\\star M_y} 1\\{M_y \\ge 1\\}

    where ``counts[i, y] = M^i_y``, ``M_y = sum_i M^i_y``, ``M^* = sum_y M^*_y`` and
    ``M = sum_y M_y``. This is eq. (7) with ``pi_i = M^i / M``; with the default count source
    (the calibration labels, spec A9) it is ``pi_i = N^i / N`` as the theory requires.

    Examples
    --------
    >>> mle_weights(np.array([[8, 1, 1], [1, 1, 8]]), star=1).round(4).tolist()   # 20 [1,1,8] / (10 [9,2,9])
    [0.2222, 1.0, 1.7778]
    """
    m = np.asarray(counts, dtype=np.float64)
    m_y = m.sum(axis=0)
    m_star = m[star].sum()
    if m_star <= 0:
        raise ValueError(f"agent {star} has no labels: its likelihood ratios are undefined")
    out = np.zeros(m.shape[1])
    seen = m_y >= 1
    out[seen] = m.sum() * m[star, seen] / (m_star * m_y[seen])
    return out


def calibration_prior(priors: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``P_Y^cal = sum_i pi_i P_Y^i`` with ``pi_i = N^i / N`` (Section 2)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    return (sizes / sizes.sum()) @ np.asarray(priors, dtype=np.float64)


def oracle_weights(priors: np.ndarray, sizes: np.ndarray, star: int) -> np.ndarray:
    """Exact ratios ``w*_y = P_Y^*(y) / P_Y^cal(y)`` with ``pi_i = N^i / N`` (Section 2).

    >>> oracle_weights(np.array([[.8, .1, .1], [.1, .1, .8]]), np.array([1000, 50]), 1).round(6).tolist()
    [0.130435, 1.0, 6.0]
    """
    p_cal = calibration_prior(priors, sizes)
    p_star = np.asarray(priors, dtype=np.float64)[star]
    out = np.zeros_like(p_cal)
    np.divide(p_star, p_cal, out=out, where=p_cal > 0)
    return out


def weight_error(p_star: np.ndarray, w_hat: np.ndarray, p_cal: np.ndarray) -> float:
    """``R`` of eq. (9) (Lemma 2.3): total-variation distance between ``P_Y^*`` and ``∝ w_hat P_Y^cal``.

    >>> weight_error(np.array([0.5, 0.5]), np.array([1.0, 1.0]), np.array([0.5, 0.5]))
    0.0
    """
    q = np.asarray(w_hat, np.float64) * np.asarray(p_cal, np.float64)
    return 0.5 * float(np.abs(np.asarray(p_star, np.float64) - q / q.sum()).sum())


# ---------------------------------------------------------------------------------------------
# Subsample and per-agent decomposition (eqs. 5, 14, 19; Algorithm 2)
# ---------------------------------------------------------------------------------------------


def subsample_sizes(sizes: np.ndarray, rng: np.random.Generator, n_queries: int = 1) -> np.ndarray:
    """Multinomial subsample sizes ``(Nbar^i) ~ Multi(floor(N/2), (N^i/N)_i)`` (Theorem 2.2, Alg. 2).

    Returns ``(n_queries, n)``: Algorithm 2 draws afresh for every query label. Agent ``i`` then
    keeps ``min(N^i, Nbar^i)`` of its points (:func:`select_subset`).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros((n_queries, sizes.size), dtype=np.int64)
    return rng.multinomial(total // 2, sizes / total, size=n_queries).astype(np.int64)


def select_subset(n_points: int, keep: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of ``min(n_points, keep)`` points chosen uniformly without replacement.

    The paper says "the first ``N^i ∧ Nbar^i``"; the points are i.i.d., so a uniform subset is
    the same in distribution (spec Section 2.2c) and differs between query labels.
    """
    mask = np.zeros(n_points, dtype=bool)
    mask[rng.choice(n_points, size=min(n_points, int(keep)), replace=False)] = True
    return mask


def local_measure(
    scores: np.ndarray, labels: np.ndarray, selected: np.ndarray, w_hat: np.ndarray, y: int, n_local: int, n_total: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Agent ``i``'s share of ``mu_y``: the unnormalised atoms of eq. (14) and their mass ``D``.

    Returns ``(values, weights, mass)`` with values ``V_k^i (k in J_i)`` and 1, weights
    ``w_hat[Y_k^i]`` and ``N^i w_hat[y] / N``. Dividing the weights by the agent's mass gives
    ``mu^i_y`` of eq. (14) (the normaliser ``Z_y`` cancels, so the agent never needs it); the
    server gets ``lambda^i_y = mass / Z_y`` (:func:`query_decomposition`).
    """
    v = np.append(np.asarray(scores, np.float64)[selected], 1.0)
    a = np.append(np.asarray(w_hat, np.float64)[np.asarray(labels)[selected]], n_local * w_hat[y] / max(n_total, 1))
    return v, a, float(a.sum())


def query_decomposition(w_hat: np.ndarray, sizes: np.ndarray, weight_sums: np.ndarray):
    """Server side of eqs. (5) and (14) for every query label: ``Z_y``, ``p_{y,y}`` and ``lambda^i_y``.

    ``w_hat`` is ``(..., C)``; ``weight_sums[i, ..., y] = D_i = sum_{k in J_i} w_hat[Y_k^i]`` over
    agent ``i``'s subset for query ``y`` (sent by the agent).

    .. math::
        Z_y = \\hat w_y + \\sum_i D_i, \\quad p_{y,y} = \\hat w_y / Z_y, \\quad
        \\lambda^i_y = (N^i/N)\\, p_{y,y} + D_i / Z_y

    so ``sum_i lambda^i_y = 1``. ``Z_y = 0`` (all weights vanish) gives ``lambda = 0``; the
    threshold is then 1, the full set (spec Section 2.4).

    Examples
    --------
    >>> z, p, lam = query_decomposition(np.array([2.0, 0.5]), np.array([3, 1]), np.array([[5.0, 1.0], [1.0, 2.5]]))
    >>> z.tolist(), p.tolist(), lam[:, 0].tolist()       # Z_0 = 2 + 5 + 1; lambda = 0.75 * 0.25 + D / 8
    ([8.0, 4.0], [0.25, 0.125], [0.8125, 0.1875])
    """
    w = np.asarray(w_hat, np.float64)
    d = np.asarray(weight_sums, np.float64)
    frac = np.asarray(sizes, np.float64) / max(float(np.sum(sizes)), 1.0)
    z = w + d.sum(axis=0)
    safe = np.where(z > 0, z, 1.0)
    p_test = np.where(z > 0, w / safe, 0.0)
    lam = np.where(z > 0, frac.reshape((-1,) + (1,) * w.ndim) * p_test + d / safe, 0.0)
    return z, p_test, lam


# ---------------------------------------------------------------------------------------------
# Algorithm 1: DP-FedAvgQE (eqs. 15, 16)
# ---------------------------------------------------------------------------------------------


def fedavgqe_local_round(
    q: np.ndarray, rows: AtomRows, local_steps: int, eta: float, noise: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One round of Algorithm 1 on the agents' side, for ``A`` agents and ``Q`` queries at once.

    ``rows`` holds ``A * Q`` local measures, agent-major; ``q`` (Q,) is the server's quantile.
    For ``k = 0..K-1``: ``g = grad S^{i,gamma}_alpha(q_k) + z_k`` (eq. 15, ``noise[k]`` already
    scaled by ``sigma_g``), ``q_{k+1} = q_k - eta g``. Returns ``(Delta q, Delta qbar)``, both
    ``(A, Q)``: ``q_K - q_0`` and ``(1/K) sum_{k=1..K} q_k`` (the box's ``k in [K]``, spec A5).
    """
    n_q = q.shape[0]
    x = np.tile(q, (rows.n_rows // n_q, 1))
    acc = np.zeros_like(x)
    for k in range(local_steps):
        g = rows.grad(x.reshape(-1)).reshape(x.shape)
        if noise is not None:
            g += noise[k]
        x -= eta * g
        acc += x
    return x - q, acc / local_steps


class _InProcess:
    """Stand-in for :class:`fedring.comm.Network` when every agent lives in this process."""

    def __init__(self, n_clients: int):
        self.lo, self.hi, self.rank, self.size, self.n_clients = 0, n_clients, 0, 1, n_clients
        self.layout = self

    @property
    def local_clients(self) -> range:
        return range(self.lo, self.hi)

    def gather_to_server(self, local: np.ndarray, phase: str) -> np.ndarray:
        return np.array(local)

    def broadcast_from_server(self, vec, phase, shape, dtype) -> np.ndarray:
        return np.ascontiguousarray(vec, dtype=dtype).reshape(shape)


def dp_fedavgqe(
    rows: AtomRows,
    lam: np.ndarray | None,
    *,
    q0: np.ndarray,
    rounds: int,
    local_steps: int,
    eta: float,
    noise: Callable[[int], np.ndarray] | None = None,
    participation: Callable[[int], np.ndarray] | None = None,
    net=None,
    phase: str = "labelshift/fedavgqe",
) -> np.ndarray:
    """Algorithm 1 (DP-FedAvgQE): the federated smoothed quantile ``Qhat^gamma_{1-alpha,T}``.

    Runs ``Q`` independent instances (one per query label, trial, ...) in lock-step. Per round
    ``t``: the server broadcasts ``q_t``; each agent runs :func:`fedavgqe_local_round` on its
    local losses (eq. 19) and sends ``(Delta q, Delta qbar)``; the server updates

    .. math::
        q_{t+1} = q_t + \\frac{n}{|S_{t+1}|} \\sum_{i \\in S_{t+1}} \\lambda^i_y \\Delta q^i_{t+1},
        \\qquad \\hat Q = \\frac1T \\sum_{t=1}^T \\frac{n}{|S_t|} \\sum_{i \\in S_t} \\lambda^i_y \\Delta\\bar q^i_t

    (eq. 16; the box's update with ``lambda``, spec A3).

    Parameters
    ----------
    rows : AtomRows
        This process's agents' local measures, ``A * Q`` rows agent-major (each row normalised to
        mass 1, or 0 for an agent without mass for that query).
    lam : (n, Q) array on the server (rank 0), ignored elsewhere
        Mixture weights ``lambda^i_y``.
    q0 : (Q,) array
        Initial quantile (spec A20: ``1 - alpha``).
    rounds, local_steps, eta : int, int, float
        ``T``, ``K`` and the step size (Theorem 4.1 wants ``eta <= gamma / 10``).
    noise : callable ``t -> (K, A, Q)`` or None
        Gradient noise ``z^i_{t,k}`` (already multiplied by ``sigma_g``) for round ``t``.
    participation : callable ``t -> (n, Q) bool`` or None
        Server's sampled agents ``S_{t+1}`` per instance; None is full participation (the
        default the convergence theorems assume, spec A4). All agents compute and send every
        round; the server discards the non-sampled ones.
    net : fedring.comm.Network or None
        Message transport; None runs all ``n = A`` agents in this process.

    Returns
    -------
    (Q,) array on every rank.
    """
    n_q = int(np.asarray(q0).shape[0])
    if net is None:
        net = _InProcess(rows.n_rows // max(n_q, 1))
    q = np.asarray(q0, dtype=np.float64).copy()
    qbar_sum = np.zeros(n_q)
    for t in range(rounds):
        q = net.broadcast_from_server(q if net.layout.rank == 0 else None, phase, (n_q,), np.float64)
        dq, dqbar = fedavgqe_local_round(q, rows, local_steps, eta, None if noise is None else noise(t))
        both = net.gather_to_server(np.concatenate([dq, dqbar], axis=1), phase)
        if net.layout.rank == 0:
            coef = np.asarray(lam, dtype=np.float64)
            if participation is not None:
                mask = participation(t)
                coef = coef * mask * (mask.shape[0] / np.maximum(mask.sum(axis=0), 1))
            q = q + (coef * both[:, :n_q]).sum(axis=0)
            qbar_sum += (coef * both[:, n_q:]).sum(axis=0)
    out = qbar_sum / rounds if net.layout.rank == 0 else None
    return net.broadcast_from_server(out, phase + "-result", (n_q,), np.float64)


# ---------------------------------------------------------------------------------------------
# Privacy (Theorem 4.4; Remark 3.2)
# ---------------------------------------------------------------------------------------------


def _delta_bar(epsilon: float, delta: float, rounds: int, participants: int, n_agents: int) -> float:
    return n_agents / participants * (1.0 - ((1.0 - delta) / (1.0 + math.sqrt(epsilon))) ** (1.0 / rounds))


def _check_privacy_args(delta, rounds, local_steps, participants, n_agents):
    if not 0 < delta < 1:
        raise ConfigError("delta", f"must be in (0, 1), got {delta}")
    if rounds < 1 or local_steps < 1:
        raise ConfigError("rounds", f"rounds and local steps must be >= 1, got {rounds}, {local_steps}")
    if not 1 <= participants <= n_agents:
        raise ConfigError("participants", f"must be in [1, {n_agents}], got {participants}")


def sigma_g_min(
    epsilon: float, delta: float, rounds: int, local_steps: int, participants: int, n_agents: int, lam_max: float
) -> float:
    """Smallest gradient-noise ``sigma_g`` for which Algorithm 1 is (epsilon, delta)-DP, Theorem 4.4.

    .. math::
        \\sigma_g \\ge 2 \\sqrt{\\frac{K \\max_i \\lambda^i_y}{\\epsilon}
            \\Big(1 + \\frac{24 S \\sqrt T \\log(1/\\bar\\delta)}{\\epsilon n}\\Big)}, \\qquad
        \\bar\\delta = \\frac nS \\Big[1 - \\Big(\\frac{1-\\delta}{1+\\sqrt\\epsilon}\\Big)^{1/T}\\Big]

    for ``S`` agents sampled per round out of ``n``, valid when
    ``0 < delta < 1 - (1 + sqrt(epsilon)) (1 - S/n)^T``, i.e. ``delta_bar`` in (0, 1). The
    guarantee is the paper's, "towards a third party" for one run of Algorithm 1 (one query
    label), with the adjacency left undefined in the available text (spec A11); it covers
    neither ``lambda``, nor the weight sums, nor the subsample.

    Examples
    --------
    >>> round(sigma_g_min(1.0, 1e-5, 1000, 10, 11, 11, 0.5), 4)   # spec Section 2.7, row 1
    332.3261
    """
    _check_privacy_args(delta, rounds, local_steps, participants, n_agents)
    if not epsilon > 0:
        raise ConfigError("epsilon", f"must be > 0, got {epsilon}")
    db = _delta_bar(epsilon, delta, rounds, participants, n_agents)
    if not 0 < db < 1:
        limit = 1 - (1 + math.sqrt(epsilon)) * (1 - participants / n_agents) ** rounds
        raise ConfigError(
            "delta", f"Theorem 4.4 needs 0 < delta < 1 - (1 + sqrt(eps))(1 - S/n)^T = {limit:.6g}, got {delta}"
        )
    sampling = 24 * participants * math.sqrt(rounds) * math.log(1 / db) / (epsilon * n_agents)
    return 2.0 * math.sqrt(local_steps * lam_max / epsilon * (1 + sampling))


def epsilon_for_sigma(
    sigma_g: float, delta: float, rounds: int, local_steps: int, participants: int, n_agents: int, lam_max: float
) -> float:
    """Smallest ``epsilon`` that Theorem 4.4 certifies for noise ``sigma_g`` (``inf`` if none).

    The theorem's bound decreases in ``epsilon``, so this inverts :func:`sigma_g_min` by bisection
    in ``log epsilon`` (not in the paper; spec Section 2.7). ``lam_max = 0`` (an instance with no
    weight at all) releases nothing: ``epsilon = 0``.
    """
    _check_privacy_args(delta, rounds, local_steps, participants, n_agents)
    if lam_max <= 0:
        return 0.0
    if sigma_g <= 0:
        return math.inf
    hi = 1e12
    if participants < n_agents:
        # delta_bar < 1 caps epsilon: (1 - delta) / (1 + sqrt(eps)) > (1 - S/n)^T.
        hi = min(hi, ((1 - delta) / (1 - participants / n_agents) ** rounds - 1) ** 2 * (1 - 1e-12))
        if hi <= 0:
            return math.inf

    def ok(eps: float) -> bool:
        db = _delta_bar(eps, delta, rounds, participants, n_agents)
        return 0 < db < 1 and sigma_g_min(eps, delta, rounds, local_steps, participants, n_agents, lam_max) <= sigma_g

    if not ok(hi):
        return math.inf
    lo = 1e-12
    if ok(lo):
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-12:
            break
    return hi


def count_noise_epsilon(sigma_bar: float, delta: float) -> float:
    """(epsilon, delta) of the discrete-Gaussian label counts (Algorithm 2), via zero-concentrated DP.

    Not in the available paper text (its Appendix D is missing); from Canonne, Kamath & Steinke
    (2020): noise ``N_Z(0, sigma_bar^2)`` on a histogram of l2-sensitivity 1 (one example added
    or removed) is ``rho``-zCDP with ``rho = 1 / (2 sigma_bar^2)``; agents hold disjoint data, so
    the release of all agents' counts is ``rho``-zCDP for one example, and
    ``epsilon = rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 2016, Prop. 1.3).

    >>> round(count_noise_epsilon(10.0, 1e-5), 6)
    0.484853
    """
    if not 0 < delta < 1:
        raise ConfigError("delta", f"must be in (0, 1), got {delta}")
    if sigma_bar <= 0:
        return math.inf
    rho = 1.0 / (2.0 * sigma_bar**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


# ---------------------------------------------------------------------------------------------
# Experiments (paper Section 5; spec Section 4)
# ---------------------------------------------------------------------------------------------

# Independent random streams: np.random.default_rng([seed, trial, who, stream, a, b]) with
# who = agent index or _SERVER, so results do not depend on which rank hosts which agent.
# The key has a fixed length because SeedSequence ignores trailing zeros ([1, 2] == [1, 2, 0]).
_SERVER = 2**31 - 1
_DATA, _COUNT_NOISE, _SUBSET, _GRAD_NOISE, _MULTINOMIAL, _PARTICIPATION, _TEST, _SPLIT = range(1, 9)


def _rng(seed: int, trial: int, who: int, stream: int, a: int = 0, b: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, trial, who, stream, a, b])


@dataclass
class AgentData:
    """One agent's calibration data for one trial, sorted by score."""

    scores: np.ndarray
    labels: np.ndarray


@dataclass
class EvalData:
    """Target agent's test points: scores of every label, labels, and estimator weights."""

    scores: np.ndarray  # (m, C)
    labels: np.ndarray  # (m,)
    weights: np.ndarray  # (m,), sum to 1: coverage = sum_j weights_j 1{y_j in C(x_j)}


def _sorted_agent(scores: np.ndarray, labels: np.ndarray) -> AgentData:
    order = np.argsort(scores, kind="stable")
    return AgentData(scores[order], labels[order].astype(np.int64))


class GaussianExperiment:
    """The simulated experiment of paper Section 5 ("Simulated Data Experiment", Fig. 1).

    Three labels, ``X | Y = y ~ N(theta_y, I_2)`` with ``theta = [-1, 0], [1, 0], [1, 3]``; two
    agents with ``P_Y^1 = (0.8, 0.1, 0.1)``, ``P_Y^2 = (0.1, 0.1, 0.8)`` and ``(N^1, N^2) =
    (1000, 50)``; inference for agent 2. The classifier is "the Bayes classifier" with the
    pooled calibration prior ``P_Y^cal`` (spec A13: with a uniform prior the per-label score
    distributions nearly coincide and no label-shift effect is visible). Each trial draws fresh
    calibration data and ``test_size`` test points from the target's distribution (spec A18).
    """

    name = "gaussians"
    theta = np.array([[-1.0, 0.0], [1.0, 0.0], [1.0, 3.0]])
    default_target = 1  # agent 2, 0-based

    def __init__(self, seed: int, test_size: int = 1000, bayes_prior: str = "pooled"):
        self.seed = seed
        self.test_size = test_size
        self.priors = np.array([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]])
        self.sizes = np.array([1000, 50], dtype=np.int64)
        self.n_agents, self.n_classes = self.priors.shape
        prior = {
            "pooled": calibration_prior(self.priors, self.sizes),
            "uniform": np.full(3, 1 / 3),
            "target": self.priors[self.default_target],
        }[bayes_prior]
        self.log_prior = np.log(prior)

    def _probs(self, x: np.ndarray) -> np.ndarray:
        d2 = ((x[:, None, :] - self.theta[None, :, :]) ** 2).sum(axis=2)
        return softmax(self.log_prior - d2 / 2)

    def _draw(self, rng: np.random.Generator, prior: np.ndarray, m: int):
        y = rng.choice(self.n_classes, size=m, p=prior)
        x = self.theta[y] + rng.standard_normal((m, 2))
        return self._probs(x), y, rng.random(m)

    def agent_data(self, trial: int, agent: int) -> AgentData:
        probs, y, u = self._draw(_rng(self.seed, trial, agent, _DATA), self.priors[agent], int(self.sizes[agent]))
        return _sorted_agent(aps_scores(probs, y, u), y)

    def test_data(self, trial: int, target: int) -> EvalData:
        probs, y, u = self._draw(_rng(self.seed, trial, _SERVER, _TEST, target), self.priors[target], self.test_size)
        return EvalData(aps_scores(probs, None, u), y, np.full(self.test_size, 1.0 / self.test_size))


def load_logits_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read ``logits`` (N, C) and ``labels`` (N,) from an ``.npz``; ConfigError if malformed."""
    if not os.path.isfile(path):
        raise ConfigError("--logits", f"no such file: {path}")
    try:
        with np.load(path) as f:
            if "logits" not in f or "labels" not in f:
                raise ConfigError(
                    "--logits", f"{path} must contain arrays 'logits' (N, C) and 'labels' (N,); has {sorted(f.files)}"
                )
            logits, labels = np.asarray(f["logits"]), np.asarray(f["labels"])
    except (OSError, ValueError) as e:
        raise ConfigError("--logits", f"cannot read {path} as .npz: {e}") from None
    if logits.ndim != 2 or labels.ndim != 1 or logits.shape[0] != labels.shape[0]:
        raise ConfigError("--logits", f"need logits (N, C) and labels (N,), got {logits.shape} and {labels.shape}")
    if labels.dtype.kind not in "iu" or labels.size == 0 or labels.min() < 0 or labels.max() >= logits.shape[1]:
        raise ConfigError("--logits", f"labels must be integers in [0, {logits.shape[1]})")
    if not np.all(np.isfinite(logits)):
        raise ConfigError("--logits", "logits contain NaN or inf")
    return logits.astype(np.float64), labels.astype(np.int64)


class LogitsExperiment:
    """The CIFAR-10 protocol of paper Section 5 on any classifier's test logits.

    Every trial splits the labelled set into calibration and test halves (stratified by class, so
    each half has every class); ``n = C`` agents with ``P_Y^i(i) = 0.55`` and ``0.45 / (C - 1)``
    elsewhere (``0.05`` for ten classes); ``N^i = 350`` except ``N^2 = 2150`` and the target
    ``N^4 = 50`` (1-based, spec A15; 5000 in all for ten classes). Agents draw their points
    i.i.d.: label from ``P_Y^i``, then a uniform calibration example of that class, with
    replacement (the demanded class counts exceed the half's, spec A16). Coverage and set size
    are label-reweighted to the target's prior on the test half (spec Section 4).
    """

    name = "logits"
    default_target = 3  # agent 4, 0-based

    def __init__(self, logits: np.ndarray, labels: np.ndarray, seed: int, temperature: float = 1.0):
        c = logits.shape[1]
        if c < 4:
            raise ConfigError("--logits", f"the protocol needs at least 4 classes (agents 2 and 4 are special), got {c}")
        per_class = np.bincount(labels, minlength=c)
        if per_class.min() < 2:
            k = int(per_class.argmin())
            raise ConfigError("--logits", f"every class needs >= 2 examples (one per half); class {k} has {per_class[k]}")
        self.seed = seed
        self.probs = softmax(logits, temperature)
        self.labels = labels
        self.n_agents = self.n_classes = c
        self.priors = np.full((c, c), 0.45 / (c - 1))
        np.fill_diagonal(self.priors, 0.55)
        self.sizes = np.full(c, 350, dtype=np.int64)
        self.sizes[1], self.sizes[3] = 2150, 50
        self.by_class = [np.flatnonzero(labels == k) for k in range(c)]
        self._split_cache: tuple[int, list[np.ndarray], np.ndarray] | None = None

    def _split(self, trial: int) -> tuple[list[np.ndarray], np.ndarray]:
        if self._split_cache is None or self._split_cache[0] != trial:
            rng = _rng(self.seed, trial, _SERVER, _SPLIT)
            cal, test = [], []
            for idx in self.by_class:
                perm = rng.permutation(idx)
                half = perm.size // 2
                cal.append(perm[:half])
                test.append(perm[half:])
            self._split_cache = (trial, cal, np.sort(np.concatenate(test)))
        return self._split_cache[1], self._split_cache[2]

    def agent_data(self, trial: int, agent: int) -> AgentData:
        cal, _ = self._split(trial)
        rng = _rng(self.seed, trial, agent, _DATA)
        m = int(self.sizes[agent])
        y = rng.choice(self.n_classes, size=m, p=self.priors[agent])
        idx = np.empty(m, dtype=np.int64)
        for k in range(self.n_classes):
            at = np.flatnonzero(y == k)
            idx[at] = cal[k][rng.integers(0, cal[k].size, size=at.size)]
        return _sorted_agent(aps_scores(self.probs[idx], y, rng.random(m)), y)

    def test_data(self, trial: int, target: int) -> EvalData:
        _, test = self._split(trial)
        y = self.labels[test]
        u = _rng(self.seed, trial, _SERVER, _TEST).random(test.size)
        per_class = np.bincount(y, minlength=self.n_classes)
        weights = self.priors[target][y] / per_class[y]
        return EvalData(aps_scores(self.probs[test], None, u), y, weights)


def logits_from_run(run_h5: str, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Test-set logits of the model saved by a fedring training run (``/model/final``).

    Rebuilds the model with :func:`fedring.train.models.make_model` from the run's ``config``
    attribute (``model``, ``seed``), loads the flat float32 parameters and evaluates the test set
    of the run's data set with :mod:`fedring.train.data`'s preprocessing (pixels / 255): the
    Fashion-MNIST IDX files (``data_dir``, else the run's ``data_dir``, ``$FEDRING_DATA`` or
    Debian's path), or the synthetic set.
    """
    import h5py

    if not os.path.isfile(run_h5):
        raise ConfigError("--model-from", f"no such file: {run_h5}")
    try:
        with h5py.File(run_h5, "r") as f:
            if "model/final" not in f:
                raise ConfigError("--model-from", f"{run_h5} has no /model/final (did the training run finish?)")
            flat = np.asarray(f["model/final"], dtype=np.float32)
            config = json.loads(f.attrs.get("config", "{}"))
    except OSError as e:
        raise ConfigError("--model-from", f"cannot read {run_h5} as HDF5: {e}") from None
    import torch

    from fedring.train import data, models

    model = models.make_model(config.get("model", "cnn"), int(config.get("seed", 0)))
    if flat.size != models.n_parameters(model):
        need = models.n_parameters(model)
        raise ConfigError("--model-from", f"/model/final has {flat.size} values, model {config.get('model', 'cnn')!r} needs {need}")
    models.load_flat(model, flat)
    if config.get("dataset", "fashion-mnist") == "synthetic":
        test = data.synthetic_set(int(config.get("seed", 0)))[1]
        images, labels = test.x, test.y
    else:
        root = data.fmnist_dir(data_dir or config.get("data_dir"))
        images = (data.read_idx(root / data.FMNIST_FILES["test_images"]).astype(np.float32) / 255.0)[:, None]
        labels = data.read_idx(root / data.FMNIST_FILES["test_labels"]).astype(np.int64)
    model.eval()
    with torch.no_grad():
        logits = np.concatenate(
            [model(torch.from_numpy(images[k : k + 1000])).numpy() for k in range(0, len(images), 1000)]
        )
    return logits.astype(np.float64), labels


# ---------------------------------------------------------------------------------------------
# Federated run over MPI (Algorithm 2 with the spec's message flow, Section 2.6)
# ---------------------------------------------------------------------------------------------

METHODS = ("unweighted-local", "unweighted-global", "oracle", "weighted", "nonprivate", "dp")

# The paper gives no numbers (its results are plots); these are its claims about each curve.
PAPER_CLAIMS = {
    "gaussians": {
        "unweighted-local": "too little data: unstable sets (Fig. 1b)",
        "unweighted-global": "driven by agent 1's scores: miscalibrated (Fig. 1b)",
        "oracle": "reference, ~ DP-FedCP (Fig. 1b)",
        "nonprivate": "close to oracle weights (Fig. 1b)",
    },
    "logits": {
        "unweighted-local": "significantly worse than DP-FedCP (Fig. 2)",
        "unweighted-global": "significantly worse than DP-FedCP (Fig. 2)",
        "nonprivate": "valid coverage (Fig. 2)",
    },
}
PAPER_DP_CLAIM = "robustness decreases as sigma_g grows (Fig. 3b, ImageNet)"

# Spec Section 5.3 prototype (NOT paper values): 200 runs, T=1000, K=10, gamma=0.01, eta=1e-3.
SPEC_PROTOTYPE_GAUSSIANS = {
    "unweighted-local": (0.9040, 0.0431, 1.320),
    "unweighted-global": (0.8755, 0.0142, 1.208),
    "oracle": (0.9043, 0.0218, 1.288),
    "weighted": (0.9058, 0.0308, 1.295),
    "nonprivate": (0.8990, 0.0276, 1.270),
}


@dataclass
class Config:
    """Resolved settings of one ``conformal labelshift`` run (stored as the root ``config`` attr)."""

    experiment: str = "gaussians"
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    logits: str | None = None
    model_from: str | None = None
    trials: int = 100
    seed: int = 0
    alpha: float = 0.1
    epsilon: list[float] = field(default_factory=list)
    sigma_g: list[float] = field(default_factory=list)
    delta: float = 1e-5
    count_noise: float = 0.0
    rounds: int = 1000
    local_steps: int = 10
    gamma: float = 0.01
    eta: float | None = None
    q0: float | None = None
    participants: int | None = None
    targets: list[int] | None = None  # 0-based
    temperature: float = 1.0
    test_size: int = 1000
    bayes_prior: str = "pooled"
    shared_subsample: bool = False
    trial_batch: int = 20
    out: str | None = None
    overwrite: bool = False
    save_logits: str | None = None

    def validate(self) -> "Config":
        """Raise ``ConfigError`` naming the first bad setting (as its command-line flag); return self."""
        check_alpha(self.alpha, "--alpha")
        finite = all(math.isfinite(x) for x in [*self.epsilon, *self.sigma_g, self.count_noise, self.gamma])
        for key, ok, allowed in [
            ("--trials", self.trials >= 1, ">= 1"),
            ("--seed", self.seed >= 0, ">= 0"),
            ("--rounds", self.rounds >= 1, ">= 1"),
            ("--local-steps", self.local_steps >= 1, ">= 1"),
            ("--gamma", 0 < self.gamma <= 1, "in (0, 1] (Theorem 4.1)"),
            ("--eta", self.eta is None or self.eta > 0, "> 0"),
            ("--delta", 0 < self.delta < 1, "in (0, 1)"),
            ("--count-noise", self.count_noise >= 0, ">= 0"),
            ("--epsilon", all(e > 0 for e in self.epsilon) and finite, "finite and > 0"),
            ("--sigma-g", all(x >= 0 for x in self.sigma_g) and finite, "finite and >= 0"),
            ("--temperature", self.temperature > 0, "> 0"),
            ("--test-size", self.test_size >= 1, ">= 1"),
            ("--trial-batch", self.trial_batch >= 1, ">= 1"),
            ("--participants", self.participants is None or self.participants >= 1, ">= 1"),
            ("--method", set(self.methods) <= set(METHODS) and bool(self.methods), f"among {', '.join(METHODS)}"),
        ]:
            if not ok:
                raise ConfigError(key, f"must be {allowed}, got {getattr(self, key[2:].replace('-', '_'))}")
        return self

    def dp_variants(self) -> list[tuple[str, str, float]]:
        """``(method name, 'epsilon' | 'sigma', value)`` for every DP setting asked for.

        Without ``epsilon`` or ``sigma_g``, ``dp`` runs with ``sigma_g = 10``, the smallest noise
        of the paper's DP experiment (Fig. 3b).
        """
        if "dp" not in self.methods:
            return []
        out = [(f"dp-eps={e:g}", "epsilon", e) for e in self.epsilon]
        out += [(f"dp-sigma={s:g}", "sigma", s) for s in self.sigma_g]
        return out or [("dp-sigma=10", "sigma", 10.0)]


def _batches(trials: int, size: int):
    for start in range(0, trials, size):
        yield list(range(start, min(trials, start + size)))


class _Run:
    """One rank's share of Algorithm 2 (with Algorithm 1) and of the centralised baselines.

    Message flow (spec Section 2.6; scores stay on their agent, spec A6): agents send their label
    counts (noisy when ``count_noise > 0``); the server broadcasts the weights of eq. (10) and the
    multinomial subsample sizes; agents send the weight sums ``D_i`` of their subsets; the server
    forms ``lambda`` (eq. 14); then the rounds of Algorithm 1. The calibration sizes ``N^i`` are
    public (the server needs them for the multinomial). All trials of a batch, all targets and
    all DP variants run as columns of one lock-step Algorithm 1.
    """

    def __init__(self, cfg: Config, sizes: np.ndarray, n_classes: int, net):
        self.cfg, self.net, self.lay = cfg, net, net.layout
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.n, self.c = self.sizes.size, n_classes
        self.n_total = int(self.sizes.sum())
        self.targets = cfg.targets
        self.server = self.lay.rank == 0
        self.local_clients = list(self.lay.local_clients)
        # Algorithm-1 variants: (name, weight source, "sigma" | "epsilon", value); source 1 = noisy counts.
        noisy = 1 if cfg.count_noise > 0 else 0
        self.fed = [("nonprivate", 0, "sigma", 0.0)] if "nonprivate" in cfg.methods else []
        self.fed += [(name, noisy, kind, val) for name, kind, val in cfg.dp_variants()]
        self.sources = sorted({f[1] for f in self.fed} | ({0} if "weighted" in cfg.methods else set()))
        self.participants = cfg.participants or self.n
        self.eta = cfg.eta if cfg.eta is not None else cfg.gamma / 10
        self.q0 = cfg.q0 if cfg.q0 is not None else 1 - cfg.alpha

    # -- Algorithm 2 ---------------------------------------------------------------------------
    def calibrate(self, trials: list[int], local: dict) -> dict:
        """Weights, subsets and federated thresholds for ``trials``; ``local[i][b]`` is agent ``i``'s data.

        Every rank gets ``w_hat`` ({source: (B, targets, C)}) and its agents' ``selected`` masks;
        the server also ``lam`` ({source: (n, B, targets, C)}) and, per variant of Algorithm 1,
        ``fed_q``, ``fed_sigma``, ``fed_eps``, ``fed_lam_max`` (each ``(V, B, targets, C)``).
        """
        out: dict = {"w_hat": {}, "selected": None, "lam": {}}
        if not self.sources:
            return out
        out["w_hat"] = self._weights(trials, local)
        out["selected"] = self._subsets(trials, local)
        out["lam"] = self._mixture_weights(trials, local, out["w_hat"], out["selected"])
        if self.fed:
            out.update(self._federated_quantiles(trials, local, out["w_hat"], out["selected"], out["lam"]))
        return out

    def _weights(self, trials, local) -> dict:
        """Agents release label counts ``M^i_y := N^i_y`` (spec A9); the server applies eq. (10)."""
        cfg, net, c, b = self.cfg, self.net, self.c, len(trials)
        counts = np.zeros((len(self.local_clients), len(self.sources), b, c), dtype=np.int64)
        for a, i in enumerate(self.local_clients):
            for bi, t in enumerate(trials):
                exact = label_counts(local[i][bi].labels, c)
                noisy = privatise_counts(exact, cfg.count_noise, _rng(cfg.seed, t, i, _COUNT_NOISE))
                counts[a, :, bi] = [exact if src == 0 else noisy for src in self.sources]
        gathered = net.gather_to_server(counts.reshape(counts.shape[0], -1), "labelshift/counts")
        w = None
        if self.server:
            g = gathered.reshape(self.n, len(self.sources), b, c)
            w = np.array(
                [
                    [[mle_weights(g[:, si, bi], star) for star in self.targets] for bi in range(b)]
                    for si in range(len(self.sources))
                ]
            )
        w = net.broadcast_from_server(w, "labelshift/weights", (len(self.sources), b, len(self.targets), c), np.float64)
        return {src: w[si] for si, src in enumerate(self.sources)}

    def _subsets(self, trials, local) -> dict:
        """Server draws ``Nbar^i`` per trial and query label (eq. 5, spec A7); agents pick ``J_i``."""
        cfg, net, c, b = self.cfg, self.net, self.c, len(trials)
        nbar = None
        if self.server:
            per_trial = 1 if cfg.shared_subsample else c
            draws = [subsample_sizes(self.sizes, _rng(cfg.seed, t, _SERVER, _MULTINOMIAL), per_trial) for t in trials]
            nbar = np.array([np.repeat(d, c, axis=0) if cfg.shared_subsample else d for d in draws])
        nbar = net.broadcast_from_server(nbar, "labelshift/subsample", (b, c, self.n), np.int64)
        selected = {}
        for i in self.local_clients:
            selected[i] = []
            for bi, t in enumerate(trials):
                rng = _rng(cfg.seed, t, i, _SUBSET)
                ni = local[i][bi].scores.size
                if cfg.shared_subsample:
                    masks = np.repeat(select_subset(ni, nbar[bi, 0, i], rng)[None], c, axis=0)
                else:
                    masks = np.array([select_subset(ni, nbar[bi, y, i], rng) for y in range(c)]).reshape(c, ni)
                selected[i].append(masks)
        return selected

    def _mixture_weights(self, trials, local, w_hat, selected) -> dict:
        """Agents send ``D_i = sum_{k in J_i} w_hat[Y_k]``; the server forms ``lambda`` (eq. 14)."""
        b, n_tg = len(trials), len(self.targets)
        sums = np.zeros((len(self.local_clients), len(self.sources), b, n_tg, self.c))
        for a, i in enumerate(self.local_clients):
            for bi in range(b):
                lab, sel = local[i][bi].labels, selected[i][bi].astype(np.float64)
                for si, src in enumerate(self.sources):
                    sums[a, si, bi] = w_hat[src][bi][:, lab] @ sel.T  # (targets, query labels)
        gathered = self.net.gather_to_server(sums.reshape(sums.shape[0], -1), "labelshift/weight-sums")
        if not self.server:
            return {}
        g = gathered.reshape(self.n, len(self.sources), b, n_tg, self.c)
        return {src: query_decomposition(w_hat[src], self.sizes, g[:, si])[2] for si, src in enumerate(self.sources)}

    def _noise_scales(self, lam_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per instance: ``sigma_g`` and the epsilon Theorem 4.4 certifies (server side)."""
        cfg = self.cfg
        lam_max = lam_all.max(axis=0)
        sigma, eps = np.zeros(lam_max.shape), np.zeros(lam_max.shape)
        args = (cfg.delta, cfg.rounds, cfg.local_steps, self.participants, self.n)
        for vi, (_, _, kind, val) in enumerate(self.fed):
            for idx in np.ndindex(*lam_max.shape[1:]):
                lm = float(lam_max[(vi, *idx)])
                if kind == "epsilon":
                    sigma[(vi, *idx)] = sigma_g_min(val, *args, lm) if lm > 0 else 0.0
                    eps[(vi, *idx)] = val if lm > 0 else 0.0
                else:
                    sigma[(vi, *idx)] = val
                    eps[(vi, *idx)] = epsilon_for_sigma(val, *args, lm)
        return sigma, eps

    def _federated_quantiles(self, trials, local, w_hat, selected, lam) -> dict:
        """Algorithm 1 for every variant, trial, target and query label in one lock-step run."""
        cfg, net = self.cfg, self.net
        c, n_tg, b, v = self.c, len(self.targets), len(trials), len(self.fed)
        shape = (v, b, n_tg, c)
        n_q = int(np.prod(shape))
        lam_all = sigma = eps = None
        if self.server:
            lam_all = np.stack([lam[src] for _, src, _, _ in self.fed], axis=1)  # (n, V, B, targets, C)
            sigma, eps = self._noise_scales(lam_all)
        sigma = net.broadcast_from_server(sigma, "labelshift/noise-scale", shape, np.float64)

        values, weights = [], []
        for i in self.local_clients:
            for _, src, _, _ in self.fed:
                for bi in range(b):
                    d = local[i][bi]
                    for s in range(n_tg):
                        for y in range(c):
                            vals, wts, mass = local_measure(
                                d.scores, d.labels, selected[i][bi][y], w_hat[src][bi, s], y,
                                int(self.sizes[i]), self.n_total,
                            )
                            values.append(vals)
                            weights.append(wts / mass if mass > 0 else np.zeros_like(wts))
        rows = AtomRows(values, weights, cfg.alpha, cfg.gamma)

        sig = sigma.reshape(-1)
        noise = None
        if np.any(sig > 0):
            jobs = [(vi, t, s) for vi in range(v) for t in trials for s in range(n_tg)]
            gens = [
                [_rng(cfg.seed, t, i, _GRAD_NOISE, self.targets[s], vi) for vi, t, s in jobs] for i in self.local_clients
            ]
            chunk, buf = 50, {}

            def noise(t: int) -> np.ndarray:
                start = t - t % chunk
                if start not in buf:
                    buf.clear()
                    m = min(chunk, cfg.rounds - start)
                    buf[start] = np.array([[g.standard_normal((m, cfg.local_steps, c)) for g in row] for row in gens])
                z = buf[start][:, :, t - start]  # (A, jobs, K, C)
                return z.transpose(2, 0, 1, 3).reshape(cfg.local_steps, len(gens), n_q) * sig

        participation = None
        if self.participants < self.n and self.server:
            jobs = [(vi, t, s) for vi in range(v) for t in trials for s in range(n_tg)]
            part = [_rng(cfg.seed, t, _SERVER, _PARTICIPATION, self.targets[s], vi) for vi, t, s in jobs]

            def participation(t: int) -> np.ndarray:
                mask = np.zeros((self.n, len(part)), dtype=bool)
                for j, g in enumerate(part):
                    mask[g.choice(self.n, size=self.participants, replace=False), j] = True
                return np.repeat(mask, c, axis=1)

        q_hat = dp_fedavgqe(
            rows,
            lam_all.reshape(self.n, n_q) if self.server else None,
            q0=np.full(n_q, self.q0),
            rounds=cfg.rounds,
            local_steps=cfg.local_steps,
            eta=self.eta,
            noise=noise,
            participation=participation,
            net=net,
        )
        res = {"fed_q": q_hat.reshape(shape)}
        if self.server:
            res.update(fed_sigma=sigma, fed_eps=eps, fed_lam_max=lam_all.max(axis=0))
        return res

    # -- centralised baselines -----------------------------------------------------------------
    def centralised(self, trials: list[int], local: dict, cal: dict, priors: np.ndarray | None) -> dict | None:
        """Thresholds that need every score on the server: the baselines, by their definition.

        Returns on the server ``{method: (B, targets, C)}`` for unweighted-local, unweighted-global,
        oracle (if ``priors`` is given) and weighted (eq. 8, exact), plus ``exact``: the exact
        ``Q_{1-alpha}(mu_y)`` each federated variant approximates. Traffic goes to the
        ``baseline/scores`` ledger phase, apart from the protocol's.
        """
        cfg, net, c, b = self.cfg, self.net, self.c, len(trials)
        width = max(int(self.sizes.max()), 1)
        a_n = len(self.local_clients)
        sc = np.full((a_n, b, width), np.nan)
        lb = np.full((a_n, b, width), -1, dtype=np.int64)
        sel = np.zeros((a_n, b, c, width), dtype=np.uint8)
        for a, i in enumerate(self.local_clients):
            for bi in range(b):
                d = local[i][bi]
                sc[a, bi, : d.scores.size] = d.scores
                lb[a, bi, : d.scores.size] = d.labels
                if cal["selected"] is not None:
                    sel[a, bi, :, : d.scores.size] = cal["selected"][i][bi]
        g_sc = net.gather_to_server(sc.reshape(a_n, -1), "baseline/scores")
        g_lb = net.gather_to_server(lb.reshape(a_n, -1), "baseline/scores")
        g_sel = net.gather_to_server(sel.reshape(a_n, -1), "baseline/scores")
        if not self.server:
            return None
        g_sc, g_lb = g_sc.reshape(self.n, b, width), g_lb.reshape(self.n, b, width)
        g_sel = g_sel.reshape(self.n, b, c, width).astype(bool)
        ms, n_tg = cfg.methods, len(self.targets)
        wanted = ["unweighted-local", "unweighted-global"] + (["oracle"] if priors is not None else []) + ["weighted"]
        out = {m: np.zeros((b, n_tg, c)) for m in wanted if m in ms}
        exact_by_src = {src: np.zeros((b, n_tg, c)) for src in self.sources}
        for bi in range(b):
            ok = g_lb[:, bi] >= 0
            all_sc, all_lb = g_sc[:, bi][ok], g_lb[:, bi][ok]
            for s, star in enumerate(self.targets):
                if "unweighted-local" in out:
                    out["unweighted-local"][bi, s] = unweighted_threshold(g_sc[star, bi][ok[star]], cfg.alpha)
                if "unweighted-global" in out:
                    out["unweighted-global"][bi, s] = unweighted_threshold(all_sc, cfg.alpha)
                if "oracle" in out:
                    w_star = oracle_weights(priors, self.sizes, star)
                    out["oracle"][bi, s] = label_shift_thresholds(all_sc, all_lb, w_star, cfg.alpha)
                for src in self.sources:
                    for y in range(c):
                        pick = ok & g_sel[:, bi, y]
                        exact_by_src[src][bi, s, y] = label_shift_thresholds(
                            g_sc[:, bi][pick], g_lb[:, bi][pick], cal["w_hat"][src][bi, s], cfg.alpha
                        )[y]
        if "weighted" in out:
            out["weighted"] = exact_by_src[0]
        out_exact = {name: exact_by_src[src] for name, src, _, _ in self.fed}
        return {"thresholds": out, "exact": out_exact}


def _evaluate(exp, trials: list[int], targets: list[int], thresholds: dict) -> tuple[dict, dict]:
    """Coverage and mean set size of each method on the target's test distribution (server)."""
    cov = {m: np.zeros((len(trials), len(targets))) for m in thresholds}
    size = {m: np.zeros((len(trials), len(targets))) for m in thresholds}
    for bi, t in enumerate(trials):
        for s, star in enumerate(targets):
            td = exp.test_data(t, star)
            for m, q in thresholds.items():
                inside = td.scores <= q[bi, s][None, :]
                cov[m][bi, s] = float(td.weights @ inside[np.arange(td.labels.size), td.labels])
                size[m][bi, s] = float(td.weights @ inside.sum(axis=1))
    return cov, size


def _run_batch(job: _Run, exp, trials: list[int]) -> dict | None:
    """Generate the agents' data on their ranks, calibrate, evaluate on the server."""
    local = {i: [exp.agent_data(t, i) for t in trials] for i in job.local_clients}
    cal = job.calibrate(trials, local)
    base = job.centralised(trials, local, cal, exp.priors)
    if not job.server:
        return None
    thresholds = dict(base["thresholds"])
    for vi, (name, _, _, _) in enumerate(job.fed):
        thresholds[name] = cal["fed_q"][vi]
    cov, size = _evaluate(exp, trials, job.targets, thresholds)
    fed = {k: v for k, v in cal.items() if k.startswith("fed_")}
    return {"thresholds": thresholds, "exact": base["exact"], "coverage": cov, "set_size": size, **fed}


def dp_fedcp_thresholds(
    scores: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    star: int,
    n_classes: int,
    *,
    alpha: float = 0.1,
    sigma_g: float = 0.0,
    epsilon: float | None = None,
    delta: float = 1e-5,
    count_noise: float = 0.0,
    rounds: int = 1000,
    local_steps: int = 10,
    gamma: float = 0.01,
    eta: float | None = None,
    q0: float | None = None,
    participants: int | None = None,
    shared_subsample: bool = False,
    seed: int = 0,
) -> dict:
    """DP-FedCP (Algorithm 2) on given calibration scores, all agents in this process.

    Parameters
    ----------
    scores, labels : one array per agent
        Agent ``i``'s calibration scores in [0, 1] (e.g. :func:`aps_scores`) and labels in
        ``[0, n_classes)``. Agents may be empty, except the target.
    star : int
        Target agent (0-based).
    sigma_g / epsilon
        Gradient noise of Algorithm 1, or the per-query epsilon from which Theorem 4.4 sets it.
    count_noise : float
        Discrete-Gaussian std on the released label counts (Algorithm 2).
    rounds, local_steps, gamma, eta, q0, participants, shared_subsample
        As the command-line flags (spec Section 2.8 defaults).

    Returns
    -------
    dict with ``threshold`` (C,): ``Qhat^gamma_{1-alpha,T}(mu_y)`` (predict with
    :func:`predict_sets`); ``exact_threshold`` (C,): ``Q_{1-alpha}(mu_y)`` of eq. (8) with the same
    weights and subsample; ``weights`` (C,): ``w_hat`` of eq. (10); ``lam`` (n, C); ``sigma_g`` (C,)
    and ``epsilon`` (C,): noise used and the epsilon per query Theorem 4.4 gives for ``delta``.
    """
    n = len(scores)
    if len(labels) != n or n == 0:
        raise ConfigError("scores", "need one scores array and one labels array per agent, at least one agent")
    if not 0 <= star < n:
        raise ConfigError("star", f"must be an agent index in [0, {n}), got {star}")
    local = {}
    for i in range(n):
        s, lab = np.asarray(scores[i], np.float64).reshape(-1), np.asarray(labels[i]).reshape(-1)
        if s.shape != lab.shape:
            raise ConfigError("labels", f"agent {i}: {s.size} scores but {lab.size} labels")
        if s.size and (np.isnan(s).any() or s.min() < 0 or s.max() > 1):
            raise ConfigError("scores", f"agent {i}: scores must lie in [0, 1] (the test atom sits at 1)")
        if lab.size and (lab.dtype.kind not in "iu" or lab.min() < 0 or lab.max() >= n_classes):
            raise ConfigError("labels", f"agent {i}: labels must be integers in [0, {n_classes})")
        local[i] = [_sorted_agent(s, lab.astype(np.int64))]
    if local[star][0].scores.size == 0:
        raise ConfigError("star", f"target agent {star} has no calibration data: its label prior cannot be estimated")
    cfg = Config(
        methods=["weighted", "dp"], alpha=alpha, epsilon=[epsilon] if epsilon is not None else [],
        sigma_g=[] if epsilon is not None else [sigma_g], delta=delta, count_noise=count_noise, rounds=rounds,
        local_steps=local_steps, gamma=gamma, eta=eta, q0=q0, participants=participants, targets=[star],
        shared_subsample=shared_subsample, seed=seed,
    ).validate()
    sizes = np.array([local[i][0].scores.size for i in range(n)])
    job = _Run(cfg, sizes, n_classes, _InProcess(n))
    cal = job.calibrate([0], local)
    base = job.centralised([0], local, cal, None)
    name, src = job.fed[0][0], job.fed[0][1]
    return {
        "threshold": cal["fed_q"][0, 0, 0],
        "exact_threshold": base["exact"][name][0, 0],
        "weights": cal["w_hat"][src][0, 0],
        "lam": cal["lam"][src][:, 0, 0],
        "sigma_g": cal["fed_sigma"][0, 0, 0],
        "epsilon": cal["fed_eps"][0, 0, 0],
    }


def predict_sets(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Prediction sets ``{y : V(x, y) <= Q_y}`` as a boolean ``(m, C)`` mask (eq. 8 / Algorithm 2 output).

    >>> predict_sets(np.array([[0.1, 0.95], [0.5, 0.2]]), np.array([0.4, 0.9])).tolist()
    [[True, False], [False, True]]
    """
    return np.asarray(scores) <= np.asarray(thresholds)[None, :]


# ---------------------------------------------------------------------------------------------
# Results file, table, command line
# ---------------------------------------------------------------------------------------------

CLIENT_PHASES = ("labelshift/counts", "labelshift/weight-sums", "labelshift/fedavgqe", "baseline/scores")


class _Writer:
    """``/calibration/`` in the run's HDF5 file (rank 0): one row per trial, flushed per trial."""

    def __init__(self, path: str, cfg: Config, exp, methods: list[str], fed: list):
        import h5py

        self.f = h5py.File(path, "w")
        settings = asdict(cfg)
        settings["targets"] = [t + 1 for t in cfg.targets]  # 1-based, as on the command line
        self.f.attrs["config"] = json.dumps(settings, sort_keys=True)
        self.f.attrs["status"] = "running"
        g = self.f.create_group("calibration")
        g.attrs["method"] = "DP-FedCP (Plassier et al., ICML 2023)"
        g.attrs["experiment"] = exp.name
        g.attrs["targets"] = np.asarray(cfg.targets) + 1
        g.attrs["sizes"] = exp.sizes
        g.attrs["priors"] = exp.priors
        g.attrs["alpha"] = cfg.alpha
        self.g = g
        n_tg, c = len(cfg.targets), exp.n_classes
        self.sets = {"trial": self._make("trial", (), np.int64)}
        for m in methods:
            self.sets[m, "coverage"] = self._make(f"{m}/coverage", (n_tg,))
            self.sets[m, "set_size"] = self._make(f"{m}/set_size", (n_tg,))
            self.sets[m, "threshold"] = self._make(f"{m}/threshold", (n_tg, c))
        for name, src, kind, val in fed:
            for key in ("exact_threshold", "sigma_g", "epsilon", "lambda_max"):
                self.sets[name, key] = self._make(f"{name}/{key}", (n_tg, c))
            sub = g[name]
            sub.attrs["weights"] = "noisy counts" if src else "exact counts"
            sub.attrs["noise_set_by"] = kind
            sub.attrs["value"] = val
            sub.attrs["delta_per_query"] = cfg.delta if kind == "epsilon" or val > 0 else 0.0
            sub.attrs["count_noise"] = cfg.count_noise if src else 0.0
            sub.attrs["count_noise_epsilon"] = count_noise_epsilon(cfg.count_noise, cfg.delta) if src else 0.0
            sub.attrs["privacy_note"] = (
                "epsilon is Theorem 4.4's per run of Algorithm 1 (one query label); a trial runs one per "
                "label: basic composition gives sum over labels of epsilon and |Y| delta. Not covered: "
                "lambda, weight sums, subsample (spec A11)."
            )

    def _make(self, name: str, shape: tuple, dtype=np.float64):
        chunks = (16, *shape) if shape else (256,)
        return self.g.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype, chunks=chunks)

    def append(self, row: dict) -> None:
        for key, value in row.items():
            ds = self.sets[key]
            ds.resize(ds.shape[0] + 1, axis=0)
            ds[-1] = value
        self.f.flush()

    def finish(self, status: str, extra: dict | None = None) -> None:
        if not self.f:
            return
        for k, v in (extra or {}).items():
            self.g.attrs[k] = v
        self.f.attrs["status"] = status
        self.f.close()
        self.f = None


def _summary(values: np.ndarray) -> tuple[float, float, float, float]:
    v = np.asarray(values, dtype=np.float64)
    sd = float(v.std(ddof=1)) if v.size > 1 else 0.0
    return float(v.mean()), sd, float(np.quantile(v, 0.05)), float(np.quantile(v, 0.95))


def _format_table(cfg: Config, exp, results: dict, fed: list, privacy: dict) -> str:
    lines = []
    claims = PAPER_CLAIMS.get(exp.name, {})
    lines.append(
        f"DP-FedCP label shift, experiment={exp.name}, trials={cfg.trials}, alpha={cfg.alpha} "
        f"(target coverage {1 - cfg.alpha:g}); T={cfg.rounds} K={cfg.local_steps} gamma={cfg.gamma:g} "
        f"eta={cfg.eta if cfg.eta is not None else cfg.gamma / 10:g}"
    )
    lines.append("The paper reports no numbers (Figs. 1-3 are plots): its claims are quoted; "
                 "'spec proto' = spec Section 5.3 prototype (200 runs), not a paper value.")
    for s, star in enumerate(cfg.targets):
        lines.append("")
        lines.append(f"target agent {star + 1} (N={int(exp.sizes[star])})")
        head = f"  {'method':<20} {'coverage':>8} {'sd':>7} {'5%':>7} {'95%':>7} {'size':>7}  paper / reference"
        lines.append(head)
        for name, cov in results["coverage"].items():
            mean, sd, q05, q95 = _summary(cov[:, s])
            size = float(np.mean(results["set_size"][name][:, s]))
            note = claims.get(name, "") if star == exp.default_target else ""
            if name.startswith("dp-"):
                p = privacy[name]
                note = f"eps/query<={p['epsilon_per_query']:.3g}, eps/trial<={p['epsilon_composed']:.3g}; {PAPER_DP_CLAIM}"
            if exp.name == "gaussians" and name in SPEC_PROTOTYPE_GAUSSIANS and star == exp.default_target:
                pm, psd, ps = SPEC_PROTOTYPE_GAUSSIANS[name]
                note = (note + "; " if note else "") + f"spec proto {pm:.4f}/{psd:.4f}/{ps:.3f}"
            lines.append(f"  {name:<20} {mean:8.4f} {sd:7.4f} {q05:7.4f} {q95:7.4f} {size:7.3f}  {note}")
    if fed:
        lines.append("")
        for name, src, kind, val in fed:
            gap = results["fed_gap"][name]
            lines.append(f"  {name}: mean over runs of max_y |Qhat_y - Q(mu_y)| = {gap:.4f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fedring conformal labelshift",
        description="DP-FedCP: federated conformal prediction under label shift (Plassier et al., ICML 2023).",
    )
    p.add_argument("--method", nargs="+", default=["all"], choices=[*METHODS, "all"], help="methods to run (default all)")
    p.add_argument("--experiment", choices=["gaussians", "logits"], help="paper Section 5 simulation, or the CIFAR-10 protocol on logits")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--logits", metavar="F.npz", help="arrays 'logits' (N, C) and 'labels' (N,) of a labelled test set")
    src.add_argument("--model-from", metavar="RUN.h5", help="fedring training run: its /model/final CNN on the Fashion-MNIST test set")
    p.add_argument("--save-logits", metavar="F.npz", help="with --model-from: also save the computed logits")
    p.add_argument("--trials", type=int, default=100, help="independent runs (paper: 1000; default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, nargs="+", default=[], help="dp: per-query epsilon targets; sigma_g from Theorem 4.4")
    p.add_argument("--sigma-g", type=float, nargs="+", default=[], help="dp: gradient-noise std values (default 10 if no --epsilon)")
    p.add_argument("--delta", type=float, default=1e-5, help="dp: per-query delta (default 1e-5)")
    p.add_argument("--count-noise", type=float, default=0.0, help="dp: discrete-Gaussian std on label counts (Algorithm 2; default 0)")
    p.add_argument("--rounds", type=int, default=1000, help="Algorithm 1 rounds T (default 1000)")
    p.add_argument("--local-steps", type=int, default=10, help="Algorithm 1 local steps K (default 10)")
    p.add_argument("--gamma", type=float, default=0.01, help="Moreau parameter (default 0.01)")
    p.add_argument("--eta", type=float, help="step size (default gamma/10, the largest Theorem 4.1 allows)")
    p.add_argument("--q0", type=float, help="initial quantile (default 1 - alpha)")
    p.add_argument("--participants", type=int, help="agents sampled per round, S (default all)")
    p.add_argument("--target", nargs="+", default=None, help="target agent(s), 1-based, or 'all' (default: the paper's)")
    p.add_argument("--temperature", type=float, default=1.0, help="logits: softmax temperature (default 1)")
    p.add_argument("--test-size", type=int, default=1000, help="gaussians: test points per trial (default 1000)")
    p.add_argument("--bayes-prior", choices=["pooled", "uniform", "target"], default="pooled", help="gaussians: classifier prior (spec A13)")
    p.add_argument("--shared-subsample", action="store_true", help="one multinomial subsample per trial instead of per query label")
    p.add_argument("--trial-batch", type=int, default=20, help="trials solved together (speed only; results do not depend on it)")
    p.add_argument("--out", metavar="F.h5", help="HDF5 results file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit(2) by itself; report a ConfigError instead
        raise _ArgumentError(message)


def parse_config(argv: Sequence[str]) -> Config:
    """Parse and validate the command line into a :class:`Config` (ConfigError when bad)."""
    try:
        a = _parser().parse_args(list(argv))
    except _ArgumentError as e:
        raise ConfigError("labelshift", str(e)) from None
    methods = list(METHODS) if "all" in a.method else list(dict.fromkeys(a.method))
    experiment = a.experiment or ("logits" if (a.logits or a.model_from) else "gaussians")
    if experiment == "logits" and not (a.logits or a.model_from):
        raise ConfigError("--experiment", "logits needs --logits F.npz or --model-from RUN.h5")
    if experiment == "gaussians" and (a.logits or a.model_from):
        raise ConfigError("--experiment", "gaussians is simulated: drop --logits/--model-from or use --experiment logits")
    if a.save_logits and not a.model_from:
        raise ConfigError("--save-logits", "only with --model-from")
    if (a.epsilon or a.sigma_g or a.count_noise) and "dp" not in methods:
        raise ConfigError("--method", "--epsilon/--sigma-g/--count-noise configure 'dp': add it to --method")
    targets = None
    if a.target is not None:
        if a.target == ["all"]:
            targets = []  # resolved once the number of agents is known
        else:
            try:
                targets = [int(t) - 1 for t in a.target]
            except ValueError:
                raise ConfigError("--target", f"agent numbers (1-based) or 'all', got {a.target}") from None
    cfg = Config(
        experiment=experiment, methods=methods, logits=a.logits, model_from=a.model_from, trials=a.trials,
        seed=a.seed, alpha=a.alpha, epsilon=list(a.epsilon), sigma_g=list(a.sigma_g), delta=a.delta,
        count_noise=a.count_noise, rounds=a.rounds, local_steps=a.local_steps, gamma=a.gamma, eta=a.eta, q0=a.q0,
        participants=a.participants, targets=targets, temperature=a.temperature, test_size=a.test_size,
        bayes_prior=a.bayes_prior, shared_subsample=a.shared_subsample, trial_batch=a.trial_batch, out=a.out,
        overwrite=a.overwrite, save_logits=a.save_logits,
    )
    cfg.validate()
    if cfg.out and os.path.exists(cfg.out) and not cfg.overwrite:
        raise ConfigError("--out", f"{cfg.out} exists: pass --overwrite to replace it")
    return cfg


def _make_experiment(cfg: Config, comm):
    if cfg.experiment == "gaussians":
        return GaussianExperiment(cfg.seed, cfg.test_size, cfg.bayes_prior)
    if cfg.logits:
        logits, labels = load_logits_npz(cfg.logits)
    else:
        # One rank evaluates the CNN; the others wait for the result (or for its error).
        err, shape = None, None
        if comm.rank == 0:
            try:
                logits, labels = logits_from_run(cfg.model_from)
                shape = logits.shape
                if cfg.save_logits:
                    np.savez(cfg.save_logits, logits=logits.astype(np.float32), labels=labels)
            except ConfigError as e:
                err = (e.key, e.message)
        err, shape = comm.bcast((err, shape), root=0)
        if err is not None:
            raise ConfigError(*err)
        if comm.rank != 0:
            logits, labels = np.empty(shape), np.empty(shape[0], dtype=np.int64)
        logits = np.ascontiguousarray(logits, dtype=np.float64)
        comm.Bcast(logits, root=0)
        comm.Bcast(labels, root=0)
    return LogitsExperiment(logits, labels, cfg.seed, cfg.temperature)


def _resolve(cfg: Config, exp, size: int = 1) -> None:
    """Validate, and resolve the settings that depend on the experiment (number of agents) and
    the number of MPI ranks."""
    cfg.validate()
    n = exp.n_agents
    if n < size:
        raise ConfigError("ranks", f"the {exp.name} experiment has {n} agents and each MPI rank hosts at least one: "
                          f"run it on at most {n} ranks, got {size}")
    if cfg.targets is None:
        cfg.targets = [exp.default_target]
    elif cfg.targets == []:
        cfg.targets = list(range(n))
    bad = [t + 1 for t in cfg.targets if not 0 <= t < n]
    if bad:
        raise ConfigError("--target", f"agents are numbered 1..{n}, got {bad}")
    if cfg.participants is not None and cfg.participants > n:
        raise ConfigError("--participants", f"must be in [1, {n}] ({n} agents), got {cfg.participants}")
    s = cfg.participants or n
    for e in cfg.epsilon:
        sigma_g_min(e, cfg.delta, cfg.rounds, cfg.local_steps, s, n, 1.0)  # raises on a bad (eps, delta)


def run(cfg: Config, exp, comm=None, log=None, guard=None) -> dict | None:
    """Run all trials over MPI (agents hosted by ranks); returns the results on rank 0."""
    from mpi4py import MPI

    from fedring.comm import Layout, Network

    comm = MPI.COMM_WORLD if comm is None else comm
    _resolve(cfg, exp, comm.size)
    net = Network(Layout(exp.n_agents, comm))
    job = _Run(cfg, exp.sizes, exp.n_classes, net)
    server = comm.rank == 0
    methods = [m for m in ("unweighted-local", "unweighted-global", "oracle", "weighted") if m in cfg.methods]
    methods += [f[0] for f in job.fed]
    writer = _Writer(cfg.out, cfg, exp, methods, job.fed) if (server and cfg.out) else None
    if writer and guard is not None:
        guard.on_abort.append(writer.finish)
    collected: dict = {"coverage": {m: [] for m in methods}, "set_size": {m: [] for m in methods},
                       "gap": {f[0]: [] for f in job.fed}, "eps": {f[0]: [] for f in job.fed}}
    status = "failed"
    t0 = time.perf_counter()
    try:
        for trials in _batches(cfg.trials, cfg.trial_batch):
            res = _run_batch(job, exp, trials)
            if not server:
                continue
            for bi, t in enumerate(trials):
                row: dict = {"trial": t}
                for m in methods:
                    collected["coverage"][m].append(res["coverage"][m][bi])
                    collected["set_size"][m].append(res["set_size"][m][bi])
                    row[m, "coverage"] = res["coverage"][m][bi]
                    row[m, "set_size"] = res["set_size"][m][bi]
                    row[m, "threshold"] = res["thresholds"][m][bi]
                for vi, (name, _, _, _) in enumerate(job.fed):
                    ex = res["exact"][name][bi]
                    collected["gap"][name].append(np.abs(res["fed_q"][vi, bi] - ex).max(axis=-1))
                    collected["eps"][name].append(res["fed_eps"][vi, bi])
                    row[name, "exact_threshold"] = ex
                    row[name, "sigma_g"] = res["fed_sigma"][vi, bi]
                    row[name, "epsilon"] = res["fed_eps"][vi, bi]
                    row[name, "lambda_max"] = res["fed_lam_max"][vi, bi]
                if writer:
                    writer.append(row)
            if log:
                log(f"trials {trials[-1] + 1}/{cfg.trials} done, {time.perf_counter() - t0:.1f} s")
        status = "complete"
    finally:
        phase_bytes = {}
        for phase in CLIENT_PHASES:
            local = np.zeros(exp.n_agents, np.int64)
            if phase in net.ledger.clients:
                local += net.ledger.clients[phase]
            total = np.zeros_like(local) if server else None
            net.comm.Reduce(local, total, op=MPI.SUM, root=0)
            if server:
                phase_bytes[phase] = total
        privacy = _privacy_summary(cfg, exp, job.fed, collected["eps"]) if server else {}
        if writer:
            extra = {f"client_bytes/{k}": v for k, v in phase_bytes.items()}
            extra.update({f"server_bytes/{k}": v for k, v in net.ledger.server.items()})
            extra["privacy"] = json.dumps(privacy, sort_keys=True)
            writer.finish(status, extra)
    if not server:
        return None
    return {
        "coverage": {m: np.array(v) for m, v in collected["coverage"].items()},
        "set_size": {m: np.array(v) for m, v in collected["set_size"].items()},
        "fed_gap": {m: float(np.mean(v)) for m, v in collected["gap"].items()},
        "client_bytes": phase_bytes,
        "server_bytes": dict(net.ledger.server),
        "seconds": time.perf_counter() - t0,
        "privacy": privacy,
        "fed": job.fed,
    }


def _privacy_summary(cfg: Config, exp, fed: list, eps_by_method: dict) -> dict:
    """Worst (epsilon, delta) over the trials, per query (Theorem 4.4) and composed over labels."""
    out = {}
    for name, src, _, _ in fed:
        if not name.startswith("dp-") or not eps_by_method[name]:
            continue
        eps = np.array(eps_by_method[name])  # (trials, targets, C)
        out[name] = {
            "epsilon_per_query": float(eps.max()),
            "epsilon_composed": float(eps.sum(axis=-1).max()),
            "delta_per_query": cfg.delta,
            "delta_composed": cfg.delta * exp.n_classes,
            "count_noise_epsilon": count_noise_epsilon(cfg.count_noise, cfg.delta) if src else 0.0,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedring conformal labelshift ...``: run, print the table, write ``--out``.

    Settings are checked on every rank before any work; a bad one ends every rank with exit
    code 2 (rank 0 says why). Any other failure aborts the whole MPI job and marks the file
    ``failed``.
    """
    from mpi4py import MPI

    from fedring.runtime import Watchdog, agree_on_config_error

    comm = MPI.COMM_WORLD
    argv = sys.argv[1:] if argv is None else list(argv)

    def job() -> int:
        error = cfg = exp = None
        try:
            cfg = parse_config(argv)
            exp = _make_experiment(cfg, comm)
            _resolve(cfg, exp, comm.size)
        except ConfigError as e:
            error = e
        agree_on_config_error(comm, error)
        log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if comm.rank == 0 else None
        res = run(cfg, exp, comm, log, guard)
        if comm.rank == 0:
            print(_format_table(cfg, exp, res, res["fed"], res["privacy"]))
            print(
                f"\n{res['seconds']:.1f} s; protocol bytes per client per trial: "
                + ", ".join(f"{k}={v.mean() / cfg.trials:.0f}" for k, v in res["client_bytes"].items()),
                flush=True,
            )
            if cfg.out:
                print(f"results: {cfg.out}")
        return 0

    guard = Watchdog.start()
    try:
        return guard.run(job)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
