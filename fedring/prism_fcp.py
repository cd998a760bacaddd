"""PRISM-FCP: Byzantine-resilient federated conformal prediction via partial sharing.

E. Lari, R. Arablouei, S. Werner, "PRISM-FCP: Byzantine-Resilient Federated Conformal
Prediction via Partial Sharing" (arXiv 2602.18396, 2026), with its baselines Rob-FCP
(M. Kang et al., ICML 2024: the same calibration filter, full sharing) and FCP (C. Lu et al.,
ICML 2023: full sharing, no filter). Equation numbers below are the paper's.

Two stages, run over MPI with the server on rank 0 and each rank hosting a contiguous block
of clients (:class:`fedring.comm.Layout`):

1. **Training** (Sec. II-B/II-C, spec Algorithm 1): PSO-Fed online LMS on ``y = w*^T x + nu``
   (eq. 1). Every iteration the server samples ``|S_n|`` clients; each downloads the ``M``
   global coordinates picked by its selection mask ``S_{k,n-1}``, takes one LMS step on its
   streaming sample, and uploads the ``M`` coordinates picked by a fresh mask ``S_{k,n}``;
   a Byzantine client adds ``tau * delta``, ``tau ~ Bernoulli(p_a)``, ``delta ~ N(0,
   sigma_B^2 I)`` to what it sends. Only the ``M`` values travel (both ends derive the masks
   from a shared seed), so the ledger measures ``M/D`` of full sharing's bytes.
2. **Calibration** (Sec. II-D, III-B): scores ``r = |y - w^T x|`` (eq. 7), H-bin
   characterization vectors (eq. 9) on the simplex (eq. 10), pairwise distances (eq. 11),
   maliciousness scores over the ``K_b - 1`` farthest neighbours (eq. 12), removal of the
   ``|S_B|`` largest (or the MAD rule of Remark 3), the split-conformal quantile of the
   retained clients' pooled scores (Sec. II-D; eq. 8 with the exact order statistic) and
   the interval ``[w^T x - q, w^T x + q]`` (eq. 5).

Choices where the paper is silent follow ``shared/specs/prism-fcp.md`` §7 (cited as A<n>):
masks drawn for every client every iteration, independent uniform M-subsets (A3, A4);
``w_0 = w_{k,0} = 0`` (A2); histograms normalise by a common ``r_max``, by default the
largest reported score (A9); the coverage attack uses the attacker's own mean (A10); scores
of the random attack are clipped at 0 (A11); the model used for calibration is
``w_{N_iter}`` (A13); "MSE" is the per-coordinate parameter error ``||w - w*||^2 / D``
(A14), or, on UCI data (no ``w*``), the test-set mean squared error in normalized units.
Whether clients outside ``S_n`` keep learning (A5), whether a Byzantine client's
corruption persists in its own model (A6), ``mu`` (A1) and whether ``sigma_C^2 = 0.5`` is
a variance (A11) are set by the profiles in :data:`PROFILES`.

Departure from the spec (A16): coverage is measured by default on the benign clients' test
data (``coverage_on="benign"``), where split-conformal exchangeability holds exactly; this
reproduces the paper's trial-to-trial spread (90.0 +- 0.1, FCP 87.5 +- 0.2), while all
clients' test data (the spec's choice, ``coverage_on="all"``) gives +- 0.3 and 87.3.

Determinism: every random draw comes from ``numpy.random.default_rng([seed, trial, stream,
index])`` with the client as index for client streams, so a run gives bit-identical
results on any number of MPI ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fedring.conformal import check_alpha, split_conformal_quantile
from fedring.errors import ConfigError

# Random streams: default_rng([seed, trial, STREAM, index]).
STREAM_ENV, STREAM_DATA, STREAM_MASK, STREAM_BYZ, STREAM_PART, STREAM_CALIB = range(6)

METHODS = ("prism", "robfcp", "fcp")
METHOD_LABEL = {"prism": "PRISM-FCP", "robfcp": "Rob-FCP", "fcp": "FCP"}
CALIB_ATTACKS = ("none", "efficiency", "coverage", "random")
FILTERS = ("known", "mad")

#: Settings the paper leaves open (spec §7 A1, A5, A6, A11), as named profiles:
#:
#: - ``stable``: the spec's default (mu = 0.01, transmit-only noise, all clients learn
#:   locally); stable down to M/D = 0.1, but Table I's full-sharing widths come out ~2x.
#: - ``paper-match``: the spec's §8 fit (mu = 0.04, the full corrupted vector persists in
#:   the attacker's model, all clients learn locally); PRISM-FCP matches Table I, Rob-FCP
#:   and FCP widths come out ~15-25% wide; diverges at mu >= 0.05 or M/D = 0.1.
#: - ``paper-fit``: this module's fit [SIM]: mu = 0.06, only the sampled clients take an
#:   LMS step (A5 alternative), the corrupted *shared* coordinates persist in the
#:   attacker's model (A6 middle reading), sigma_C = 0.5 read as a standard deviation
#:   (A11). Rob-FCP lands on the paper's -21.4 dB and every Table I number is reproduced
#:   within the tolerances reported in the README.
#: - ``uci``: paper-fit mechanics with mu = 0.01 (spec §2.11 range) for 81 standardized, correlated features.
PROFILES = {
    "stable": {"step": 0.01, "byz_persist": "none", "local_updates": True, "random_var": 0.5},
    "paper-match": {"step": 0.04, "byz_persist": "full", "local_updates": True, "random_var": 0.5},
    "paper-fit": {"step": 0.06, "byz_persist": "sent", "local_updates": False, "random_var": 0.25},
    "uci": {"step": 0.01, "byz_persist": "sent", "local_updates": False, "random_var": 0.25},
}
PERSIST = ("none", "sent", "full")

_DATASET_DEFAULTS = {
    "synthetic": {"participants": 10, "dim": 50, "shared": 15, "profile": "paper-fit"},
    "uci": {"participants": 20, "dim": 81, "shared": 20, "profile": "uci"},
}


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrismConfig:
    """Settings of one PRISM-FCP / Rob-FCP / FCP experiment (paper Sec. V defaults)."""

    dataset: str = "synthetic"
    data_dir: str | None = None
    n_clients: int = 100  # K
    participants: int = 10  # |S_n|
    dim: int = 50  # D (UCI: 81, fixed by the file)
    shared: int = 15  # M for PRISM-FCP; Rob-FCP and FCP use M = D
    step: float = 0.06  # mu
    iterations: int = 1000
    n_byzantine: int = 20  # |S_B|
    attack_prob: float = 0.25  # p_a
    attack_var: float = 0.1  # sigma_B^2
    byz_persist: str = "sent"  # none | sent | full (A6)
    local_updates: bool = False  # A5: do clients outside S_n take LMS steps?
    mask_scheme: str = "random"
    calib_samples: int = 1000  # N_k
    test_samples: int = 1000
    bins: int = 100  # H
    alpha: float = 0.1
    filter: str = "known"
    r_max: float | None = None
    coverage_factor: float = 10.0
    coverage_mean: str = "own"
    random_var: float = 0.25  # sigma_C^2
    mad_scale: float = 1.4826
    mad_threshold: float = 2.5
    coverage_on: str = "benign"
    input_var: tuple[float, float] = (0.2, 1.2)  # varsigma_k^2 ~ U(.)
    noise_var: tuple[float, float] = (0.005, 0.025)  # sigma_nu_k^2 ~ U(.)
    dirichlet: float = 0.5
    profile: str = "paper-fit"

    @property
    def n_benign(self) -> int:
        return self.n_clients - self.n_byzantine

    def method_shared(self, method: str) -> int:
        """M used by ``method``: PRISM-FCP partial, the baselines full sharing."""
        return self.shared if method == "prism" else self.dim

    def validate(self) -> "PrismConfig":
        """Raise ``ConfigError`` naming the first bad setting; return self."""

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(key, msg)

        need(self.dataset in _DATASET_DEFAULTS, "dataset", f"{self.dataset!r}; allowed: synthetic, uci")
        need(self.profile in PROFILES, "profile", f"{self.profile!r}; allowed: {', '.join(PROFILES)}")
        need(self.n_clients >= 1, "clients", f"must be >= 1, got {self.n_clients}")
        need(1 <= self.participants <= self.n_clients, "participants",
             f"must be in 1..clients={self.n_clients}, got {self.participants}")
        need(self.dim >= 1, "dim", f"must be >= 1, got {self.dim}")
        need(1 <= self.shared <= self.dim, "shared", f"M must be in 1..D={self.dim}, got {self.shared}")
        need(math.isfinite(self.step) and self.step > 0, "step", f"must be > 0, got {self.step}")
        need(self.iterations >= 0, "iterations", f"must be >= 0, got {self.iterations}")
        need(0 <= self.n_byzantine < self.n_clients, "byzantine",
             f"must be in 0..clients-1={self.n_clients - 1}, got {self.n_byzantine}")
        need(0 <= self.attack_prob <= 1, "attack-prob", f"p_a must be in [0, 1], got {self.attack_prob}")
        need(self.attack_var >= 0, "attack-var", f"sigma_B^2 must be >= 0, got {self.attack_var}")
        need(self.byz_persist in PERSIST, "byz-persist", f"{self.byz_persist!r}; allowed: {', '.join(PERSIST)}")
        need(self.mask_scheme in ("random", "roundrobin"), "mask-scheme",
             f"{self.mask_scheme!r}; allowed: random, roundrobin")
        need(self.calib_samples >= 0, "calib-samples", f"must be >= 0, got {self.calib_samples}")
        need(self.test_samples >= 1, "test-samples", f"must be >= 1, got {self.test_samples}")
        need(self.bins >= 1, "bins", f"H must be >= 1, got {self.bins}")
        check_alpha(self.alpha)
        need(self.filter in FILTERS, "filter", f"{self.filter!r}; allowed: {', '.join(FILTERS)}")
        need(self.r_max is None or self.r_max > 0, "r-max", f"must be > 0, got {self.r_max}")
        need(self.coverage_factor > 0, "coverage-factor", f"must be > 0, got {self.coverage_factor}")
        need(self.coverage_mean in ("own", "benign"), "coverage-mean",
             f"{self.coverage_mean!r}; allowed: own, benign")
        need(self.random_var >= 0, "random-var", f"sigma_C^2 must be >= 0, got {self.random_var}")
        need(self.mad_scale > 0 and self.mad_threshold > 0, "mad", "scale and threshold must be > 0")
        need(self.coverage_on in ("all", "benign"), "coverage-on", f"{self.coverage_on!r}; allowed: all, benign")
        lo, hi = self.input_var
        need(0 < lo <= hi, "input-var", f"need 0 < low <= high, got {self.input_var}")
        lo, hi = self.noise_var
        need(0 <= lo <= hi, "noise-var", f"need 0 <= low <= high, got {self.noise_var}")
        need(self.dirichlet > 0, "dirichlet", f"must be > 0, got {self.dirichlet}")
        if self.dataset == "uci":
            need(self.dim == 81, "dim", f"UCI Superconductivity has D=81 features, got {self.dim}")
            need(self.data_dir is not None, "data-dir", "UCI needs --data-dir holding train.csv")
        return self


def make_config(dataset: str = "synthetic", profile: str | None = None, **overrides) -> PrismConfig:
    """Dataset defaults, then the profile's step size and ``byz_persist``, then overrides."""
    if dataset not in _DATASET_DEFAULTS:
        raise ConfigError("dataset", f"{dataset!r}; allowed: {', '.join(_DATASET_DEFAULTS)}")
    base = dict(_DATASET_DEFAULTS[dataset])
    prof = profile or base["profile"]
    if prof not in PROFILES:
        raise ConfigError("profile", f"{prof!r}; allowed: {', '.join(PROFILES)}")
    base.update(PROFILES[prof], profile=prof, dataset=dataset)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return PrismConfig(**base).validate()


# --------------------------------------------------------------------------------------
# Calibration stage: pure numpy over all clients (server side)
# --------------------------------------------------------------------------------------


def _as_client_list(scores) -> list[np.ndarray]:
    if isinstance(scores, np.ndarray) and scores.ndim == 2:
        return list(scores)
    return [np.asarray(s, dtype=np.float64).ravel() for s in scores]


def characterization_vectors(scores, r_max: float, bins: int) -> np.ndarray:
    """Eq. (9): ``v_{k,h} = (1/N_k) sum_j 1{a_{h-1} <= r~_{k,j} < a_h}``, ``a_h = h/H``.

    ``r~ = min(max(r, 0) / r_max, 1)`` (A9); the last bin is closed on the right so each
    row lies on the simplex of eq. (10). A client without scores gets the zero row (the
    caller leaves it out of filtering). Not the Rob-FCP code's ``int(score/unit) - 1``,
    which sends the first bin to the last (spec §2.4).

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

    The paper uses ``n_neighbours = K_b - 1`` (farthest, as in Appendix A and the Rob-FCP
    code's ``heapq.nlargest``). Clamped to ``0..K-1``.

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
    return np.sort(np.partition(off, n - j, axis=1)[:, n - j:], axis=1).sum(axis=1)


def flag_largest(m: np.ndarray, n_flag: int) -> np.ndarray:
    """Boolean mask of the ``n_flag`` largest ``m`` (ties: lower index first, A22)."""
    m = np.asarray(m)
    order = np.lexsort((np.arange(m.size), -m))
    out = np.zeros(m.size, dtype=bool)
    out[order[: max(0, int(n_flag))]] = True
    return out


def flag_mad(v: np.ndarray, scale: float = 1.4826, threshold: float = 2.5) -> np.ndarray:
    """Remark 3 / Sec. V-A: flag clients far from the coordinate-wise median vector.

    ``rho_k = ||v_k - median_k v||``, ``z_k = (rho_k - med rho) / (scale * MAD(rho))``;
    flag ``z_k > threshold`` (one-sided, A21). ``MAD = 0`` is replaced by a tiny positive
    number, so only clients strictly above the median distance can be flagged: never all.
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


def filter_clients(v: np.ndarray, active: np.ndarray, rule: str, n_byzantine: int,
                   mad_scale: float = 1.4826, mad_threshold: float = 2.5) -> tuple[np.ndarray, np.ndarray]:
    """Sec. III-B filter over the ``active`` (non-empty) clients; returns (flagged, m).

    ``known``: remove the ``|S_B|`` largest ``m_k`` (eq. 12 with ``K_b - 1`` neighbours
    among the active clients); ``mad``: Remark 3. At least one active client is always kept:
    at most ``n_active - 1`` are flagged, and the neighbour count is at least 1.
    """
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
    elif rule == "mad":
        flagged[act[flag_mad(va, mad_scale, mad_threshold)]] = True
    else:
        raise ConfigError("filter", f"{rule!r}; allowed: {', '.join(FILTERS)}")
    return flagged, malice


def robust_calibrate(scores, alpha: float, rule: str | None = "known", n_byzantine: int = 0,
                     bins: int = 100, r_max: float | None = None, mad_scale: float = 1.4826,
                     mad_threshold: float = 2.5) -> Calibration:
    """Rob-FCP / PRISM-FCP calibration of reported scores; ``rule=None`` is plain FCP.

    Characterization vectors (eq. 9), distances (eq. 11), maliciousness (eq. 12), filter
    (Sec. III-B or Remark 3), then the ``ceil((N+1)(1-alpha))``-th smallest of the pooled
    raw scores of the retained clients (Sec. II-D, A12).

    Parameters
    ----------
    scores : (K, N) array or sequence of K 1-D arrays (clients may be empty)
    alpha : float
    rule : "known", "mad" or None
    n_byzantine : int
        ``|S_B|`` for the ``known`` rule.
    r_max : float or None
        Histogram normaliser; None = the largest reported score (A9).

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


def coverage_bounds(eps: float, n_clients: int, n_benign: int, bins: int, n_b: int,
                    beta: float = 0.05) -> tuple[float, float]:
    """Corollary 4, eq. (36): ``(delta_L, delta_U)`` with ``1 - alpha - delta_L <= Cov <=
    1 - alpha + delta_U`` with probability ``>= 1 - beta`` (after Rob-FCP's certificate).

    ``delta_L = (eps n_b + 1)/(n_b + K_b) + T``, ``delta_U = eps + K_b/(n_b + K_b) + T``,
    ``T = H Phi^-1(1 - beta/(2 H K_b)) / (2 sqrt(n_b)) (1 + tau)/(1 - tau)``,
    ``tau = (K - K_b)/K_b``. Both increase with the misfiltering probability ``eps``
    (Corollary 5). At the paper's settings ``T`` is about 11.9, so the bound is vacuous.
    """
    from statistics import NormalDist

    tau = (n_clients - n_benign) / n_benign
    if not 0 <= tau < 1:
        raise ConfigError("byzantine", f"Corollary 4 needs K - K_b < K_b, got K={n_clients}, K_b={n_benign}")
    t = bins * NormalDist().inv_cdf(1 - beta / (2 * bins * n_benign)) / (2 * math.sqrt(n_b)) * (1 + tau) / (1 - tau)
    return float((eps * n_b + 1) / (n_b + n_benign) + t), float(eps + n_benign / (n_b + n_benign) + t)


# --------------------------------------------------------------------------------------
# Calibration-phase attacks (Sec. II-E, V-A): callables over the (n, N) scores of the
# Byzantine clients; they return the scores those clients report.
# --------------------------------------------------------------------------------------


class EfficiencyAttack:
    """Report every score as 0 (histogram ``e_1``): deflates the pooled quantile.

    >>> EfficiencyAttack()(np.array([[0.3, 1.2]]), None)
    array([[0., 0.]])
    """

    name = "efficiency"

    def __call__(self, scores: np.ndarray, rng: np.random.Generator | None, benign_mean: float | None = None):
        return np.zeros_like(scores)


class CoverageAttack:
    """Report every score as ``factor`` x the benign mean score (histogram ``e_H``).

    The mean is the attacker's own true mean (A10), or ``benign_mean`` when given (the
    ``coverage_mean = benign`` option).

    >>> CoverageAttack(10.0)(np.array([[0.1, 0.3], [1.0, 3.0]]), None)
    array([[ 2.,  2.],
           [20., 20.]])
    """

    name = "coverage"

    def __init__(self, factor: float = 10.0):
        if not factor > 0:
            raise ConfigError("coverage-factor", f"must be > 0, got {factor}")
        self.factor = float(factor)

    def __call__(self, scores: np.ndarray, rng, benign_mean: float | None = None):
        if benign_mean is not None:
            return np.full_like(scores, self.factor * benign_mean)
        mean = scores.mean(axis=1, keepdims=True) if scores.shape[1] else np.zeros((scores.shape[0], 1))
        return np.broadcast_to(self.factor * mean, scores.shape).copy()


class RandomAttack:
    """``r~ = max(r + eta, 0)``, ``eta ~ N(0, sigma_C^2)`` i.i.d. (A11: a variance, clip at 0).

    >>> RandomAttack(0.0)(np.array([[0.5, 0.7]]), np.random.default_rng(0))
    array([[0.5, 0.7]])
    """

    name = "random"

    def __init__(self, variance: float = 0.5):
        if not variance >= 0:
            raise ConfigError("random-var", f"sigma_C^2 must be >= 0, got {variance}")
        self.std = math.sqrt(variance)

    def __call__(self, scores: np.ndarray, rng: np.random.Generator, benign_mean: float | None = None):
        return np.maximum(scores + self.std * rng.standard_normal(scores.shape), 0.0)


def make_calib_attack(name: str, cfg: PrismConfig):
    if name == "efficiency":
        return EfficiencyAttack()
    if name == "coverage":
        return CoverageAttack(cfg.coverage_factor)
    if name == "random":
        return RandomAttack(cfg.random_var)
    if name == "none":
        return None
    raise ConfigError("calib-attack", f"{name!r}; allowed: {', '.join(CALIB_ATTACKS)}")


# --------------------------------------------------------------------------------------
# Environment: the synthetic generator (Sec. V-A) and the UCI split (Sec. V-B)
# --------------------------------------------------------------------------------------


def _rng(seed: int, trial: int, stream: int, index: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, trial, stream, index])


@dataclass
class Environment:
    """One trial's world as seen by one rank: global facts and the hosted clients' data.

    Arrays are time-major for the training stream: ``x_train[n]`` holds iteration ``n``'s
    sample of every hosted client.
    """

    byzantine: np.ndarray  # (K,) bool, S_B (A17: uniform, fixed for the trial)
    w_star: np.ndarray | None  # (D,) or None (UCI)
    y_scale: float  # width multiplier to report (UCI: target std in Kelvin)
    lo: int
    hi: int
    x_train: np.ndarray  # (N_iter, n_local, D)
    y_train: np.ndarray  # (N_iter, n_local)
    x_cal: np.ndarray  # (n_local, N_k, D)
    y_cal: np.ndarray  # (n_local, N_k)
    x_test: np.ndarray  # (n_local, N_test, D)
    y_test: np.ndarray  # (n_local, N_test)


def _byzantine_set(cfg: PrismConfig, rng: np.random.Generator) -> np.ndarray:
    byz = np.zeros(cfg.n_clients, dtype=bool)
    byz[rng.choice(cfg.n_clients, cfg.n_byzantine, replace=False)] = True
    return byz


def synthetic_environment(cfg: PrismConfig, seed: int, trial: int, lo: int, hi: int) -> Environment:
    """Sec. V-A: ``||w*|| = 1``; client k: ``x ~ N(0, varsigma_k^2 I)``, ``varsigma_k^2 ~
    U(0.2, 1.2)``, ``y = w*^T x + nu``, ``nu ~ N(0, sigma_k^2)``, ``sigma_k^2 ~ U(0.005,
    0.025)``; 1 fresh sample per iteration, then N_k calibration and test samples."""
    env = _rng(seed, trial, STREAM_ENV)
    w_star = env.standard_normal(cfg.dim)
    w_star /= np.linalg.norm(w_star)
    byz = _byzantine_set(cfg, env)
    N, D, nl = cfg.iterations, cfg.dim, hi - lo
    sizes = (N, cfg.calib_samples, cfg.test_samples)
    xs = [np.empty((nl, s, D)) for s in sizes]
    ys = [np.empty((nl, s)) for s in sizes]
    for j, k in enumerate(range(lo, hi)):
        rng = _rng(seed, trial, STREAM_DATA, k)
        sx = math.sqrt(rng.uniform(*cfg.input_var))
        sn = math.sqrt(rng.uniform(*cfg.noise_var))
        for x, y, s in zip(xs, ys, sizes):
            x[j] = sx * rng.standard_normal((s, D))
            y[j] = (x[j] * w_star).sum(axis=1) + sn * rng.standard_normal(s)
    return Environment(byz, w_star, 1.0, lo, hi, np.ascontiguousarray(xs[0].transpose(1, 0, 2)),
                       np.ascontiguousarray(ys[0].T), xs[1], ys[1], xs[2], ys[2])


def uci_environment(cfg: PrismConfig, data, seed: int, trial: int, lo: int, hi: int) -> Environment:
    """Sec. V-B: decile/Dirichlet client split (:mod:`fedring.datasets_uci`), each client's
    samples cut into ``iterations`` train, ``calib_samples`` calibration, ``test_samples``
    test; widths reported in Kelvin (A19)."""
    from fedring.datasets_uci import client_indices, decile_bins

    byz = _byzantine_set(cfg, _rng(seed, trial, STREAM_ENV))
    bins = decile_bins(data.y)
    N, nc, nt = cfg.iterations, cfg.calib_samples, cfg.test_samples
    idx = np.stack([client_indices(bins, _rng(seed, trial, STREAM_DATA, k), N + nc + nt, cfg.dirichlet)
                    for k in range(lo, hi)])
    tr, ca, te = idx[:, :N], idx[:, N:N + nc], idx[:, N + nc:]
    return Environment(byz, None, data.y_std, lo, hi, data.x[tr.T], data.y[tr.T], data.x[ca], data.y[ca],
                       data.x[te], data.y[te])


# --------------------------------------------------------------------------------------
# Training stage: PSO-Fed (Sec. II-B) with Byzantine uplink noise (Sec. II-C)
# --------------------------------------------------------------------------------------


def selection_masks(rng: np.random.Generator, n: int, dim: int, shared: int, scheme: str = "random") -> np.ndarray:
    """Index form of ``n`` selection matrices ``S`` (diagonal 0/1, ``M`` ones), ``(n, M)``.

    ``random``: independent uniform ``M``-subsets (A3); masks for different ``M`` drawn
    from the same generator state are nested. ``roundrobin`` (original PSO-Fed):
    ``S_{n+1}`` is ``S_n`` shifted by ``M`` coordinates from a random start.
    """
    if shared == dim:
        return np.broadcast_to(np.arange(dim, dtype=np.intp), (n, dim))
    if scheme == "roundrobin":
        start = int(rng.integers(dim))
        return np.sort((start + shared * np.arange(n)[:, None] + np.arange(shared)) % dim, axis=1)
    u = rng.random((n, dim))
    return np.sort(np.argpartition(u, shared - 1, axis=1)[:, :shared], axis=1)


def participants(cfg: PrismConfig, seed: int, trial: int) -> np.ndarray:
    """``S_n`` for n = 1..N_iter, ``(N_iter, |S_n|)`` sorted client indices (server draws)."""
    rng = _rng(seed, trial, STREAM_PART)
    u = rng.random((cfg.iterations, cfg.n_clients))
    p = cfg.participants
    return np.sort(np.argpartition(u, p - 1, axis=1)[:, :p], axis=1)


def _client_masks(cfg, seed, trial, clients, shared) -> np.ndarray:
    """Time-major masks ``(N_iter + 1, len(clients), M)``; row 0 is ``S_{k,0}``."""
    out = np.empty((cfg.iterations + 1, len(clients), shared), dtype=np.intp)
    for j, k in enumerate(clients):
        out[:, j] = selection_masks(_rng(seed, trial, STREAM_MASK, k), cfg.iterations + 1, cfg.dim,
                                    shared, cfg.mask_scheme)
    return out


class _Byzantine:
    """Training-attack draws of the hosted Byzantine clients: ``tau`` (N_iter, n_local) and
    ``delta`` per attacker (Sec. II-C; A2: independent of data and masks)."""

    def __init__(self, cfg: PrismConfig, seed: int, trial: int, env: Environment):
        nl = env.hi - env.lo
        self.slot = np.full(nl, -1)
        self.tau = np.zeros((cfg.iterations, nl), dtype=bool)
        local_byz = np.flatnonzero(env.byzantine[env.lo:env.hi])
        self.delta = np.empty((local_byz.size, cfg.iterations, cfg.dim))
        sd = math.sqrt(cfg.attack_var)
        for s, j in enumerate(local_byz):
            rng = _rng(seed, trial, STREAM_BYZ, env.lo + j)
            self.slot[j] = s
            self.tau[:, j] = rng.random(cfg.iterations) < cfg.attack_prob
            self.delta[s] = sd * rng.standard_normal((cfg.iterations, cfg.dim))


@dataclass
class TrainResult:
    w: np.ndarray | None  # final global model w_{N_iter} (server rank only)
    bytes_up: int  # uplink payload bytes of this rank's clients
    bytes_down: int  # server's downlink payload bytes (0 off the server rank)
    seconds: float


def train_psofed(cfg: PrismConfig, env: Environment, shared: int, link: "StarLink", seed: int,
                 trial: int, parts: np.ndarray | None = None) -> TrainResult:
    """Algorithm 1: PSO-Fed with Byzantine uplink noise; returns ``w_{N_iter}``.

    Per iteration n, for ``k in S_n``: download ``S_{k,n-1} w_{n-1}`` (M values), then

        eps_{k,n} = y_{k,n} - [S_{k,n-1} w_{n-1} + (I - S_{k,n-1}) w_{k,n-1}]^T x_{k,n}
        w_{k,n}   = S_{k,n-1} w_{n-1} + (I - S_{k,n-1}) w_{k,n-1} + mu x_{k,n} eps_{k,n}

    (with ``local_updates``, clients outside ``S_n`` take the same step from their own
    model, A5), upload ``S_{k,n}(w_{k,n} + beta_k tau_{k,n} delta_{k,n})`` (M values,
    Sec. II-C), and the server sets

        w_n = (1/|S_n|) sum_{k in S_n} [S_{k,n} w_{k,n} + (I - S_{k,n}) w_{n-1}]

    with the received values in place of ``S_{k,n} w_{k,n}``. ``byz_persist`` (A6): the
    attacker's own model stays clean (``none``), keeps the corrupted shared coordinates
    (``sent``), or adds the whole ``delta`` (``full``). The server lives on rank 0; every
    exchange goes through ``link``, which counts the payload bytes. Returns ``w`` on rank 0
    only (None elsewhere) and this rank's share of the bytes.
    """
    t0 = time.perf_counter()
    lo, hi, D, P, mu = env.lo, env.hi, cfg.dim, cfg.participants, cfg.step
    parts = participants(cfg, seed, trial) if parts is None else parts
    server = link.is_server
    masks_all = _client_masks(cfg, seed, trial, range(cfg.n_clients), shared) if server else None
    masks = masks_all[:, lo:hi] if server else _client_masks(cfg, seed, trial, range(lo, hi), shared)
    byz = _Byzantine(cfg, seed, trial, env)
    w_loc = np.zeros((hi - lo, D))
    w_glob = np.zeros(D)
    up_before, down_before = link.totals()
    rows_all = np.arange(P)[:, None]
    for i in range(cfg.iterations):
        part = parts[i]
        a, b = np.searchsorted(part, (lo, hi))
        rows = part[a:b] - lo
        down = w_glob[masks_all[i, part]] if server else None
        down_loc = link.scatter(part, down, shared, "train_down")
        if rows.size:
            w_loc[rows[:, None], masks[i, rows]] = down_loc
        if cfg.local_updates:
            x, y = env.x_train[i], env.y_train[i]
            eps = y - (w_loc * x).sum(axis=1)
            w_loc += (mu * eps)[:, None] * x
        elif rows.size:
            x, y = env.x_train[i, rows], env.y_train[i, rows]
            eps = y - (w_loc[rows] * x).sum(axis=1)
            w_loc[rows] += (mu * eps)[:, None] * x
        up_idx = masks[i + 1, rows]
        sent = np.take_along_axis(w_loc[rows], up_idx, axis=1)
        hit = byz.tau[i, rows]
        if hit.any():
            r = rows[hit]
            noise = byz.delta[byz.slot[r], i]
            sent[hit] += np.take_along_axis(noise, up_idx[hit], axis=1)
            if cfg.byz_persist == "full":
                w_loc[r] += noise
            elif cfg.byz_persist == "sent":
                w_loc[r[:, None], up_idx[hit]] = sent[hit]
        up = link.gather(part, sent, "train_up")
        if server:
            full = np.tile(w_glob, (P, 1))
            full[rows_all, masks_all[i + 1, part]] = up
            w_glob = full.sum(axis=0) / P
    up_after, down_after = link.totals()
    return TrainResult(w_glob if server else None, up_after - up_before, down_after - down_before,
                       time.perf_counter() - t0)


# --------------------------------------------------------------------------------------
# Server <-> client messages over MPI (numpy buffers, counted in the fedring Ledger)
# --------------------------------------------------------------------------------------

_TAG_DOWN, _TAG_UP = 21, 22


class StarLink:
    """Star messages between the server (rank 0) and any sorted subset of clients.

    :class:`fedring.comm.Network` moves all clients' rows at once; PSO-Fed talks to the
    ``|S_n|`` sampled clients only, and calibration collects the retained clients' scores
    only, so this adds subset scatter/gather with mpi4py buffer methods on a private
    communicator. A message to or from a client on the server's own rank is a memory copy.
    Bytes go into the network's Ledger: client sends per client and phase, server sends
    under the server.
    """

    def __init__(self, net):
        from mpi4py import MPI

        self._mpi = MPI
        self.net = net
        self.layout = net.layout
        self.ledger = net.ledger
        self.comm = net.comm.Dup()
        self.is_server = self.layout.rank == 0
        self.lo, self.hi = self.layout.lo, self.layout.hi
        self.bounds = np.asarray(self.layout.bounds)

    def _segments(self, clients: np.ndarray) -> np.ndarray:
        return np.searchsorted(clients, self.bounds)

    def scatter(self, clients: np.ndarray, rows: np.ndarray | None, width: int, phase: str) -> np.ndarray:
        """Server sends row ``i`` of ``rows`` to client ``clients[i]``; returns this rank's rows."""
        seg = self._segments(clients)
        me = self.layout.rank
        if self.is_server:
            rows = np.ascontiguousarray(rows, dtype=np.float64)
            self.ledger.server[phase] += rows.nbytes
            reqs = [self.comm.Isend(rows[seg[r]:seg[r + 1]], dest=r, tag=_TAG_DOWN)
                    for r in range(1, self.layout.size) if seg[r + 1] > seg[r]]
            if reqs:
                self._mpi.Request.Waitall(reqs)
            return rows[seg[0]:seg[1]]
        out = np.empty((seg[me + 1] - seg[me], width))
        if out.shape[0]:
            self.comm.Recv(out, source=0, tag=_TAG_DOWN)
        return out

    def gather(self, clients: np.ndarray, local: np.ndarray, phase: str) -> np.ndarray | None:
        """Each listed client sends its row (``local``: this rank's rows, in order); the
        server gets ``(len(clients), width)``, other ranks None."""
        seg = self._segments(clients)
        me = self.layout.rank
        local = np.ascontiguousarray(local, dtype=np.float64)
        if local.shape[0]:
            self.ledger.clients[phase][clients[seg[me]:seg[me + 1]]] += local[0].nbytes
        if not self.is_server:
            if local.shape[0]:
                self.comm.Send(local, dest=0, tag=_TAG_UP)
            return None
        out = np.empty((len(clients), *local.shape[1:]))
        out[seg[0]:seg[1]] = local
        reqs = [self.comm.Irecv(out[seg[r]:seg[r + 1]], source=r, tag=_TAG_UP)
                for r in range(1, self.layout.size) if seg[r + 1] > seg[r]]
        if reqs:
            self._mpi.Request.Waitall(reqs)
        return out

    def broadcast(self, value, phase: str, shape, dtype=np.float64) -> np.ndarray:
        """Server sends ``value`` to every client (counted once per client)."""
        return self.net.broadcast_from_server(value, phase, shape, dtype)

    def totals(self) -> tuple[int, int]:
        """This rank's (client bytes, server bytes) so far, all phases."""
        return int(self.ledger.client_bytes().sum()), self.ledger.server_bytes()

    def reduce_sum(self, arr: np.ndarray) -> np.ndarray | None:
        """Sum over ranks onto the server (evaluation only, not protocol traffic)."""
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        if self.layout.size == 1:
            return arr
        out = np.empty_like(arr) if self.is_server else None
        self.comm.Reduce(arr, out, op=self._mpi.SUM, root=0)
        return out

    def allreduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """Sum over ranks on every rank (the adversary's side channel, not counted)."""
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        if self.layout.size == 1:
            return arr
        out = np.empty_like(arr)
        self.comm.Allreduce(arr, out, op=self._mpi.SUM)
        return out


def make_link(n_clients: int, comm=None) -> StarLink:
    """A :class:`StarLink` over ``comm`` (default: COMM_WORLD; one rank = single process)."""
    from fedring.comm import Layout, Network

    return StarLink(Network(Layout(n_clients, comm)))


# --------------------------------------------------------------------------------------
# One Monte Carlo trial (spec Algorithm 7) with common random numbers across methods
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row of a table: calibration attack, method, M, filter rule (None for FCP)."""

    attack: str
    method: str
    shared: int
    rule: str | None

    @property
    def label(self) -> str:
        rule = f"/{self.rule}" if self.rule and self.rule != "known" else ""
        return f"{self.attack}/{self.method}{rule}/M={self.shared}"


_CASE_FIELDS = ("coverage", "width", "q", "msd", "tp", "fp",
                "bytes_train_up", "bytes_train_down", "bytes_calib_up", "bytes_calib_down")


def _scores(env: Environment, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (7) on the hosted clients' calibration data, and the test residuals."""
    cal = np.abs(env.y_cal - np.einsum("kjd,d->kj", env.x_cal, w))
    test = np.abs(env.y_test - np.einsum("kjd,d->kj", env.x_test, w))
    return cal, test


def _reported(cfg: PrismConfig, env: Environment, cal: np.ndarray, attack, seed: int, trial: int,
              link: StarLink) -> np.ndarray:
    """Algorithm 2: the scores the hosted clients report (Byzantine ones attacked)."""
    rep = cal.copy()
    if attack is None:
        return rep
    byz_local = env.byzantine[env.lo:env.hi]
    benign_mean = None
    if isinstance(attack, CoverageAttack) and cfg.coverage_mean == "benign":
        s = link.allreduce_sum(np.array([cal[~byz_local].sum(), cal[~byz_local].size]))
        benign_mean = s[0] / max(s[1], 1.0)
    for j in np.flatnonzero(byz_local):
        rng = _rng(seed, trial, STREAM_CALIB, env.lo + j)
        rep[j] = attack(rep[j:j + 1], rng, benign_mean)[0]
    return rep


def _calibrate_case(cfg: PrismConfig, case: Case, env: Environment, rep: np.ndarray,
                    link: StarLink) -> tuple[float, np.ndarray | None]:
    """Server-side calibration of one case over the network; q on every rank, flags on rank 0."""
    K = cfg.n_clients
    flagged = np.zeros(K, dtype=bool)
    if case.rule is not None:
        r_max = cfg.r_max
        if r_max is None:
            local_max = rep.max(axis=1, keepdims=True) if rep.shape[1] else np.zeros((rep.shape[0], 1))
            maxima = link.net.gather_to_server(local_max, "calib_up")
            r_max = float(link.broadcast(maxima.max() if link.is_server else None, "calib_down", (1,))[0])
        v = link.net.gather_to_server(characterization_vectors(rep, r_max, cfg.bins), "calib_up")
        verdict = None
        if link.is_server:
            flagged, _ = filter_clients(v, np.full(K, rep.shape[1] > 0), case.rule, cfg.n_byzantine,
                                        cfg.mad_scale, cfg.mad_threshold)
            verdict = flagged.astype(np.uint8)
        flagged = link.broadcast(verdict, "calib_down", (K,), np.uint8).astype(bool)
    kept = np.flatnonzero(~flagged)
    mine = kept[(kept >= env.lo) & (kept < env.hi)] - env.lo
    pool = link.gather(kept, rep[mine], "calib_up")
    q = split_conformal_quantile(pool, cfg.alpha) if link.is_server else None
    q = float(link.broadcast(q, "calib_down", (1,))[0])
    return q, flagged


def run_trial(cfg: PrismConfig, cases: list[Case], seed: int, trial: int, link: StarLink,
              data=None) -> dict[str, np.ndarray] | None:
    """Algorithm 7 for every case with common random numbers: one environment; one training
    per distinct M (shared by every attack and by Rob-FCP/FCP); per case the attacked
    scores, calibration and metrics. Returns on rank 0 ``{field: (C,) array, 'flagged':
    (C, K)}``; None on other ranks."""
    lo, hi = link.lo, link.hi
    env = (synthetic_environment(cfg, seed, trial, lo, hi) if cfg.dataset == "synthetic"
           else uci_environment(cfg, data, seed, trial, lo, hi))
    parts = participants(cfg, seed, trial)
    C, K = len(cases), cfg.n_clients
    local = np.zeros((C, 8))  # covered, tested, sq_err, n_err, calib up/down bytes, train up/down
    q = np.zeros(C)
    flags = np.zeros((C, K), dtype=bool)
    msd: dict[int, float] = {}
    eval_mask = np.ones(hi - lo, dtype=bool) if cfg.coverage_on == "all" else ~env.byzantine[lo:hi]
    for shared in sorted({c.shared for c in cases}):
        tr = train_psofed(cfg, env, shared, link, seed, trial, parts)
        if link.is_server and env.w_star is not None:
            msd[shared] = float(((tr.w - env.w_star) ** 2).mean())
        u0, d0 = link.totals()
        w = link.broadcast(tr.w, "calib_down", (cfg.dim,))
        cal, test = _scores(env, w)
        model_up, model_down = np.subtract(link.totals(), (u0, d0))
        sq = float((test[eval_mask] ** 2).sum())
        for attack_name in sorted({c.attack for c in cases if c.shared == shared}):
            rep = _reported(cfg, env, cal, make_calib_attack(attack_name, cfg), seed, trial, link)
            for ci, case in enumerate(cases):
                if case.shared != shared or case.attack != attack_name:
                    continue
                u0, d0 = link.totals()
                q[ci], flags[ci] = _calibrate_case(cfg, case, env, rep, link)
                u1, d1 = link.totals()
                local[ci] = (np.count_nonzero(test[eval_mask] <= q[ci]), test[eval_mask].size, sq,
                             test[eval_mask].size, u1 - u0 + model_up, d1 - d0 + model_down,
                             tr.bytes_up, tr.bytes_down)
    total = link.reduce_sum(local)
    if not link.is_server:
        return None
    byz = env.byzantine
    out = {
        "coverage": total[:, 0] / total[:, 1],
        "width": 2.0 * q * env.y_scale,
        "q": q,
        "tp": (flags & byz).sum(axis=1).astype(np.float64),
        "fp": (flags & ~byz).sum(axis=1).astype(np.float64),
        "bytes_calib_up": total[:, 4],
        "bytes_calib_down": total[:, 5],
        "bytes_train_up": total[:, 6],
        "bytes_train_down": total[:, 7],
        "flagged": flags,
    }
    if env.w_star is not None:
        out["msd"] = np.array([msd[c.shared] for c in cases])
    else:
        out["msd"] = total[:, 2] / total[:, 3]
    return out


# --------------------------------------------------------------------------------------
# Many trials, summaries, the paper's tables
# --------------------------------------------------------------------------------------

#: Table I of the paper (synthetic): (attack, method) -> (coverage %, std, width, std).
PAPER_TABLE_I = {
    ("efficiency", "prism"): (90.0, 0.1, 0.91, 0.13), ("efficiency", "robfcp"): (90.0, 0.1, 1.68, 0.28),
    ("efficiency", "fcp"): (87.5, 0.2, 1.58, 0.25), ("coverage", "prism"): (90.0, 0.1, 0.91, 0.13),
    ("coverage", "robfcp"): (90.0, 0.1, 1.68, 0.28), ("coverage", "fcp"): (100.0, 0.0, 7.67, 1.23),
    ("random", "prism"): (90.0, 0.1, 0.91, 0.13), ("random", "robfcp"): (90.0, 0.1, 1.68, 0.28),
    ("random", "fcp"): (91.9, 0.6, 1.87, 0.27),
}
PAPER_MSE_DB = {"prism": -26.4, "robfcp": -21.4}

#: Table II of the paper (UCI, widths in K): (attack, method, M) -> (coverage %, std, width, std).
PAPER_TABLE_II = {}
for _att, _rows in {
    "efficiency": [(20, 90.0, 0.1, 64.09, 1.25), (40, 90.0, 0.1, 66.43, 1.99), (60, 90.0, 0.2, 69.87, 2.81),
                   (81, 90.0, 0.2, 74.33, 4.37), ("robfcp", 90.0, 0.2, 74.33, 4.37), ("fcp", 87.5, 0.2, 69.36, 4.10)],
    "coverage": [(20, 90.0, 0.1, 64.09, 1.25), (40, 90.0, 0.1, 66.43, 1.99), (60, 90.0, 0.2, 69.87, 2.81),
                 (81, 90.0, 0.2, 74.33, 4.37), ("robfcp", 90.0, 0.2, 74.33, 4.37), ("fcp", 100.0, 0.0, 364.98, 22.33)],
    "random": [(20, 90.0, 0.1, 64.33, 1.28), (40, 90.0, 0.1, 66.66, 2.04), (60, 90.0, 0.2, 70.09, 2.86),
               (81, 90.0, 0.2, 74.52, 4.39), ("robfcp", 90.0, 0.2, 74.52, 4.39), ("fcp", 91.7, 0.3, 78.43, 4.17)],
}.items():
    for _key, *_vals in _rows:
        _k = (_att, "prism", _key) if isinstance(_key, int) else (_att, _key, 81)
        PAPER_TABLE_II[_k] = tuple(_vals)


def table_cases(cfg: PrismConfig) -> list[Case]:
    """Table I (synthetic) or Table II (UCI) rows, plus PRISM-FCP with the MAD rule."""
    attacks = ("efficiency", "coverage", "random")
    D = cfg.dim
    prism_ms = (cfg.shared,) if cfg.dataset == "synthetic" else (20, 40, 60, 81)
    cases = []
    for a in attacks:
        cases += [Case(a, "prism", m, "known") for m in prism_ms]
        cases += [Case(a, "robfcp", D, "known"), Case(a, "fcp", D, None)]
        cases += [Case(a, "prism", prism_ms[0], "mad")]
    return cases


def summarize(records: list[dict], cases: list[Case]) -> list[dict]:
    """Mean and standard deviation over trials per case (coverage in %, MSE averaged then dB)."""
    out = []
    for i, c in enumerate(cases):
        col = {k: np.array([r[k][i] for r in records]) for k in _CASE_FIELDS}
        out.append({
            "case": c, "trials": len(records),
            "coverage": 100 * col["coverage"].mean(), "coverage_std": 100 * col["coverage"].std(),
            "width": col["width"].mean(), "width_std": col["width"].std(),
            "mse_db": 10 * math.log10(col["msd"].mean()) if col["msd"].mean() > 0 else -math.inf,
            "tp": col["tp"].mean(), "fp": col["fp"].mean(),
            "bytes_train_up": col["bytes_train_up"].mean(), "bytes_train_down": col["bytes_train_down"].mean(),
            "bytes_calib_up": col["bytes_calib_up"].mean(), "bytes_calib_down": col["bytes_calib_down"].mean(),
        })
    return out


def format_table(cfg: PrismConfig, summary: list[dict], seed: int, standin: bool = False) -> str:
    """The paper's table layout, our numbers beside the paper's."""
    synthetic = cfg.dataset == "synthetic"
    unit = "" if synthetic else " (K)"
    lines = []
    if synthetic:
        lines.append("TABLE I: Marginal coverage and average interval width under different Byzantine attacks")
        lines.append(f"(K={cfg.n_clients} clients, |S_B|={cfg.n_byzantine} Byzantine, D={cfg.dim}, alpha={cfg.alpha})")
    else:
        lines.append(f"TABLE II: Evaluation results on the UCI Superconductivity dataset with D={cfg.dim}"
                     + ("  [STAND-IN data of the file's shape: compare structure, not values]" if standin else ""))
    trials = summary[0]["trials"] if summary else 0
    lines.append(f"profile {cfg.profile}: mu={cfg.step}, byz_persist={cfg.byz_persist}, "
                 f"local_updates={cfg.local_updates}, sigma_C^2={cfg.random_var}; {trials} trials, seed {seed}; "
                 f"coverage on {cfg.coverage_on} clients' test data")
    head = (f"{'Attack':<11}{'Method':<11}{'M/D':>5}  {'Coverage (%)':>13}  {'Interval Width' + unit:>18}"
            f"  | {'paper: Coverage':>15}  {'Width':>15}")
    lines += [head, "-" * len(head)]
    last = None
    for s in summary:
        c = s["case"]
        if c.rule == "mad":
            continue
        key = (c.attack, c.method) if synthetic else (c.attack, c.method, c.shared)
        paper = (PAPER_TABLE_I if synthetic else PAPER_TABLE_II).get(key)
        ptxt = f"{paper[0]:>9.1f} ± {paper[1]:.1f}  {paper[2]:>8.2f} ± {paper[3]:.2f}" if paper else ""
        lines.append(f"{(c.attack.capitalize() if c.attack != last else ''):<11}{METHOD_LABEL[c.method]:<11}"
                     f"{c.shared / cfg.dim:>5.2f}  {s['coverage']:>7.1f} ± {s['coverage_std']:.1f}  "
                     f"{s['width']:>10.2f} ± {s['width_std']:.2f}  | {ptxt}")
        last = c.attack
    lines.append("")
    first = [s for s in summary if s["case"].attack == summary[0]["case"].attack and s["case"].rule != "mad"]
    mse = ", ".join(f"{METHOD_LABEL[s['case'].method]} M/D={s['case'].shared / cfg.dim:.2f}: {s['mse_db']:.1f} dB"
                    for s in first if s["case"].method != "fcp")
    kind = "per-coordinate parameter MSE ||w-w*||^2/D" if synthetic else "test MSE (normalized target)"
    lines.append(f"Training {kind}: {mse}"
                 + ("   (paper: PRISM-FCP -26.4 dB, Rob-FCP -21.4 dB)" if synthetic else ""))
    full = next((s for s in first if s["case"].shared == cfg.dim), None)
    for s in first:
        if full and s["case"].method == "prism" and full["bytes_train_up"] > 0:
            lines.append(f"Training traffic, measured: PRISM-FCP M/D={s['case'].shared / cfg.dim:.2f} "
                         f"uplink {s['bytes_train_up'] / 1e6:.3f} MB, downlink {s['bytes_train_down'] / 1e6:.3f} MB "
                         f"per trial = {s['bytes_train_up'] / full['bytes_train_up']:.3f} x full sharing")
    det = []
    for s in summary:
        c = s["case"]
        if c.method == "prism" and c.shared == min(x["case"].shared for x in summary if x["case"].method == "prism"):
            det.append(f"{c.attack}/{c.rule}: TP {s['tp']:.2f} FP {s['fp']:.2f} "
                       f"(cov {s['coverage']:.1f}%)")
    lines.append(f"Detection of the {cfg.n_byzantine} Byzantine clients (PRISM-FCP, mean per trial): " + "; ".join(det))
    lines.append("(paper: known |S_B| 20/20 TP, 0 FP for all attacks; MAD 100% recall, ~1 FP, coverage 90%)")
    return "\n".join(lines)


def run_trials(cfg: PrismConfig, cases: list[Case], trials: int, seed: int, link: StarLink, data=None,
               on_trial=None) -> list[dict] | None:
    """``trials`` trials; ``on_trial(t, record)`` is called on rank 0 after each."""
    records = []
    for t in range(trials):
        rec = run_trial(cfg, cases, seed, t, link, data)
        if link.is_server:
            records.append(rec)
            if on_trial is not None:
                on_trial(t, rec)
    return records if link.is_server else None


# --------------------------------------------------------------------------------------
# Command line: python -m fedring conformal prism ...
# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from fedring.cli.run import ArgumentParser

    p = ArgumentParser(prog="python -m fedring conformal prism",
                       description="PRISM-FCP, Rob-FCP and FCP (Lari, Arablouei, Werner 2026) over MPI; "
                                   "per-trial results stream to HDF5 under /calibration/.")
    add = p.add_argument
    add("--method", choices=METHODS, default="prism", help="prism (M < D, filter), robfcp (M = D, filter), fcp (M = D)")
    add("--calib-attack", dest="calib_attack", choices=CALIB_ATTACKS, default="none")
    add("--trials", type=int, default=1, metavar="T")
    add("--seed", type=int, default=0, metavar="S")
    add("--out", metavar="F.h5", help="HDF5 results (default: none for --table, else results/prism-<method>-<attack>-s<S>.h5)")
    add("--overwrite", action="store_true")
    add("--dataset", choices=tuple(_DATASET_DEFAULTS), default="synthetic")
    add("--data-dir", dest="data_dir", metavar="DIR", help="folder holding the UCI train.csv")
    add("--standin", action="store_true", help="UCI: generate a stand-in train.csv of the real file's shape")
    add("--profile", choices=tuple(PROFILES), help="mu / A5 / A6 / sigma_C choices (default paper-fit; uci for UCI)")
    add("--table", action="store_true", help="reproduce Table I (synthetic) or Table II (uci) and print it")
    add("--quiet", action="store_true")
    for flag, typ, dest, meta, text in [
        ("--clients", int, "n_clients", "K", "clients (100)"),
        ("--participants", int, "participants", "P", "|S_n| (10; UCI 20)"),
        ("--dim", int, "dim", "D", "synthetic dimension (50)"),
        ("--shared", int, "shared", "M", "coordinates shared by PRISM-FCP (15; UCI 20)"),
        ("--step", float, "step", "MU", "LMS step size (profile)"),
        ("--iterations", int, "iterations", "N", "training iterations (1000)"),
        ("--byzantine", int, "n_byzantine", "B", "|S_B| (20)"),
        ("--attack-prob", float, "attack_prob", "P_A", "training attack probability (0.25)"),
        ("--attack-var", float, "attack_var", "S2", "training noise variance sigma_B^2 (0.1)"),
        ("--byz-persist", str, "byz_persist", "MODE", "none | sent | full (profile)"),
        ("--mask-scheme", str, "mask_scheme", "S", "random | roundrobin"),
        ("--calib-samples", int, "calib_samples", "N", "calibration samples per client (1000)"),
        ("--test-samples", int, "test_samples", "N", "test samples per client (1000)"),
        ("--bins", int, "bins", "H", "histogram bins (100)"),
        ("--alpha", float, "alpha", "A", "miscoverage (0.1)"),
        ("--filter", str, "filter", "RULE", "known | mad"),
        ("--r-max", float, "r_max", "R", "histogram normaliser (default: largest reported score)"),
        ("--coverage-factor", float, "coverage_factor", "F", "coverage attack multiple (10)"),
        ("--coverage-mean", str, "coverage_mean", "WHOSE", "own | benign"),
        ("--random-var", float, "random_var", "S2", "random attack variance sigma_C^2 (profile)"),
        ("--coverage-on", str, "coverage_on", "WHO", "benign | all clients' test data"),
    ]:
        add(flag, type=typ, dest=dest, metavar=meta, help=text)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--local-updates", dest="local_updates", action="store_const", const=True,
                   help="clients outside S_n also take LMS steps (A5)")
    g.add_argument("--no-local-updates", dest="local_updates", action="store_const", const=False)
    return p


_CFG_KEYS = ("n_clients", "participants", "dim", "shared", "step", "iterations", "n_byzantine", "attack_prob",
             "attack_var", "byz_persist", "mask_scheme", "calib_samples", "test_samples", "bins", "alpha", "filter",
             "r_max", "coverage_factor", "coverage_mean", "random_var", "coverage_on", "local_updates", "data_dir")


def _setup(argv: list[str], comm) -> tuple:
    """Parse and validate everything (on every rank alike) before any work."""
    args = _parser().parse_args(argv)
    if args.trials < 1:
        raise ConfigError("trials", f"must be >= 1, got {args.trials}")
    if args.seed < 0:
        raise ConfigError("seed", f"must be >= 0, got {args.seed}")
    overrides = {k: getattr(args, k) for k in _CFG_KEYS}
    standin_dir = None
    if args.dataset == "uci" and args.standin:
        if args.data_dir:
            raise ConfigError("standin", "give either --data-dir or --standin, not both")
        import tempfile

        standin_dir = tempfile.mkdtemp(prefix="fedring-uci-standin-") if comm.rank == 0 else None
        standin_dir = comm.bcast(standin_dir, root=0)
        overrides["data_dir"] = standin_dir
    cfg = make_config(args.dataset, args.profile, **overrides)
    if cfg.dataset == "uci" and standin_dir is None:
        from fedring.datasets_uci import superconductivity_file

        superconductivity_file(cfg.data_dir)
    if cfg.n_clients < comm.size:
        raise ConfigError("clients", f"{cfg.n_clients} clients cannot fill {comm.size} MPI ranks")
    out = args.out
    if out is None and not args.table:
        out = f"results/prism-{args.method}-{args.calib_attack}-s{args.seed}.h5"
    if out is not None and Path(out).exists() and not args.overwrite:
        raise ConfigError("out", f"{out} exists; pass --overwrite to replace it")
    if args.table:
        cases = table_cases(cfg)
    else:
        rule = None if args.method == "fcp" else cfg.filter
        cases = [Case(args.calib_attack, args.method, cfg.method_shared(args.method), rule)]
    return args, cfg, cases, out, standin_dir


def _load_data(cfg: PrismConfig, standin_dir: str | None, seed: int, comm):
    if cfg.dataset != "uci":
        return None
    from fedring.datasets_uci import load_superconductivity, write_standin_csv

    if standin_dir is not None:
        if comm.rank == 0:
            write_standin_csv(Path(standin_dir) / "train.csv", np.random.default_rng([seed, 9999]))
        comm.Barrier()
    return load_superconductivity(cfg.data_dir)


def main(argv: list[str]) -> int:
    """``python -m fedring conformal prism [options]`` (see ``--help``); returns the exit code.

    Runs ``--trials`` trials of one case (``--method``, ``--calib-attack``) or, with
    ``--table``, every row of the paper's Table I (synthetic) / Table II (``--dataset uci``)
    and prints the table beside the paper's numbers. Rank 0 writes (when ``--out`` is set;
    by default for a single case) one HDF5 file::

        /                       attrs: config (JSON), status (running | complete | failed),
                                       rounds_completed (= trials done), world_size, n_clients
        /calibration            attrs: cases (JSON list: attack, method, shared, rule, label)
        /calibration/<field>    (trials, cases): coverage, width, q, msd, mse_db, tp, fp,
                                bytes_train_up, bytes_train_down, bytes_calib_up, bytes_calib_down
        /calibration/flagged    (trials, cases, clients) uint8

    appending and flushing one row per trial. Bad settings exit with code 2 before any work.
    """
    from mpi4py import MPI

    from fedring.results import ResultsFile
    from fedring.runtime import Watchdog, agree_on_config_error

    comm = MPI.COMM_WORLD
    error = setup = None
    try:
        setup = _setup(argv, comm)
    except ConfigError as e:
        error = e
    try:
        agree_on_config_error(comm, error)
    except SystemExit as e:
        return int(e.code)
    args, cfg, cases, out, standin_dir = setup
    guard = Watchdog.start()

    def job() -> int:
        data = _load_data(cfg, standin_dir, args.seed, comm)
        link = make_link(cfg.n_clients, comm)
        results = None
        if comm.rank == 0 and out is not None:
            conf = {**asdict(cfg), "seed": args.seed, "trials": args.trials, "method": args.method,
                    "calib_attack": args.calib_attack, "table": args.table, "world_size": comm.size}
            results = ResultsFile(out, {"config": json.dumps(conf, sort_keys=True), "world_size": comm.size,
                                        "n_clients": cfg.n_clients}, overwrite=args.overwrite)
            results.h5.require_group("calibration").attrs["cases"] = json.dumps(
                [asdict(c) | {"label": c.label} for c in cases])
            guard.on_abort.append(results.close)
        quiet = args.quiet or comm.rank != 0

        def on_trial(t: int, rec: dict) -> None:
            if results is not None:
                rows = {f"calibration/{k}": rec[k] for k in _CASE_FIELDS}
                rows["calibration/mse_db"] = 10 * np.log10(rec["msd"])
                rows["calibration/flagged"] = rec["flagged"].astype(np.uint8)
                results.append_round({}, rows, rounds_completed=t + 1)
            if not quiet and not args.table:
                c = cases[0]
                print(f"trial {t + 1}/{args.trials}  {METHOD_LABEL[c.method]} M/D={c.shared / cfg.dim:.2f} "
                      f"attack={c.attack}  coverage {100 * rec['coverage'][0]:.2f}%  width {rec['width'][0]:.4g}  "
                      f"MSE {10 * np.log10(rec['msd'][0]):.1f} dB  flagged TP {rec['tp'][0]:.0f} FP {rec['fp'][0]:.0f}  "
                      f"train bytes up {rec['bytes_train_up'][0]:.0f} down {rec['bytes_train_down'][0]:.0f}", flush=True)
            elif not quiet and (t + 1) % 10 == 0:
                print(f"trial {t + 1}/{args.trials}", file=sys.stderr, flush=True)

        records = run_trials(cfg, cases, args.trials, args.seed, link, data, on_trial)
        if comm.rank == 0:
            summary = summarize(records, cases)
            if args.table:
                print(format_table(cfg, summary, args.seed, standin=standin_dir is not None), flush=True)
            elif not args.quiet and args.trials > 1:
                s = summary[0]
                print(f"mean over {args.trials} trials: coverage {s['coverage']:.2f} ± {s['coverage_std']:.2f}%  "
                      f"width {s['width']:.4g} ± {s['width_std']:.2g}  MSE {s['mse_db']:.1f} dB  "
                      f"TP {s['tp']:.2f} FP {s['fp']:.2f}", flush=True)
            if results is not None:
                results.close("complete")
                if not args.quiet:
                    print(f"results: {out}", flush=True)
        return 0

    try:
        return guard.run(job)
    finally:
        if standin_dir is not None and comm.rank == 0:
            import shutil

            shutil.rmtree(standin_dir, ignore_errors=True)
