"""Blocked kernels shared by the rules: whole-matrix passes with bounded extra memory.

Pairwise rules are matrix products in disguise. One pass over the (n, d) input builds the
n x n Gram matrix in float64 (BLAS ``syrk`` on column blocks), after which squared
distances, cosines and every iterate of a Weiszfeld-type fixed point are O(n^2) or
O(n^3) work on small matrices: an iterate that is an affine combination ``z = w @ X`` is
represented by its coefficients ``w`` and only materialised at the end.

Rows are centred on a *pivot* row (a medoid of a column sample) before the products, so a
squared distance ``C_ii + C_jj - 2 C_ij`` between two nearby honest rows does not cancel
against huge Byzantine norms, and integer inputs give integer-exact distances.

Coordinate-wise rules work on column blocks transposed to (width, n) and sorted along
their rows, which uses numpy's SIMD sort on short contiguous rows instead of strided
selection along axis 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

BLOCK_BYTES = 4 << 20  # float64 working block of the Gram pass
SORT_BYTES = 1 << 20  # transposed block of the coordinate-wise sorts (fits in L2)


def block_width(rows: int, itemsize: int = 8, budget: int = BLOCK_BYTES) -> int:
    return max(256, budget // max(1, rows * itemsize))


def blocks(d: int, width: int) -> Iterator[slice]:
    for s in range(0, d, width):
        yield slice(s, min(d, s + width))


def pivot_row(X: np.ndarray, sample: int = 2048) -> int:
    """Index of the row with the least summed distance to the others on a column sample."""
    n, d = X.shape
    if n <= 2:
        return 0
    cols = np.unique(np.linspace(0, d - 1, min(d, sample)).astype(np.int64))
    S = X[:, cols].astype(np.float64)
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


def gram(X: np.ndarray, extra: np.ndarray | None = None) -> Gram:
    """One blocked pass: the float64 Gram matrix of the rows of X (then ``extra``) around a pivot."""
    n, d = X.shape
    k = 0 if extra is None else extra.shape[0]
    m = n + k
    p = pivot_row(X)
    C = np.zeros((m, m))
    h = np.zeros(m)
    pp = 0.0
    width = block_width(m)
    buf = np.empty((m, width))
    for sl in blocks(d, width):
        B = buf[:, : sl.stop - sl.start]
        piv = X[p, sl].astype(np.float64)
        np.subtract(X[:, sl], piv, out=B[:n], dtype=np.float64)
        if k:
            np.subtract(extra[:, sl], piv, out=B[n:], dtype=np.float64)
        C += B @ B.T
        h += B @ piv
        pp += float(piv @ piv)
    C = 0.5 * (C + C.T)
    return Gram(C, h, pp)


def combine(w: np.ndarray, X: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """``w @ [X; extra]`` in X's dtype, one BLAS pass (w: (m,) or (k, m))."""
    n = X.shape[0]
    w = np.asarray(w, dtype=np.float64)
    out = w[..., :n].astype(X.dtype) @ X
    if extra is not None and extra.shape[0]:
        out += w[..., n:].astype(X.dtype) @ extra.astype(X.dtype, copy=False)
    return out


def row_stats(X: np.ndarray, R: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Squared row norms of X and, if R (k, d) is given, the dots ``X @ R.T``; float64, one pass."""
    n, d = X.shape
    sq = np.zeros(n)
    dots = None if R is None else np.zeros((n, R.shape[0]))
    for sl in blocks(d, block_width(n + (0 if R is None else R.shape[0]))):
        B = X[:, sl].astype(np.float64)
        sq += np.einsum("ij,ij->i", B, B)
        if R is not None:
            dots += B @ R[:, sl].astype(np.float64).T
    return sq, dots


def sorted_columns(X: np.ndarray, absolute: bool = False, scale: np.ndarray | None = None) -> Iterator[tuple[slice, np.ndarray]]:
    """Yield (columns, T) with ``T[j]`` = the sorted values of column j (optionally |x| * scale).

    T is a reused (width, n) buffer: consume it before asking for the next block.
    """
    n, d = X.shape
    width = block_width(n, X.itemsize, SORT_BYTES)
    buf = np.empty((width, n), X.dtype)
    for sl in blocks(d, width):
        T = buf[: sl.stop - sl.start]
        if scale is None and not absolute:
            T[...] = X[:, sl].T
        else:
            src = np.abs(X[:, sl]) if absolute else X[:, sl]
            if scale is not None:
                src = src * scale[:, None].astype(X.dtype)
            T[...] = src.T
        T.sort(axis=1)
        yield sl, T


def lerp_quantile(lo_val: float, hi_val: float, frac: float) -> float:
    """numpy's linear-interpolation formula (method='linear'), so results match np.quantile."""
    diff = hi_val - lo_val
    return hi_val - diff * (1.0 - frac) if frac >= 0.5 else lo_val + diff * frac


def abs_row_quantiles(X: np.ndarray, q: float) -> np.ndarray:
    """Exact ``np.quantile(|X[i]|, q)`` (linear interpolation) for every row, O(d) per row."""
    n, d = X.shape
    pos = q * (d - 1)
    lo = int(np.floor(pos))
    frac = pos - lo
    out = np.empty(n)
    buf = np.empty(d, X.dtype)
    for i in range(n):
        np.abs(X[i], out=buf)
        buf.partition(lo)
        lo_val = float(buf[lo])
        hi_val = float(buf[lo + 1 :].min()) if frac > 0 and lo + 1 < d else lo_val
        out[i] = lerp_quantile(lo_val, hi_val, frac)
    return out


def sign_gram(X: np.ndarray) -> np.ndarray:
    """(n, n) int64 matrix of sign agreements ``sum_j sgn(x_ij) sgn(x_kj)`` (FedSECA Eq. 4 numerator).

    float32 BLAS on the sign block is exact: every partial sum is an integer below 2^24.
    """
    n, d = X.shape
    width = min(block_width(n, 4), 1 << 23)
    acc = np.zeros((n, n), np.int64)
    buf = np.empty((n, width), np.float32)
    for sl in blocks(d, width):
        S = buf[:, : sl.stop - sl.start]
        np.sign(X[:, sl], out=S, casting="unsafe")
        acc += np.rint(S @ S.T).astype(np.int64)
    return acc


def fixed_point(G: Gram, n: int, w0: np.ndarray, weights, iters: int, tol: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Iterate :math:`z \leftarrow \sum_i a_i(z) x_i / \sum_i a_i(z)` on coefficient vectors.

    ``weights`` maps the squared distances from z to the n clients to the a_i. Stops after
    ``iters`` updates or when an update moves z by at most ``tol``. Returns the final
    coefficients and the weights a_i evaluated at the final iterate.
    """
    w = np.asarray(w0, dtype=np.float64)
    a = weights(G.dist2_to_rows(w)[:n])
    for _ in range(iters):
        total = a.sum()
        if not total > 0:
            break
        w_new = np.zeros(G.m)
        w_new[:n] = a / total
        step2 = float(G.dist2_between(w_new, w)[0])
        w = w_new
        a = weights(G.dist2_to_rows(w)[:n])
        if step2 <= tol * tol:
            break
    return w, a
