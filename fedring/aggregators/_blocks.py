"""What both kernel back ends share (:mod:`._kernels` on the host, :mod:`._kernels_torch` on a
device): column blocks, the pivot row, the Gram matrix of the rows around it, and numpy's
quantile interpolation. Host numpy only, so each back end imports it without the other."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

BLOCK_BYTES = 2 << 20  # working block of the Gram pass


def block_width(rows: int, itemsize: int = 8, budget: int = BLOCK_BYTES) -> int:
    return max(256, budget // max(1, rows * itemsize))


def blocks(d: int, width: int) -> Iterator[slice]:
    for s in range(0, d, width):
        yield slice(s, min(d, s + width))


def pivot_row(X: np.ndarray, chunks: int = 16, width: int = 128) -> int:
    """Index of the row with the least summed distance to the others on a column sample.

    The sample is ``chunks`` runs of ``width`` contiguous columns spread evenly over d
    (contiguous runs read whole cache lines; spread runs see every part of the model).
    """
    n, d = X.shape
    if n <= 2:
        return 0
    if d <= chunks * width:
        S = X.astype(np.float64)
    else:
        starts = np.linspace(0, d - width, chunks).astype(np.int64)
        S = np.concatenate([X[:, s : s + width] for s in starts], axis=1).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite row (GramRule finds it)
        S -= S[0]
        sq = np.einsum("ij,ij->i", S, S)
        D = sq[:, None] + sq[None, :] - 2.0 * (S @ S.T)
        return int(np.sqrt(np.maximum(D, 0.0)).sum(axis=1).argmin())


class Gram:
    """Inner products of rows r_0..r_{m-1} (clients, then extra rows) around a pivot p.

    ``C[i, j] = <r_i - p, r_j - p>``, ``h[i] = <r_i - p, p>``, ``pp = <p, p>``.
    """

    def __init__(self, C: np.ndarray, h: np.ndarray, pp: float):
        self.C, self.h, self.pp = C, h, pp

    @property
    def m(self) -> int:
        return self.C.shape[0]

    def sqdist(self) -> np.ndarray:
        """(m, m) squared Euclidean distances, exact zero diagonal."""
        dg = np.diag(self.C)
        D = dg[:, None] + dg[None, :] - 2.0 * self.C
        np.maximum(D, 0.0, out=D)
        np.fill_diagonal(D, 0.0)
        return D

    def inner(self) -> np.ndarray:
        """(m, m) plain inner products ``<r_i, r_j>``."""
        return self.C + self.h[:, None] + self.h[None, :] + self.pp

    def dist2_to_rows(self, W: np.ndarray) -> np.ndarray:
        """Squared distances from the affine combinations ``W @ R`` (rows of W sum to 1) to every row.

        Returns (k, m) for W of shape (k, m), or (m,) for a single combination.
        """
        W = np.asarray(W, dtype=np.float64)
        single = W.ndim == 1
        W = np.atleast_2d(W)
        CW = W @ self.C
        quad = np.einsum("km,km->k", CW, W)
        D = quad[:, None] - 2.0 * CW + np.diag(self.C)[None, :]
        np.maximum(D, 0.0, out=D)
        return D[0] if single else D

    def dist2_between(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        """Squared distances between paired affine combinations ``A[k] @ R`` and ``B[k] @ R``."""
        E = np.atleast_2d(np.asarray(A, np.float64) - np.asarray(B, np.float64))
        return np.maximum(np.einsum("km,mj,kj->k", E, self.C, E), 0.0)


def lerp_quantile(lo_val: float, hi_val: float, frac: float) -> float:
    """numpy's linear-interpolation formula (method='linear'), so results match np.quantile."""
    diff = hi_val - lo_val
    return hi_val - diff * (1.0 - frac) if frac >= 0.5 else lo_val + diff * frac
