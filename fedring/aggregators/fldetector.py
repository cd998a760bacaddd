"""FLDetector (Zhang, Cao, Jia, Gong, KDD 2022): detect clients whose updates an L-BFGS Hessian
estimate cannot predict (FedSECA Supp. E.10, Eq. 33; the choices are in docs/fedseca.md)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedring.validate import choice, integer

from ._kernels import block_width, combine, gram, map_blocks
from .base import AggregateResult, Aggregator, register


def lbfgs_coefficients(GA: np.ndarray) -> np.ndarray | None:
    r"""Coefficients c with :math:`\hat H v = c^\top A` for the L-BFGS Hessian-vector product.

    A holds the last p+1 global aggregates a_0..a_p (chronological rows); GA = A A^T. With
    the server step w <- w - a (unit learning rate), the curvature pairs are
    :math:`s_k = w^k - w^{k-1} = -a_{k-1}`, :math:`y_k = a_k - a_{k-1}` (k = 1..p) and the
    vector is :math:`v = w^{t} - w^{t-1} = -a_p`. The compact form (FLDetector's ``lbfgs``):

    .. math::
        \hat H v = \sigma v - [\sigma S, Y]\, M^{-1} \begin{bmatrix} \sigma S^\top v \\ Y^\top v \end{bmatrix},\quad
        M = \begin{bmatrix} \sigma S^\top S & L \\ L^\top & -D \end{bmatrix}

    with L the strictly lower part and D the diagonal of S^T Y, and
    :math:`\sigma = y_p^\top s_p / s_p^\top s_p`. The product is invariant to a common scale
    of the s_k and v, so any constant learning rate gives the same result. None if the
    curvature pairs are degenerate.
    """
    p = GA.shape[0] - 1
    Sc = np.zeros((p, p + 1))  # s_k = Sc[k-1] @ A
    Yc = np.zeros((p, p + 1))
    for k in range(1, p + 1):
        Sc[k - 1, k - 1] = -1.0
        Yc[k - 1, k] = 1.0
        Yc[k - 1, k - 1] = -1.0
    vc = np.zeros(p + 1)
    vc[p] = -1.0
    StS, StY = Sc @ GA @ Sc.T, Sc @ GA @ Yc.T
    ss = StS[-1, -1]
    if not ss > 0:
        return None
    sigma = StY[-1, -1] / ss
    L = np.tril(StY, k=-1)
    M = np.block([[sigma * StS, L], [L.T, -np.diag(np.diag(StY))]])
    rhs = np.concatenate([sigma * (Sc @ GA @ vc), Yc @ GA @ vc])
    q = np.linalg.lstsq(M, rhs, rcond=None)[0]
    c = sigma * vc - (sigma * q[:p]) @ Sc - q[p:] @ Yc
    return c if np.all(np.isfinite(c)) else None


def kmeans_1d(x: np.ndarray, kmax: int) -> tuple[np.ndarray, int]:
    """Exact 1-D k-means by dynamic programming on the sorted values.

    Returns the optimal within-cluster sums of squares W_1..W_kmax and the optimal 2-means
    split position in the sorted order (clusters x_sorted[:split], x_sorted[split:]).
    """
    xs = np.sort(x)
    n = len(xs)
    s1 = np.concatenate([[0.0], np.cumsum(xs)])
    s2 = np.concatenate([[0.0], np.cumsum(xs * xs)])
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    cnt = np.where(j > i, j - i, 1)
    C = np.where(j > i, s2[j] - s2[i] - (s1[j] - s1[i]) ** 2 / cnt, np.inf)
    C = np.maximum(C, 0.0)
    dp = C[0].copy()
    W = [dp[n]]
    for _ in range(2, kmax + 1):
        dp = (dp[:, None] + C).min(axis=0)
        W.append(dp[n])
    split = int(np.argmin(C[0, 1:n] + C[1:n, n])) + 1 if n > 1 else 1
    return np.array(W), split


GAP_FORMS = ("tibshirani", "authors")


def gap_statistic_k(
    scores: np.ndarray, rng: np.random.Generator, nrefs: int, kmax: int, form: str = "tibshirani"
) -> int:
    r"""Number of clusters by the gap statistic on 1-D scores min-max scaled to [0, 1].

    Against B = ``nrefs`` uniform reference sets with within-cluster sums of squares
    :math:`W^*_{kb}`, ``form="tibshirani"`` uses Tibshirani, Walther and Hastie's Eq. (3),
    the mean of the logs, and ``form="authors"`` the FLDetector code's log of the mean:

    .. math:: \mathrm{Gap}(k) = \frac1B\sum_b \log W^*_{kb} - \log W_k
              \qquad\text{or}\qquad \log\Big(\frac1B\sum_b W^*_{kb}\Big) - \log W_k

    then the smallest k with :math:`\mathrm{Gap}(k) \ge \mathrm{Gap}(k+1) - s_{k+1}`,
    :math:`s_k = \mathrm{sd}(\log W^*_k)\sqrt{1 + 1/B}` in both forms (Tibshirani et al.'s
    Eq. (5) and step 3; kmax if none).

    Examples
    --------
    Ten scores, ten reference sets from seed 0. W_1 = 1.616, W_2 = 0.1433; Gap(1), Gap(2) are
    -0.756, -0.165 in Tibshirani's form and -0.714, -0.021 in the authors' (the log of a mean
    is at least the mean of the logs, here by more at k = 2), s_2 = 0.641. Tibshirani's form
    stops at k = 1 (-0.756 >= -0.806), the authors' goes on (-0.714 < -0.663), so only the
    authors' form reports an attack:

    >>> x = np.array([0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.9, 0.9, 1.0, 1.0])
    >>> gap_statistic_k(x, np.random.default_rng(0), nrefs=10, kmax=24)
    1
    >>> gap_statistic_k(x, np.random.default_rng(0), nrefs=10, kmax=24, form="authors")
    2
    """
    lo, hi = scores.min(), scores.max()
    if not hi > lo:
        return 1
    x = (scores - lo) / (hi - lo)
    n = len(x)
    kmax = max(1, min(kmax, n - 1))
    tiny = 1e-12
    logW = np.log(np.maximum(kmeans_1d(x, kmax)[0], tiny))
    refW = np.maximum(np.array([kmeans_1d(rng.uniform(0.0, 1.0, n), kmax)[0] for _ in range(nrefs)]), tiny)
    ref = np.log(refW)
    expected = ref.mean(axis=0) if form == "tibshirani" else np.log(refW.mean(axis=0))
    gap = expected - logW
    sd = ref.std(axis=0) * np.sqrt(1.0 + 1.0 / nrefs)
    for k in range(kmax - 1):
        if gap[k] >= gap[k + 1] - sd[k + 1]:
            return k + 1
    return kmax


@register
class FLDetector(Aggregator):
    r"""FLDetector: flag clients whose gradients disagree with an L-BFGS prediction, average the rest.

    Runs on the host: its state holds every client's previous gradient (n x d numpy, checkpointed), read and written each round.

    Each round t, with :math:`\hat H^{(t)}` the L-BFGS Hessian estimate from the last N
    global (Δw, Δg) pairs (see ``lbfgs_coefficients``):

    .. math::
        \hat g_i^{(t)} = g_i^{(t-1)} + \hat H^{(t)} (w^{(t)} - w^{(t-1)}), \quad
        d_i^{(t)} = \|\hat g_i^{(t)} - g_i^{(t)}\|_2 \,/\, \textstyle\sum_j \|\hat g_j^{(t)} - g_j^{(t)}\|_2, \quad
        s_i^{(t)} = \frac1N \sum_{r=0}^{N-1} d_i^{(t-r)}

    (the original FLDetector formulation: FedSECA's Eq. 33 prints H g_i^(t), which does not
    predict a gradient from the model's change, and a 1/T for the window N). Once
    N rounds of scores exist, the gap statistic decides whether the suspicion scores form
    more than one cluster; if so, exact 1-D 2-means splits them and the cluster with the
    higher mean suspicion is dropped. The output is the mean of the kept clients (FedAvg, as
    the FedSECA config says). Flagged clients are dropped for the round only (the original
    removes them for good and restarts training).

    Parameters
    ----------
    window : int
        N, rounds of history (10).
    nrefs : int
        Uniform reference sets of the gap statistic (10).
    kmax : int
        Largest cluster count tried by the gap statistic (24, i.e. min(K, 25) - 1 for K >= 25).
    gap : {"tibshirani", "authors"}
        The gap statistic's expected log dispersion: the mean of the reference sets' log W*_k
        (Tibshirani et al.'s definition, default) or the log of their mean (the FLDetector
        code); see ``gap_statistic_k`` and docs/aggregators.md.

    State: ``prev`` (the clients' previous gradients, float32 unless init_state gets
    dtype=float64), ``aggs`` (the last N + 1 aggregates), ``scores`` (the last N rounds of
    d^(t)), counters ``round`` and ``nscores``.
    selected: 1 for kept clients.
    """

    name = "fldetector"
    selects = True
    client_state: Mapping[str, int] = {"prev": 0, "scores": 1}

    def __init__(self, f: int = 0, *, window: int = 10, nrefs: int = 10, kmax: int = 24, gap: str = "tibshirani"):
        super().__init__(f)
        self.window = integer("fldetector.window", window, lo=1)
        self.nrefs = integer("fldetector.nrefs", nrefs, lo=1)
        self.kmax = integer("fldetector.kmax", kmax, lo=2)
        self.gap = choice("fldetector.gap", gap, GAP_FORMS)

    def check(self, n):
        if n < 2:
            return f"fldetector clusters the clients' suspicion scores and needs n >= 2, got n={n}"
        return super().check(n)

    def init_state(self, n, d, dtype=np.float32):
        return {
            "prev": np.zeros((n, d), dtype),
            "aggs": np.zeros((self.window + 1, d), dtype),
            "scores": np.zeros((self.window, n)),
            "round": np.zeros((), np.int64),
            "nscores": np.zeros((), np.int64),
        }

    def _distances(self, X, state, c, rows):
        """||prev_i + Hv - x_i|| for every client; copies X into ``prev`` in the same pass."""
        n, d = X.shape
        A, prev = state["aggs"], state["prev"]
        dt = np.promote_types(prev.dtype, X.dtype)
        coef = np.zeros(A.shape[0], dt)
        np.add.at(coef, rows, c)  # H v = coef @ A, straight from the ring buffer

        def task(sls):
            sq = np.zeros(n)
            for sl in sls:
                B = prev[:, sl] + np.dot(coef, A[:, sl]).astype(dt)
                B -= X[:, sl]
                sq += np.einsum("ij,ij->i", B, B)
                prev[:, sl] = X[:, sl]
            return sq

        return np.sqrt(sum(map_blocks(task, d, block_width(n, 8))))

    def _aggregate(self, X, state, reference, rng):
        n = X.shape[0]
        N = self.window
        t = int(state["round"])
        q = min(t, N + 1)  # the aggregates of rounds t-q .. t-1 are stored
        rows = np.arange(t - q, t) % (N + 1)
        c = None
        if q >= 2:
            c = lbfgs_coefficients(gram(state["aggs"]).inner()[np.ix_(rows, rows)])
        if c is not None:
            dist = self._distances(X, state, c, rows)
            total = dist.sum()
            state["scores"][int(state["nscores"]) % N] = dist / total if total > 0 else dist
            state["nscores"][...] = int(state["nscores"]) + 1
        else:
            state["prev"][...] = X
        keep = np.ones(n, bool)
        if int(state["nscores"]) >= N:
            suspicion = state["scores"].mean(axis=0)
            if gap_statistic_k(suspicion, rng, self.nrefs, self.kmax, self.gap) > 1:
                order = np.argsort(suspicion, kind="stable")
                split = kmeans_1d(suspicion, 2)[1]
                low, high = order[:split], order[split:]
                bad = high if suspicion[high].mean() >= suspicion[low].mean() else low
                keep[bad] = False
        out = combine(keep, X) / keep.sum()
        state["aggs"][t % (N + 1)] = out
        state["round"][...] = t + 1
        return AggregateResult(out, keep.astype(float))
