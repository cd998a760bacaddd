"""FLAME (Nguyen et al., USENIX Security 2022), as FLPoison's ``aggregators/flame.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import real

from ._clustering import cosine_distances, inner_products, require_sklearn, sklearn_cluster
from ._kernels import combine
from .base import AggregateResult, Aggregator, register


def hdbscan_labels(D: np.ndarray, min_cluster_size: int, min_samples: int = 1) -> np.ndarray:
    """scikit-learn's HDBSCAN on the precomputed distances D with ``allow_single_cluster``, FLAME's call."""
    cluster = sklearn_cluster().HDBSCAN(
        metric="precomputed",
        min_cluster_size=min_cluster_size,
        min_samples=min_samples,
        allow_single_cluster=True,
        copy=True,
    )
    return cluster.fit(D).labels_


@register
class FLAME(Aggregator):
    r"""FLAME: admit the majority cluster of cosine distances (HDBSCAN), clip to the median norm,
    average, add Gaussian noise.

    Runs on the host: scikit-learn's HDBSCAN clusters the clients.

    1. HDBSCAN on the cosine distances :math:`1 - \cos(x_i, x_j)` with minimum cluster size
       :math:`\lfloor n/2\rfloor + 1`, ``min_samples = 1`` and a single cluster allowed: the
       clients of cluster 0 (the only cluster such a size permits) are admitted.
    2. :math:`S = \mathrm{median}_i \|x_i\|` over every client; each admitted row is scaled by
       :math:`\min(1, S / (\|x_i\| + 10^{-6}))` (FLPoison's ``normclipping``), and averaged.
    3. :math:`+\,\mathcal N(0, \sigma^2 I)` with :math:`\sigma = \lambda S` (the paper's
       clipping bound times a noise level), drawn from the round's ``rng``.

    When no client is admitted (every one is noise) the mean is the zero vector; the noise is
    still added. Nguyen et al., "FLAME: Taming Backdoors in Federated Learning", USENIX
    Security 2022.

    Parameters
    ----------
    noise : float
        :math:`\lambda`, the noise level relative to the clipping bound (0.001; 0 turns the
        noise off). The noise is added to the aggregated gradient, so the model moves by
        ``lr`` times it: with S the median norm of the uploads, the model's noise is λ times
        the median norm of the model updates, as in the paper.

    selected: 1 for the admitted clients.

    Examples
    --------
    Four clients near the direction (1, 1), a fifth opposite: the cluster of at least three
    admits the four; the median norm is 1.78 (that of (1.1, 1.4)), so (2, 2) is clipped to
    about (1.26, 1.26), and without noise the mean is about (0.965, 1.065):

    >>> X = np.array([[1., 1.], [2., 2.], [0.5, 0.6], [1.1, 1.4], [-3., -3.]])
    >>> FLAME(noise=0.0)(X).round(6)
    array([0.964742, 1.064742])
    """

    name = "flame"
    selects = True

    def __init__(self, f: int = 0, *, noise: float = 0.001):
        super().__init__(f)
        self.noise = real("flame.noise", noise, lo=0.0)
        require_sklearn(self.name)

    def check(self, n):
        if n < 2:
            return f"flame clusters the clients (a cluster of at least n // 2 + 1) and needs n >= 2, got n={n}"
        return super().check(n)

    def clipped_mean(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """The deterministic part: (mean of the admitted rows clipped to the median norm, admitted, S)."""
        n, d = X.shape
        G = inner_products(X)
        norms = np.sqrt(np.maximum(np.diag(G), 0.0))
        admitted = hdbscan_labels(cosine_distances(G), n // 2 + 1) == 0
        med = float(np.median(norms))
        factor = np.where(admitted, np.minimum(1.0, med / (norms + 1e-6)), 0.0)
        mean = combine(factor, X) / int(admitted.sum()) if admitted.any() else np.zeros(d, X.dtype)
        return mean, admitted, med

    def _aggregate(self, X, state, reference, rng):
        mean, admitted, med = self.clipped_mean(X)
        z = rng.standard_normal(X.shape[1])
        if self.noise > 0:
            mean = mean + (self.noise * med * z).astype(X.dtype)
        return AggregateResult(mean, admitted.astype(float))
