"""The calibration maths of PRISM-FCP (paper Sec. II-D and III-B): pure numpy on the server.

Scores ``r = |y - w^T x|`` (eq. 7) become H-bin characterization vectors (eq. 9) on the
simplex (eq. 10); pairwise distances (eq. 11) give each client a maliciousness score, the sum
of its distances to its ``K_b - 1`` farthest neighbours (eq. 12); the filter removes the
``|S_B|`` largest scores, or the clients the MAD rule of Remark 3 flags; the conformal
threshold is the exact split-conformal order statistic of the retained clients' pooled raw
scores. Rob-FCP is the same calibration after full-sharing training; FCP skips the filter.
``docs/prism-fcp.md`` explains the choices the paper leaves open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedring.conformal.split import check_alpha, split_conformal_quantile
from fedring.validate import choice

#: the filter rules: the known number of Byzantine clients, or the MAD rule (Remark 3)
FILTERS = ("known", "mad")


def _as_client_list(scores) -> list[np.ndarray]:
    if isinstance(scores, np.ndarray) and scores.ndim == 2:
        return list(scores)
    return [np.asarray(s, dtype=np.float64).ravel() for s in scores]


def characterization_vectors(scores, r_max: float, bins: int) -> np.ndarray:
    """Eq. (9): ``v_{k,h} = (1/N_k) sum_j 1{a_{h-1} <= r~_{k,j} < a_h}``, ``a_h = h/H``.

    Every client's scores are scaled by one common ``r_max`` and clipped into [0, 1],
    ``r~ = min(max(r, 0) / r_max, 1)``, so the histograms of all clients share their bins;
    the last bin is closed on the right so that each row lies on the simplex of eq. (10). A
    client without scores gets the zero row (the caller leaves it out of filtering). Bin ``h``
    is the half-open interval ``[a_{h-1}, a_h)``: a score of 0 falls in the first bin, not
    in the last.

    Parameters
    ----------
    scores : (K, N) array or sequence of K 1-D arrays
    r_max : float
        Common normaliser (> 0; <= 0 maps every score to bin 1).
    bins : int
        H.

    Examples
    --------
    >>> characterization_vectors([[0.0, 0.25, 0.9, 1.0], [0.9, 2.0]], 1.0, 4)
    array([[0.25, 0.25, 0.  , 0.5 ],
           [0.  , 0.  , 0.  , 1.  ]])
    """
    rows = _as_client_list(scores)
    out = np.zeros((len(rows), bins))
    edges = np.arange(bins + 1) / bins
    for k, r in enumerate(rows):
        if r.size == 0:
            continue
        rt = np.minimum(np.maximum(r, 0.0) / r_max, 1.0) if r_max > 0 else np.zeros(r.size)
        idx = np.minimum(np.searchsorted(edges, rt, side="right") - 1, bins - 1)
        out[k] = np.bincount(idx, minlength=bins) / r.size
    return out


def pairwise_distances(v: np.ndarray) -> np.ndarray:
    """Eq. (11): ``d_{k,k'} = ||v_k - v_{k'}||_2`` for all pairs, shape ``(K, K)``.

    >>> pairwise_distances(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])).round(4)
    array([[0.    , 1.4142, 0.    ],
           [1.4142, 0.    , 1.4142],
           [0.    , 1.4142, 0.    ]])
    """
    v = np.asarray(v, dtype=np.float64)
    d = np.empty((v.shape[0], v.shape[0]))
    for k in range(v.shape[0]):  # exact differences (no Gram-matrix cancellation): d_kk = 0
        d[k] = np.sqrt(((v - v[k]) ** 2).sum(axis=1))
    return d


def maliciousness_scores(d: np.ndarray, n_neighbours: int) -> np.ndarray:
    """Eq. (12): ``m_k`` = sum of ``d_{k,k'}`` over the ``n_neighbours`` farthest ``k' != k``.

    The paper uses ``n_neighbours = K_b - 1``, the farthest ones (its Appendix A, and Rob-FCP's
    reference code). Clamped to ``0..K-1``.

    >>> d = pairwise_distances(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]))
    >>> maliciousness_scores(d, 1).round(4)
    array([1.4142, 1.4142, 1.4142])
    """
    d = np.asarray(d, dtype=np.float64)
    n = d.shape[0]
    j = min(max(int(n_neighbours), 0), n - 1)
    if j <= 0:
        return np.zeros(n)
    off = d.copy()
    np.fill_diagonal(off, -np.inf)
    return np.sort(np.partition(off, n - j, axis=1)[:, n - j :], axis=1).sum(axis=1)


def flag_largest(m: np.ndarray, n_flag: int) -> np.ndarray:
    """Boolean mask of the ``n_flag`` largest ``m``; equal scores go to the lower index first
    (the paper does not say; identical attackers tie, and which of them is flagged first does
    not change the result)."""
    m = np.asarray(m)
    order = np.lexsort((np.arange(m.size), -m))
    out = np.zeros(m.size, dtype=bool)
    out[order[: max(0, int(n_flag))]] = True
    return out


def flag_mad(v: np.ndarray, scale: float = 1.4826, threshold: float = 2.5) -> np.ndarray:
    """Remark 3: flag clients far from the coordinate-wise median vector.

    ``rho_k = ||v_k - median_k v||``, ``z_k = (rho_k - med rho) / (scale * MAD(rho))``; flag
    ``z_k > threshold``, one-sided (only clients unusually far from the median are
    suspicious). ``MAD = 0`` is replaced by a tiny positive number, so only clients strictly
    above the median distance can be flagged: never all.
    """
    v = np.asarray(v, dtype=np.float64)
    if v.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    rho = np.linalg.norm(v - np.median(v, axis=0), axis=1)
    med = np.median(rho)
    mad = np.median(np.abs(rho - med))
    z = (rho - med) / (scale * max(mad, 1e-12))
    return z > threshold


@dataclass
class Calibration:
    """Outcome of one robust calibration (server side)."""

    q: float  # conformal quantile (+inf when too few retained scores)
    flagged: np.ndarray  # (K,) bool, removed clients
    malice: np.ndarray  # (K,) maliciousness scores m_k (nan when not computed)
    vectors: np.ndarray | None  # (K, H) characterization vectors (None without filtering)
    r_max: float


def filter_clients(
    v: np.ndarray,
    active: np.ndarray,
    rule: str,
    n_byzantine: int,
    mad_scale: float = 1.4826,
    mad_threshold: float = 2.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Sec. III-B filter over the ``active`` (non-empty) clients; returns (flagged, m).

    ``known``: remove the ``|S_B|`` largest ``m_k`` (eq. 12 with ``K_b - 1`` neighbours
    among the active clients); ``mad``: Remark 3. At least one active client is always kept:
    at most ``n_active - 1`` are flagged, and the neighbour count is at least 1.
    """
    choice("prism.filter", rule, FILTERS)
    K = v.shape[0]
    act = np.flatnonzero(active)
    flagged = np.zeros(K, dtype=bool)
    malice = np.full(K, np.nan)
    if act.size <= 1:
        return flagged, malice
    va = v[act]
    if rule == "known":
        n_flag = min(n_byzantine, act.size - 1)
        m = maliciousness_scores(pairwise_distances(va), max(act.size - n_byzantine - 1, 1))
        malice[act] = m
        flagged[act[flag_largest(m, n_flag)]] = True
    else:
        flagged[act[flag_mad(va, mad_scale, mad_threshold)]] = True
    return flagged, malice


def robust_calibrate(
    scores,
    alpha: float,
    rule: str | None = "known",
    n_byzantine: int = 0,
    bins: int = 100,
    r_max: float | None = None,
    mad_scale: float = 1.4826,
    mad_threshold: float = 2.5,
) -> Calibration:
    """Rob-FCP / PRISM-FCP calibration of reported scores; ``rule=None`` is plain FCP.

    Characterization vectors (eq. 9), distances (eq. 11), maliciousness (eq. 12), filter
    (Sec. III-B or Remark 3), then the ``ceil((N+1)(1-alpha))``-th smallest of the pooled
    raw scores of the retained clients (Sec. II-D): the exact order statistic, where eq. (8)
    allows an approximate quantile sketch.

    Parameters
    ----------
    scores : (K, N) array or sequence of K 1-D arrays (clients may be empty)
    alpha : float
    rule : "known", "mad" or None
    n_byzantine : int
        ``|S_B|`` for the ``known`` rule.
    r_max : float or None
        Histogram normaliser; None = the largest reported score.

    Examples
    --------
    >>> benign = [np.linspace(0.01, 1, 100) for _ in range(4)]
    >>> res = robust_calibrate(benign + [np.zeros(100)], 0.1, "known", 1, bins=10)
    >>> res.flagged.tolist(), res.q
    ([False, False, False, False, True], 0.91)
    """
    alpha = check_alpha(alpha)
    rows = _as_client_list(scores)
    K = len(rows)
    sizes = np.array([r.size for r in rows], dtype=np.int64)
    if r_max is None:
        r_max = max((float(r.max()) for r in rows if r.size), default=0.0)
    v = None
    flagged = np.zeros(K, dtype=bool)
    malice = np.full(K, np.nan)
    if rule is not None:
        v = characterization_vectors(rows, r_max, bins)
        flagged, malice = filter_clients(v, sizes > 0, rule, n_byzantine, mad_scale, mad_threshold)
    kept = [r for r, f in zip(rows, flagged) if not f]
    pool = np.concatenate(kept) if kept else np.empty(0)
    return Calibration(split_conformal_quantile(pool, alpha), flagged, malice, v, float(r_max))


def coverage_bounds(
    eps: float, n_clients: int, n_benign: int, bins: int, n_b: int, beta: float = 0.05
) -> tuple[float, float]:
    """Corollary 4, eq. (36): ``(delta_L, delta_U)`` with ``1 - alpha - delta_L <= Cov <=
    1 - alpha + delta_U`` with probability ``>= 1 - beta`` (after Rob-FCP's certificate).

    ``delta_L = (eps n_b + 1)/(n_b + K_b) + T``, ``delta_U = eps + K_b/(n_b + K_b) + T``,
    ``T = H Phi^-1(1 - beta/(2 H K_b)) / (2 sqrt(n_b)) (1 + tau)/(1 - tau)``,
    ``tau = (K - K_b)/K_b``. Both increase with the misfiltering probability ``eps``
    (Corollary 5). At the paper's settings ``T`` is about 11.9, so the bound is vacuous.

    >>> [round(b, 3) for b in coverage_bounds(0.0, 100, 80, 100, 1000)]
    [11.906, 11.979]
    """
    from statistics import NormalDist

    tau = (n_clients - n_benign) / n_benign
    if not 0 <= tau < 1:
        raise ValueError(f"Corollary 4 needs K - K_b < K_b, got K={n_clients}, K_b={n_benign}")
    t = bins * NormalDist().inv_cdf(1 - beta / (2 * bins * n_benign)) / (2 * math.sqrt(n_b)) * (1 + tau) / (1 - tau)
    return float((eps * n_b + 1) / (n_b + n_benign) + t), float(eps + n_benign / (n_b + n_benign) + t)
