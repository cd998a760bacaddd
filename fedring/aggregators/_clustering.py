"""Small-matrix clustering shared by the FLPoison and Blades rules, on scikit-learn.

The rules cluster n points (n = clients) described by a few features or by an n x n distance
matrix, so the work here is O(n^2) whatever the model size. scikit-learn (the ``defences``
extra: ``pip install fedring[defences]``) is imported on first use; a rule that needs it fails
at construction, naming the setting, when it is missing (found without importing it).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from fedring.validate import installed

from ._kernels import BLOCK_BYTES, block_width, map_blocks, row_stats


def require_sklearn(rule: str) -> None:
    """At construction, before any work: scikit-learn is installed (found, not imported: only rank 0's
    rule clusters), else a ConfigError naming ``rule`` and the extra."""
    installed("aggregator", ["sklearn"], f"{rule} clusters the clients with scikit-learn", "defences")


def sklearn_cluster() -> ModuleType:
    """``sklearn.cluster``, imported on first use (:func:`require_sklearn` checked that it is there)."""
    import sklearn.cluster

    return sklearn.cluster


def largest_cluster(labels: np.ndarray) -> np.ndarray:
    """(n,) bool: the members of the most populous cluster label 0, 1, ... (ties to the lower label;
    -1, noise, is no cluster); all False when every point is noise."""
    labels = np.asarray(labels)
    clusters = len(set(labels.tolist()) - {-1})
    if clusters == 0:
        return np.zeros(len(labels), bool)
    counts = [int(np.sum(labels == i)) for i in range(clusters)]
    return labels == int(np.argmax(counts))


def dbscan_labels(points: np.ndarray, eps: float, min_samples: int, metric: str = "euclidean") -> np.ndarray:
    return sklearn_cluster().DBSCAN(eps=eps, min_samples=min_samples, metric=metric).fit(points).labels_


def meanshift_labels(points: np.ndarray, quantile: float = 0.5, n_samples: int = 50) -> np.ndarray:
    """scikit-learn's MeanShift as SignGuard's authors and FLPoison call it: the bandwidth from
    ``estimate_bandwidth(quantile=0.5, n_samples=50)`` (its sample drawn with random_state 0),
    bin seeding, orphans left unclustered (-1). Coinciding points (bandwidth 0, which MeanShift
    refuses) form one cluster."""
    cluster = sklearn_cluster()
    bandwidth = float(cluster.estimate_bandwidth(points, quantile=quantile, n_samples=n_samples))
    if not bandwidth > 0:
        return np.zeros(len(points), np.int64)
    return cluster.MeanShift(bandwidth=bandwidth, bin_seeding=True, cluster_all=False).fit(points).labels_


def kmeans_labels(points: np.ndarray, k: int = 2, seed: int = 0, tol: float = 1e-4) -> np.ndarray:
    """scikit-learn's KMeans(n_clusters=k, random_state=seed) as FLPoison and Blades call it:
    k-means++ and one run (``n_init=1``, what the default ``"auto"`` means since scikit-learn 1.4;
    1.3's default was 10 runs). Fewer distinct points than k give one cluster per distinct point."""
    distinct = len(np.unique(points, axis=0))
    if distinct < k:
        return np.unique(points, axis=0, return_inverse=True)[1].reshape(-1)
    cluster = sklearn_cluster().KMeans(n_clusters=k, random_state=seed, tol=tol, n_init=1)
    return cluster.fit(points).labels_


def kmeans_labels_of_columns(X: np.ndarray, cols: np.ndarray, k: int = 2, seed: int = 0) -> np.ndarray:
    """``kmeans_labels(X[:, cols])`` without the copy: k-means on the ``embedding`` of the columns'
    centred Gram matrix (one blocked pass). scikit-learn's tolerance is relative to the mean
    variance per feature, so it is rescaled by (embedding's features) / len(cols) to stay the same
    absolute tolerance; the clustering then differs from the direct call only by rounding."""
    E = embedding(centred_column_gram(X, cols))
    return kmeans_labels(E, k, seed, tol=1e-4 * E.shape[1] / len(cols))


def inner_products(X: np.ndarray) -> np.ndarray:
    """(n, n) plain float64 inner products ``<x_i, x_j>`` in one blocked pass, symmetric, with the
    squared norms summed directly on the diagonal (a zero row has exactly zero entries). Cosine
    rules use these rather than the pivot-centred ``gram``, whose rounding would give a zero row
    a norm of about 1e-8 relative to the others."""
    sq, dots = row_stats(X, X)
    assert dots is not None
    G = 0.5 * (dots + dots.T)
    np.fill_diagonal(G, sq)
    return G


def cosines(G: np.ndarray) -> np.ndarray:
    """(n, n) cosines ``G_ij / sqrt(G_ii G_jj)`` in [-1, 1] from the inner products G, 0 where a row
    is zero. The square root of the product (not the product of the roots) makes the cosine of two
    identical rows exactly 1 (``sqrt(a * a) == a`` in binary floating point)."""
    sq = np.maximum(np.diag(G), 0.0)
    den = np.sqrt(np.outer(sq, sq))
    return np.clip(np.divide(G, den, out=np.zeros_like(G), where=den > 0), -1.0, 1.0)


def cosine_distances(G: np.ndarray) -> np.ndarray:
    """(n, n) ``1 - cos(x_i, x_j)`` from the inner products G, zero diagonal; a zero row is at
    distance 1 from every other (its cosine counts as 0, as in torch's ``cosine_similarity`` and
    scikit-learn's ``cosine_similarity``)."""
    D = 1.0 - cosines(G)
    np.fill_diagonal(D, 0.0)
    return D


def centred_column_gram(X: np.ndarray, cols: np.ndarray) -> np.ndarray:
    r"""(n, n) float64 Gram matrix :math:`K = X_c X_c^\top` of the columns ``cols`` (sorted) of X,
    each centred on its mean over the rows, in one blocked pass (no copy of those columns).

    Products run in X's precision; where finite float32 rows overflow them (entries above about
    1e19, a Byzantine upload's: the rules call this on finite rows), the pass is made again in
    float64, so that the eigendecompositions get finite figures."""
    K = _centred_column_gram(X, cols, X.dtype)
    if X.dtype != np.float64 and not np.isfinite(K).all():
        K = _centred_column_gram(X, cols, np.dtype(np.float64))
    return K


def _centred_column_gram(X: np.ndarray, cols: np.ndarray, wd: np.dtype) -> np.ndarray:
    n, d = X.shape
    width = min(d, block_width(n, X.itemsize, 4 * BLOCK_BYTES))

    def task(sls):
        K = np.zeros((n, n))
        with np.errstate(over="ignore", invalid="ignore"):  # a worker thread has its own errstate
            for sl in sls:
                lo, hi = np.searchsorted(cols, [sl.start, sl.stop])
                if hi > lo:
                    B = X[:, cols[lo:hi]].astype(wd, copy=False)
                    B -= B.mean(axis=0)
                    K += np.dot(B, B.T)
        return K

    with np.errstate(over="ignore", invalid="ignore"):
        K = sum(map_blocks(task, d, width))
        return 0.5 * (K + K.T)


def embedding(K: np.ndarray) -> np.ndarray:
    """(n, r) points whose centred Gram matrix is K (PSD): ``V sqrt(Lambda)`` on the positive
    eigenvalues. Their pairwise distances and means are those of the original rows, so a
    clustering that depends only on them (k-means) runs on n x r numbers instead of n x d."""
    lam, V = np.linalg.eigh(K)
    pos = lam > lam.max() * 1e-13 if lam.max() > 0 else np.zeros(len(lam), bool)
    if not pos.any():
        return np.zeros((K.shape[0], 1))
    return V[:, pos] * np.sqrt(lam[pos])
