"""Blocked kernels shared by the rules: whole-matrix passes with bounded extra memory.

Pairwise rules are matrix products in disguise. One pass over the (n, d) input builds the
n x n Gram matrix (BLAS ``syrk`` on column blocks, summed in float64), after which squared
distances, cosines and every iterate of a Weiszfeld-type fixed point are O(n^2) or
O(n^3) work on small matrices: an iterate that is an affine combination ``z = w @ X`` is
represented by its coefficients ``w`` and only materialised at the end.

Rows are centred on a *pivot* row (a medoid of a column sample) before the products, so a
squared distance ``C_ii + C_jj - 2 C_ij`` between two nearby honest rows does not cancel
against huge Byzantine norms, and integer inputs give integer-exact distances.

Coordinate-wise rules work on column blocks transposed to (width, n) and sorted along
their rows, which uses numpy's SIMD sort on short contiguous rows instead of strided
selection along axis 0.

Every pass splits the columns over worker threads (numpy and BLAS release the GIL) and
needs O(n x block) extra memory per worker, never a copy of the input.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK_BYTES = 2 << 20  # working block of the Gram pass
SORT_BYTES = 1 << 20  # transposed block of the coordinate-wise sorts (fits in L2)


def block_width(rows: int, itemsize: int = 8, budget: int = BLOCK_BYTES) -> int:
    return max(256, budget // max(1, rows * itemsize))


def blocks(d: int, width: int) -> Iterator[slice]:
    for s in range(0, d, width):
        yield slice(s, min(d, s + width))


# --------------------------------------------------------------------------------------
# parallel passes: our own worker threads, each running single-threaded BLAS
# --------------------------------------------------------------------------------------


def _openblas_set_local() -> Callable[[int], int] | None:
    """OpenBLAS's per-thread ``openblas_set_num_threads_local`` (>= 0.3.27), if numpy uses OpenBLAS.

    Multi-threaded OpenBLAS busy-waits; on a shared, oversubscribed machine a 64 x 64 syrk
    then takes 100x longer. The passes below split the columns over their own threads and
    keep BLAS at one thread inside each, which is as fast on an idle machine and robust on a
    busy one. The caller's own threads are left alone.
    """
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "openblas" in line.lower()})
    except OSError:
        return None
    for path in paths:
        try:
            fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def n_workers() -> int:
    """Threads of the blocked passes: $FEDRING_THREADS, else the CPUs this process may use."""
    env = os.environ.get("FEDRING_THREADS")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _pool_executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            set_local = _openblas_set_local()
            _pool = ThreadPoolExecutor(
                max_workers=n_workers(),
                thread_name_prefix="fedring-agg",
                initializer=(lambda: set_local(1)) if set_local else None,
            )
    return _pool


def map_blocks(task: Callable[[list[slice]], object], d: int, width: int) -> list:
    """Run ``task(slices)`` on a partition of the column blocks into contiguous runs, in parallel.

    Each task gets a run of consecutive blocks (so it can reuse one buffer) and may write
    into disjoint column slices of shared output arrays. Returns the task results in order.
    """
    sls = list(blocks(d, width))
    k = max(1, min(len(sls), 4 * n_workers()))
    runs = [sls[i * len(sls) // k : (i + 1) * len(sls) // k] for i in range(k)]
    return list(_pool_executor().map(task, runs))


def map_rows(task: Callable[[range], object], n: int) -> list:
    """Run ``task(rows)`` on a partition of range(n) into one contiguous run per worker."""
    k = max(1, min(n, n_workers()))
    return list(_pool_executor().map(task, [range(i * n // k, (i + 1) * n // k) for i in range(k)]))


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
    """One blocked pass: the Gram matrix of the rows of X (then ``extra``) around a pivot.

    Products run in X's precision on pivot-centred blocks and accumulate across blocks in
    float64. For float32 input this is float32 BLAS (twice the speed of float64); centring
    keeps the rounding proportional to the rows' distances from the pivot, so distances
    between nearby rows keep about float32 relative accuracy whatever the outliers.
    """
    n, d = X.shape
    k = 0 if extra is None else extra.shape[0]
    m = n + k
    p = pivot_row(X)
    wd = X.dtype
    width = min(d, block_width(m, wd.itemsize))

    def task(sls):
        C = np.zeros((m, m))
        h = np.zeros(m)
        pp = 0.0
        buf = np.empty((m, width), wd)
        for sl in sls:
            B = buf[:, : sl.stop - sl.start]
            piv = X[p, sl]
            np.subtract(X[:, sl], piv, out=B[:n])
            if k:
                np.subtract(extra[:, sl], piv, out=B[n:], casting="unsafe")
            C += B @ B.T
            h += B @ piv
            pp += float(np.dot(piv, piv))
        return C, h, pp

    parts = map_blocks(task, d, width)
    C = sum(c for c, _, _ in parts)
    C = 0.5 * (C + C.T)
    return Gram(C, sum(h for _, h, _ in parts), sum(pp for _, _, pp in parts))


def combine(w: np.ndarray, X: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """``w @ [X; extra]`` in X's dtype (w: (m,) or (k, m)), one parallel BLAS pass."""
    n, d = X.shape
    w = np.asarray(w, dtype=np.float64)
    wx = w[..., :n].astype(X.dtype)
    we = None if extra is None or not extra.shape[0] else w[..., n:].astype(X.dtype)
    out = np.empty((*w.shape[:-1], d), X.dtype)

    def task(sls):
        for sl in sls:
            out[..., sl] = wx @ X[:, sl]
            if we is not None:
                out[..., sl] += we @ extra[:, sl].astype(X.dtype, copy=False)

    map_blocks(task, d, block_width(n, X.itemsize, 4 * BLOCK_BYTES))
    return out


def nonfinite_rows(X: np.ndarray) -> np.ndarray:
    """(n,) bool: the rows of X that hold a NaN or an infinity, in one blocked pass.

    A block's row sums are finite exactly when its rows are (unless finite values overflow
    the sum), so only rows with a non-finite sum are checked value by value.

    >>> nonfinite_rows(np.array([[1.0, 2.0], [np.nan, 0.0], [3e38, 3e38], [-np.inf, 1.0]], np.float32)).tolist()
    [False, True, False, True]
    """
    n, d = X.shape

    def task(sls):
        bad = np.zeros(n, bool)
        for sl in sls:
            B = X[:, sl]
            with np.errstate(over="ignore", invalid="ignore"):
                suspect = np.flatnonzero(~np.isfinite(B.sum(axis=1)))
            if suspect.size:
                bad[suspect] |= ~np.isfinite(B[suspect]).all(axis=1)
        return bad

    return np.logical_or.reduce(map_blocks(task, d, block_width(n, X.itemsize, 4 * BLOCK_BYTES)))


def row_stats(X: np.ndarray, R: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Squared row norms of X and, if R (k, d) is given, the dots ``X @ R.T``; float64, one pass."""
    n, d = X.shape
    k = 0 if R is None else R.shape[0]

    def task(sls):
        sq = np.zeros(n)
        dots = np.zeros((n, k))
        for sl in sls:
            B = X[:, sl].astype(np.float64)
            sq += np.einsum("ij,ij->i", B, B)
            if k:
                dots += B @ R[:, sl].astype(np.float64).T
        return sq, dots

    parts = map_blocks(task, d, block_width(n + k))
    sq = sum(a for a, _ in parts)
    return sq, (sum(b for _, b in parts) if k else None)


def for_sorted_columns(X: np.ndarray, fn: Callable[[slice, np.ndarray], None], scale: np.ndarray | None = None) -> None:
    """Call ``fn(columns, T)`` where ``T[j]`` holds the sorted values of column j, in parallel.

    With ``scale`` (n,), the values sorted are ``|x_ij| * scale_i``. T is a (width, n) buffer
    reused by the worker: ``fn`` must copy what it keeps (it writes into disjoint slices).
    """
    n, d = X.shape
    width = min(d, block_width(n, X.itemsize, SORT_BYTES))
    sc = None if scale is None else scale[:, None].astype(X.dtype)

    def task(sls):
        buf = np.empty((width, n), X.dtype)
        for sl in sls:
            T = buf[: sl.stop - sl.start]
            T[...] = X[:, sl].T if sc is None else (np.abs(X[:, sl]) * sc).T
            T.sort(axis=1)
            fn(sl, T)

    map_blocks(task, d, width)


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

    def task(rows):
        buf = np.empty(d, X.dtype)
        for i in rows:
            np.abs(X[i], out=buf)
            buf.partition(lo)
            lo_val = float(buf[lo])
            hi_val = float(buf[lo + 1 :].min()) if frac > 0 and lo + 1 < d else lo_val
            out[i] = lerp_quantile(lo_val, hi_val, frac)

    map_rows(task, n)
    return out


def sign_gram(X: np.ndarray) -> np.ndarray:
    """(n, n) int64 matrix of sign agreements ``sum_j sgn(x_ij) sgn(x_kj)`` (FedSECA Eq. 4 numerator).

    float32 BLAS on the sign block is exact: every partial sum is an integer below 2^24.
    """
    n, d = X.shape
    width = min(d, block_width(n, 4))

    def task(sls):
        acc = np.zeros((n, n), np.int64)
        buf = np.empty((n, width), np.float32)
        for sl in sls:
            S = buf[:, : sl.stop - sl.start]
            np.sign(X[:, sl], out=S, casting="unsafe")
            acc += np.rint(S @ S.T).astype(np.int64)
        return acc

    return sum(map_blocks(task, d, width))


def column_count(mask: np.ndarray) -> np.ndarray:
    """Number of True entries per column of a boolean (n, w) block (int8 view: no float casts)."""
    return mask.view(np.int8).sum(axis=0, dtype=np.int32)


def column_sign_sum(B: np.ndarray) -> np.ndarray:
    """sum_i sgn(B_ij) per column, exact, as counts of positives minus negatives."""
    return column_count(B > 0) - column_count(B < 0)


def signs(B: np.ndarray, dtype=np.float32) -> np.ndarray:
    """sgn(B) as a float matrix, from two comparisons (faster than np.sign)."""
    return ((B > 0).view(np.int8) - (B < 0).view(np.int8)).astype(dtype)


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
