"""Clipped clustering (Li, Ngai, Voigt, IEEE TBD 2023), as Blades' ``blades/aggregators/clippedclustering.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice, integer, real

from ._clustering import cosine_distances, inner_products, require_sklearn, sklearn_cluster
from ._kernels import combine
from .base import AggregateResult, Aggregator, register


@register
class ClippedClustering(Aggregator):
    r"""Clipped clustering: clip to the median of every norm seen so far, split the clients in two
    by agglomerative clustering of their cosine distances, average the larger group.

    Runs on the host: scikit-learn's agglomerative clustering splits the clients.

    Each round the clients' norms join the history H of norms, :math:`\tau = \min(\mathrm{median}(H),
    \tau_{\max})`, and a row longer than :math:`\tau` is scaled by :math:`\tau / (\|x_i\| + 10^{-6})`
    (Blades' ``clip_tensor_norm_``). The cosine distances :math:`1 - \cos(x_i, x_j)` of the
    clipped rows go to scikit-learn's ``AgglomerativeClustering(n_clusters=2, metric="precomputed")``;
    the output is the mean of the clipped rows of cluster 1 if it has more than n // 2 members,
    else of cluster 0 (Blades' rule).

    Li, Ngai, Voigt, "An Experimental Study of Byzantine-Robust Aggregation Schemes in Federated
    Learning", IEEE Transactions on Big Data 2023.

    Parameters
    ----------
    tau : float
        :math:`\tau_{\max}`, the largest clipping threshold (1e5, Blades' ``max_tau``).
    linkage : {"average", "single"}
        Agglomerative linkage (``average``, Blades' default).
    history : int
        Rounds of norms kept (1000): Blades keeps every norm ever seen; fedring keeps the
        last ``history * n`` norms in a fixed array that the checkpoint saves, which is the
        same for the first ``history`` rounds.

    State: ``norms`` (the norm history, a ring buffer, NaN where unused), ``count`` (norms seen).
    selected: 1 for the clients averaged.

    Examples
    --------
    Blades' unit test (``fedlib/aggregators/tests/test_clippedclustering.py``): the median of the
    norms 3.742, 4.243, 4.123, 4.359 is 4.183, so rows 1 and 3 are clipped; the clustering sets
    row 1 apart, and the mean of the other three is Blades' [1.9596, 1.6532, 2.9596]:

    >>> X = np.array([[1., 2, 3], [-1, 4, -1], [2, 2, 3], [3, 1, 3]])
    >>> ClippedClustering()(X)
    array([1.95961669, 1.65320556, 2.95961669])
    """

    name = "clippedclustering"
    selects = True

    def __init__(self, f: int = 0, *, tau: float = 1e5, linkage: str = "average", history: int = 1000):
        super().__init__(f)
        self.tau = real("clippedclustering.tau", tau, lo=0.0, lo_open=True)
        self.linkage = choice("clippedclustering.linkage", linkage, ("average", "single"))
        self.history = integer("clippedclustering.history", history, lo=1)
        require_sklearn(self.name)

    def check(self, n):
        if n < 2:
            return f"clippedclustering splits the clients into two clusters and needs n >= 2, got n={n}"
        return super().check(n)

    def init_state(self, n, d):
        return {"norms": np.full(self.history * max(n, 1), np.nan), "count": np.zeros((), np.int64)}

    def threshold(self, norms: np.ndarray, state: dict) -> float:
        """Adds ``norms`` to the history and returns :math:`\\min(\\mathrm{median}(H), \\tau_{\\max})`."""
        buf, count = state["norms"], int(state["count"])
        buf[(count + np.arange(len(norms))) % buf.size] = norms
        state["count"][...] = count + len(norms)
        return min(float(np.median(buf[: min(count + len(norms), buf.size)])), self.tau)

    def _aggregate(self, X, state, reference, rng):
        n = X.shape[0]
        G = inner_products(X)
        norms = np.sqrt(np.maximum(np.diag(G), 0.0))
        tau = self.threshold(norms, state)
        factor = np.where(norms > tau, tau / (norms + 1e-6), 1.0)
        labels = (
            sklearn_cluster()
            .AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage=self.linkage)
            .fit(cosine_distances(G))
            .labels_
        )
        flag = 1 if int(labels.sum()) > n // 2 else 0
        keep = labels == flag
        return AggregateResult(combine(factor * keep, X) / int(keep.sum()), keep.astype(float))
