"""SignGuard (Xu, Huang, Song, Lan, ICDCS 2022), as FLPoison's ``aggregators/signguard.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice, integer, real

from ._clustering import (
    dbscan_labels,
    kmeans_labels,
    largest_cluster,
    meanshift_labels,
    require_sklearn,
)
from ._kernels import combine, row_stats
from .base import AggregateResult, Aggregator, register

CLUSTERINGS = ("dbscan", "meanshift", "kmeans")


def sign_features(window: np.ndarray) -> np.ndarray:
    r"""(n, 3) float32 sign statistics of a window of b coordinates: the fractions of positive, zero
    and negative values of each row, each column divided by its maximum (plus 1e-8), in float32
    as SignGuard's and FLPoison's code.

    >>> sign_features(np.array([[1., 2., -1., 0.], [-1., -2., -3., 4.]]))
    array([[1.        , 1.        , 0.33333334],
           [0.5       , 0.        , 1.        ]], dtype=float32)
    """
    b = window.shape[1]
    out = np.empty((window.shape[0], 3), np.float32)
    for k, mask in enumerate((window > 0, window == 0, window < 0)):
        frac = mask.sum(axis=1, dtype=np.float32) / np.float32(b)
        out[:, k] = frac / (frac.max() + np.float32(1e-8))
    return out


@register
class SignGuard(Aggregator):
    r"""SignGuard: norm filtering, then the majority cluster of sign statistics; the mean of the
    survivors clipped to the median norm.

    Runs on the host: scikit-learn clusters the clients' sign statistics.

    With :math:`M = \mathrm{median}_j \|x_j\|`:

    1. :math:`S_1 = \{i : L M < \|x_i\| < R M\}`.
    2. On a random window of :math:`b = \lfloor \mathrm{fraction}\cdot d\rfloor` consecutive
       coordinates (its start uniform in :math:`0..\lfloor(1 - \mathrm{fraction})d\rfloor`),
       each client's fractions of positive, zero and negative values, each divided by its
       maximum over the clients (``sign_features``), are clustered; :math:`S_2` is the most
       populous cluster (ties to the lower label; empty if every client is noise).
    3. :math:`\frac{1}{|S|}\sum_{i \in S} x_i \min(1, M / \|x_i\|)`, :math:`S = S_1 \cap S_2`;
       the zero vector if S is empty.

    Xu et al., "SignGuard: Byzantine-robust Federated Learning through Collaborative Malicious
    Gradient Filtering", ICDCS 2022 (arXiv:2109.05872); the defaults are FLPoison's
    (DBSCAN with eps 0.05 and 3 samples; the authors' code uses mean shift).

    Parameters
    ----------
    lower, upper : float
        L and R of the norm filter (0.1, 3.0).
    fraction : float in (0, 1]
        Share of the coordinates in the window (0.1), at least one coordinate.
    clustering : {"dbscan", "meanshift", "kmeans"}
        DBSCAN (FLPoison's default), mean shift with an estimated bandwidth (the authors'
        ``signguard_multiclass``), or 2-means from random state 0 (FLPoison's option).
    eps, min_samples :
        DBSCAN's radius and core size (0.05, 3; the authors' DBSCAN branch uses 2).

    selected: 1 for the clients averaged.

    Examples
    --------
    The window holds the only coordinate (``fraction=1``): four clients are positive there, the
    fifth is negative and falls out of the majority cluster; the median norm is 1, so the
    client of norm 2 is clipped to norm 1 before the mean of the four:

    >>> X = np.array([[1.], [0.5], [2.], [1.], [-1.]])
    >>> SignGuard(fraction=1.0)(X)
    array([0.875])
    """

    name = "signguard"
    selects = True

    def __init__(
        self,
        f: int = 0,
        *,
        lower: float = 0.1,
        upper: float = 3.0,
        fraction: float = 0.1,
        clustering: str = "dbscan",
        eps: float = 0.05,
        min_samples: int = 3,
    ):
        super().__init__(f)
        self.lower = real("signguard.lower", lower, lo=0.0)
        self.upper = real("signguard.upper", upper, lo=0.0, lo_open=True)
        self.fraction = real("signguard.fraction", fraction, 0.0, 1.0, lo_open=True)
        self.clustering = choice("signguard.clustering", clustering, CLUSTERINGS)
        self.eps = real("signguard.eps", eps, lo=0.0, lo_open=True)
        self.min_samples = integer("signguard.min_samples", min_samples, lo=1)
        require_sklearn(self.name)

    def window(self, rng: np.random.Generator, d: int) -> tuple[int, int]:
        """(start, b): the random window of the sign statistics, the rule's only draw."""
        b = max(1, int(self.fraction * d))
        return int(rng.integers(0, int((1 - self.fraction) * d) + 1)), b

    def labels(self, features: np.ndarray) -> np.ndarray:
        if self.clustering == "dbscan":
            return dbscan_labels(features, self.eps, self.min_samples)
        if self.clustering == "meanshift":
            return meanshift_labels(features)
        return kmeans_labels(features)

    def select(self, X: np.ndarray, start: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(kept, clip factors min(1, M/||x_i||)) for the window starting at ``start``."""
        norms = np.sqrt(row_stats(X)[0])
        med = float(np.median(norms))
        s1 = (norms > self.lower * med) & (norms < self.upper * med)
        s2 = largest_cluster(self.labels(sign_features(X[:, start : start + b])))
        keep = s1 & s2
        factor = np.zeros(len(norms))
        factor[keep] = np.minimum(1.0, med / norms[keep])
        return keep, factor

    def _aggregate(self, X, state, reference, rng):
        keep, factor = self.select(X, *self.window(rng, X.shape[1]))
        if not keep.any():
            return AggregateResult(np.zeros(X.shape[1], X.dtype), keep.astype(float))
        return AggregateResult(combine(factor, X) / int(keep.sum()), keep.astype(float))
