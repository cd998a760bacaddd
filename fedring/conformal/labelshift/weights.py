"""Importance weights, the multinomial subsample and the per-agent split of ``mu_y``.

Label-shift DP-FedCP (Plassier et al., ICML 2023) reweights every calibration score by the
likelihood ratio ``w_y = P_Y^*(y) / P_Y^cal(y)`` of its label, estimated from label counts
(eq. 10), which Algorithm 2 may privatise with discrete Gaussian noise. A multinomial subsample
of ``floor(N/2)`` points makes the pooled points i.i.d. from ``P_Y^cal`` (eqs. 5-6, Theorem
2.2); each agent's share of the weighted measure is its local measure of eq. (14), and the
server mixes them with the weights ``lambda`` of :func:`query_decomposition`. Random draws come
from the generators the caller passes (:mod:`fedring.rng` keys them in the protocol).
"""

from __future__ import annotations

import math

import numpy as np

from fedring.validate import real


def label_counts(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """``M_y`` = number of labels equal to ``y``, as int64 (length ``n_classes``)."""
    return np.bincount(np.asarray(labels, dtype=np.int64).reshape(-1), minlength=n_classes).astype(np.int64)


def discrete_gaussian(sigma_bar: float, size, rng: np.random.Generator) -> np.ndarray:
    """Samples of the discrete Gaussian ``N_Z(0, sigma_bar^2)``: ``P(z) ∝ exp(-z^2 / (2 sigma_bar^2))``.

    Canonne, Kamath & Steinke (2020), used by Algorithm 2 on the label counts. Sampled by
    inverse CDF on ``[-ceil(12 sigma_bar), ceil(12 sigma_bar)]``; the truncated tail mass is
    below ``exp(-72)``. ``sigma_bar = 0`` gives zeros.
    """
    real("count_noise", sigma_bar, lo=0)
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
    serves to keep noisy counts positive. Applied to exact counts it would turn every absent
    label into a count of 1, pulling sparse weights towards uniform and the coverage below
    the target (``docs/labelshift.md``).
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
    ``M = sum_y M_y``. This is eq. (7) with ``pi_i = M^i / M``. Algorithm 2 counts the training
    labels, which the paper's experiments do not have per agent; the protocol counts the
    calibration labels, so ``pi_i = N^i / N`` as Theorems 2.2 and 2.4 assume
    (``docs/labelshift.md``).

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


# -- the subsample and the per-agent decomposition (eqs. 5, 14, 19; Algorithm 2) -----------


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
    the same in distribution, and a fresh subset for every query label follows Algorithm 2,
    which draws the subsample sizes afresh for each query label.
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
    threshold is then 1, the full set (as in :func:`.quantiles.label_shift_thresholds`).

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
