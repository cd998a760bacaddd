"""Simple majority clustering, as FLPoison's ``aggregators/simpleclustering.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ._clustering import dbscan_labels, largest_cluster, require_sklearn
from ._kernels import combine
from .base import AggregateResult, GramRule, register


@register
class SimpleClustering(GramRule):
    r"""The mean of the most populous DBSCAN cluster of the uploads (Euclidean distances).

    Runs on the host: scikit-learn's DBSCAN clusters the clients.

    DBSCAN with radius ``eps`` and core size ``min_samples`` runs on the n x n distance matrix
    (one Gram pass: no copy of the uploads); the output is the mean of the largest cluster (ties
    to the lower label), the zero vector if every client is noise. FLPoison's baseline
    ``SimpleClustering`` (no paper).

    The radius is in the units of the uploads: FLPoison's default 0.05 suits its model updates
    (learning rate times gradient) on small models; gradients of large models are farther apart,
    and every client is then noise.

    Parameters
    ----------
    eps : float
        DBSCAN's radius (0.05).
    min_samples : int
        DBSCAN's core size, the point itself included (3).

    selected: 1 for the members of the cluster averaged.

    Examples
    --------
    Three clients within 0.05 of each other form the cluster; the other two are noise:

    >>> X = np.array([[0.0], [0.02], [0.04], [1.0], [-1.0]])
    >>> SimpleClustering()(X)
    array([0.02])
    """

    name = "simpleclustering"
    selects = True

    def __init__(self, f: int = 0, *, eps: float = 0.05, min_samples: int = 3):
        super().__init__(f)
        self.eps = real("simpleclustering.eps", eps, lo=0.0, lo_open=True)
        self.min_samples = integer("simpleclustering.min_samples", min_samples, lo=1)
        require_sklearn(self.name)

    def _aggregate_gram(self, X, G, state, reference, rng):
        keep = largest_cluster(dbscan_labels(np.sqrt(G.sqdist()), self.eps, self.min_samples, "precomputed"))
        if not keep.any():
            return AggregateResult(np.zeros(X.shape[1], X.dtype), keep.astype(float))
        return AggregateResult(combine(keep, X) / int(keep.sum()), keep.astype(float))
