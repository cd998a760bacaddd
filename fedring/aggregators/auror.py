"""Auror (Shen, Tople, Saxena, ACSAC 2016), as FLPoison's ``aggregators/auror.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice, integer, real

from ._clustering import kmeans_labels_of_columns, require_sklearn, sklearn_cluster
from ._kernels import combine, for_sorted_columns
from .base import AggregateResult, Aggregator, register


def center_gaps(X: np.ndarray) -> np.ndarray:
    r"""Per column of X, :math:`|\mu_1 - \mu_0|` for the optimal 1-D 2-means split of its n values.

    The split of the sorted column into a lower and an upper run minimising the within-cluster
    sum of squares (the first such split on a tie), found for every column at once from prefix
    sums; 0 for a constant column.

    >>> center_gaps(np.array([[0.0, 1.0], [0.1, 1.0], [1.0, 1.0], [1.2, 1.0]]))
    array([1.05, 0.  ])
    """
    n, d = X.shape
    out = np.zeros(d)
    if n < 2:
        return out
    k = np.arange(1, n, dtype=np.float64)

    def fn(sl, T):
        S = T.astype(np.float64)
        c1, c2 = np.cumsum(S, axis=1), np.cumsum(S * S, axis=1)
        head1, head2, tot1, tot2 = c1[:, :-1], c2[:, :-1], c1[:, -1:], c2[:, -1:]
        sse = (head2 - head1**2 / k) + ((tot2 - head2) - (tot1 - head1) ** 2 / (n - k))
        j = np.argmin(sse, axis=1)
        rows = np.arange(len(j))
        lo = c1[rows, j] / (j + 1)
        hi = (c1[:, -1] - c1[rows, j]) / (n - j - 1)
        out[sl] = np.abs(hi - lo)

    for_sorted_columns(X, fn)
    return out


def sklearn_center_gaps(X: np.ndarray) -> np.ndarray:
    """Per column, the distance between the two centres of scikit-learn's KMeans(n_clusters=2,
    random_state=0) on its values: FLPoison's loop, one k-means per coordinate."""
    out = np.zeros(X.shape[1])
    for j in range(X.shape[1]):
        col = np.asarray(X[:, j], np.float64).reshape(-1, 1)
        if np.unique(col).size < 2:
            continue
        centers = sklearn_cluster().KMeans(n_clusters=2, random_state=0, n_init=1).fit(col).cluster_centers_
        out[j] = abs(centers[0, 0] - centers[1, 0])
    return out


@register
class Auror(Aggregator):
    r"""Auror: find the "indicative" coordinates where the clients split into two distant groups,
    then keep the majority of a 2-means clustering on those coordinates.

    Runs on the host: its per-coordinate 2-means (exact, or scikit-learn's KMeans) is numpy code.

    1. During the first ``rounds`` rounds, each round: per coordinate j of the block (the last
       ``output`` coordinates), 2-means on the n values :math:`x_{1j}..x_{nj}`; j is indicative
       when the two centres are at least ``threshold`` apart. The set is then kept for the rest
       of the run.
    2. Every round: 2-means (scikit-learn's KMeans, random state 0) on the n clients restricted
       to the indicative coordinates; the cluster with label 1 is kept if it has more than n/2
       members, else label 0. The output is the mean of the kept clients (all of them when no
       coordinate is indicative).

    Shen, Tople, Saxena, "Auror: Defending against Poisoning Attacks in Collaborative Deep
    Learning Systems", ACSAC 2016. FLPoison takes the output layer (its weights and bias, the
    last C·F + C coordinates of the model's vector for C classes and F features); set
    ``output`` to that size (the default, every coordinate, also works at any size: the second
    clustering runs on an n-point embedding of the indicative coordinates, see
    ``kmeans_labels_of_columns``).

    Parameters
    ----------
    threshold : float
        Minimum distance of the two centres of an indicative coordinate (0.002, FLPoison's
        ``indicative_threshold``; it is in the units of the uploads, and FLPoison's uploads are
        model updates, learning rate times gradient).
    rounds : int
        Rounds during which the indicative set is recomputed (10, FLPoison's ``indicative_find_epoch``).
    output : int or None
        Size of the block of last coordinates examined (None: all of them).
    kmeans : {"exact", "sklearn"}
        The 1-D 2-means of step 1: the optimal split (``center_gaps``, all coordinates at once) or,
        as FLPoison, scikit-learn's KMeans from random state 0 per coordinate, whose Lloyd
        iterations may stop at another split (one 1-D k-means call per coordinate: slow beyond
        a few thousand coordinates).

    State: ``indicative`` (bool, per coordinate of the block), ``round``.
    selected: 1 for the kept clients.

    Examples
    --------
    On the first coordinate the clients form the groups {0, 0.1, 0.2} and {5, 5.1}, whose centres are 4.95 apart;
    the second coordinate varies by at most 0.1. The 2-means on the first coordinate keeps the
    majority group:

    >>> X = np.array([[0.0, 1.0], [0.1, 1.1], [0.2, 1.0], [5.0, 1.1], [5.1, 1.0]])
    >>> Auror(threshold=1.0)(X)
    array([0.1       , 1.03333333])
    """

    name = "auror"
    selects = True

    def __init__(
        self,
        f: int = 0,
        *,
        threshold: float = 0.002,
        rounds: int = 10,
        output: int | None = None,
        kmeans: str = "exact",
    ):
        super().__init__(f)
        self.threshold = real("auror.threshold", threshold, lo=0.0)
        self.rounds = integer("auror.rounds", rounds, lo=1)
        self.output = None if output is None else integer("auror.output", output, lo=1)
        self.kmeans = choice("auror.kmeans", kmeans, ("exact", "sklearn"))
        require_sklearn(self.name)

    def check(self, n):
        if n < 2:
            return f"auror splits the clients into two clusters and needs n >= 2, got n={n}"
        return super().check(n)

    def block(self, d: int) -> int:
        return d if self.output is None else min(self.output, d)

    def init_state(self, n, d):
        return {"indicative": np.zeros(self.block(d), bool), "round": np.zeros((), np.int64)}

    def _aggregate(self, X, state, reference, rng):
        n, d = X.shape
        lo = d - self.block(d)
        t = int(state["round"])
        if t < self.rounds:
            gaps = (center_gaps if self.kmeans == "exact" else sklearn_center_gaps)(X[:, lo:])
            state["indicative"][...] = gaps >= self.threshold
        state["round"][...] = t + 1
        cols = lo + np.flatnonzero(state["indicative"])
        keep = np.ones(n, bool)
        if cols.size:
            labels = kmeans_labels_of_columns(X, cols)
            keep = labels == (1 if labels.sum() > n / 2 else 0)
        return AggregateResult(combine(keep, X) / int(keep.sum()), keep.astype(float))
