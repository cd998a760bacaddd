"""Blocked kernels shared by the rules: whole-matrix passes with bounded extra memory.

Pairwise rules are matrix products in disguise. One pass over the (n, d) input builds the
n x n Gram matrix (BLAS ``syrk`` on column blocks, summed in float64), after which squared
distances, cosines and every iterate of a Weiszfeld-type fixed point are O(n^2) or
O(n^3) work on small matrices: an iterate that is an affine combination ``z = w @ X`` is
represented by its coefficients ``w`` and only materialised at the end.

Rows are centred on a *pivot* row (a medoid of a column sample) before the products, so a
squared distance ``C_ii + C_jj - 2 C_ij`` between two nearby honest rows does not cancel
against huge Byzantine norms, and integer inputs give integer-exact distances.

Coordinate-wise rules read sorted columns. Up to :data:`NETWORK_MAX` clients, a sorting network
sorts a column block as elementwise minima and maxima of whole rows: no transposition, and a few
hundred long vector operations per block. Beyond, column blocks are transposed to (width, n) and
sorted along their rows, which uses numpy's SIMD sort on short contiguous rows instead of strided
selection along axis 0. Sums of sorted values keep numpy's pairwise order (:func:`pairwise_sum`).

Every pass splits the columns over worker threads (numpy and BLAS release the GIL) and
needs O(n x block) extra memory per worker, never a copy of the input. The passes multiply with
``np.dot``, not ``@``: numpy's matmul holds the GIL around a BLAS call whose product has at most
500 entries (the Gram block of up to 22 rows, a block times a vector), which ran the workers'
products one at a time (``benchmarks/blas_threads.py``); on contiguous blocks ``np.dot`` gives
the same bits.

Every kernel also takes a torch tensor, on any device: it then runs there, in
:mod:`._kernels_torch` (imported on the first tensor, so the host path never imports torch),
with the same numerical scheme, and returns its small results (Gram matrices, row statistics,
row quantiles, sign Gram, non-finite rows) as the same numpy arrays; ``combine`` and the
coordinate-wise blocks stay tensors on the device.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from fedring.arrays import array_namespace, device, is_torch_array

from . import _blocks
from ._blocks import BLOCK_BYTES, Gram, block_width, blocks, lerp_quantile

T = TypeVar("T")
SORT_BYTES = 1 << 20  # transposed block of the coordinate-wise sorts (fits in L2)
COMBINE_BYTES = 8 << 20  # a column block of combine's products
ROW_RUN_BYTES = 1 << 20  # a column block's running row sum (stays in L2 while the rows stream past)
# Column runs of a pass: a fixed number, not one per thread, so that a reduction over the runs
# (Gram matrices, row norms) is added in one order whatever $FEDRING_THREADS, the cores or the
# binding of a job; a pass keeps at most this many threads busy.
RUNS = 8
SEGMENT = 256  # float32 values a dot product of sq_norms sums before float64 takes over
NETWORK_MAX = 20  # columns of at most this many values are sorted by a comparator network (for_sorted_rows)
NETWORK_BYTES = 4 << 20  # a block of the network: its rows stay in L3, its calls long enough for two threads


def _torch():
    """The tensor kernels, imported when the first tensor arrives."""
    from . import _kernels_torch

    return _kernels_torch


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


def map_blocks(task: Callable[[list[slice]], object], d: int, width: int, last_first: bool = False) -> list:
    """Run ``task(slices)`` on a partition of the column blocks into contiguous runs, in parallel.

    Each task gets a run of consecutive blocks (so it can reuse one buffer) and may write
    into disjoint column slices of shared output arrays. Returns the task results in order.
    The partition depends on d and the width only (:data:`RUNS`), so the callers' float64
    sums of the runs' results have the same bits on any number of threads. ``last_first`` starts
    with the last runs: a pass right after another over the same rows then first reads the
    blocks that the other left in the cache.

    >>> map_blocks(lambda run: [sl.start for sl in run], 10, 3, last_first=True)
    [[0], [3], [6], [9]]
    """
    sls = list(blocks(d, width))
    k = max(1, min(len(sls), RUNS))
    runs = [sls[i * len(sls) // k : (i + 1) * len(sls) // k] for i in range(k)]
    if last_first:
        return list(_pool_executor().map(task, runs[::-1]))[::-1]
    return list(_pool_executor().map(task, runs))


def map_columns(X, task: Callable[[list[slice]], object], budget: int = BLOCK_BYTES) -> None:
    """Run ``task(slices)`` over the column blocks of X: :func:`map_blocks` over blocks of ``budget``
    bytes on the host; on a tensor's device, one call with every block (the device queues the work)."""
    if is_torch_array(X):
        return _torch().map_columns(X, task)
    n, d = X.shape
    map_blocks(task, d, block_width(n, X.itemsize, budget))


def small(a: np.ndarray, X) -> np.ndarray:
    """The small host array ``a`` in X's dtype, an array of X's kind on X's device (``a.astype(X.dtype)``)."""
    if is_torch_array(X):
        return _torch().small(a, X)
    return a.astype(X.dtype)


def empty_row(X):
    """An uninitialised (d,) array of X's kind, dtype and device."""
    return array_namespace(X).empty(X.shape[1], dtype=X.dtype, device=device(X))


def zero_row(X):
    """The (d,) zero vector of X's kind, dtype and device."""
    return array_namespace(X).zeros(X.shape[1], dtype=X.dtype, device=device(X))


def sort_rows(M):
    """M with each row sorted: a contiguous copy sorted in place on the host, ``torch.sort`` on a device."""
    if is_torch_array(M):
        return _torch().sort_rows(M)
    ranked = np.ascontiguousarray(M)
    ranked.sort(axis=1)
    return ranked


def ratio(num, den):
    """``num / den`` where ``den > 0``, else 0, in num's dtype (per column of a block)."""
    if is_torch_array(num):
        return _torch().ratio(num, den)
    return np.divide(num, den, out=np.zeros(len(den), num.dtype), where=den > 0)


def sqnorm(v) -> float:
    """``<v, v>`` of a (d,) array in float64 (a tensor's on its device)."""
    if is_torch_array(v):
        v = v.double()
        return float(v @ v)
    v = v.astype(np.float64)
    return float(np.dot(v, v))


def all_finite(v) -> bool:
    """Whether every value of the array ``v`` (either kind) is finite: from its sum, one reduction
    with no mask (a NaN or an infinity makes the sum NaN or infinite), and value by value only
    where the sum is not finite (a non-finite value, or finite ones whose sum overflowed).

    >>> all_finite(np.array([1.0, 2.0])), all_finite(np.array([1.0, np.inf])), all_finite(np.array([1e308, 1e308]))
    (True, False, True)
    """
    xp = array_namespace(v)
    with np.errstate(over="ignore", invalid="ignore"):
        if bool(xp.isfinite(xp.sum(v))):
            return True
    return bool(xp.all(xp.isfinite(v)))


def background(task: Callable[..., T], *args) -> Future[T]:
    """``task(*args)`` on a worker thread of the passes (for work that overlaps a pass of the caller's)."""
    return _pool_executor().submit(task, *args)


def map_rows(task: Callable[[range], object], n: int) -> list:
    """Run ``task(rows)`` on a partition of range(n) into one contiguous run per worker."""
    k = max(1, min(n, n_workers()))
    return list(_pool_executor().map(task, [range(i * n // k, (i + 1) * n // k) for i in range(k)]))


def pivot_row(X, chunks: int = 16, width: int = 128) -> int:
    """:func:`._blocks.pivot_row` of X (either kind): a tensor's column sample is read on its device."""
    if is_torch_array(X):
        return _torch().pivot_row(X, chunks, width)
    return _blocks.pivot_row(X, chunks, width)


def gram(X: np.ndarray, extra: np.ndarray | None = None) -> Gram:
    """One blocked pass: the Gram matrix of the rows of X (then ``extra``) around a pivot.

    Products run in X's precision on pivot-centred blocks and accumulate across blocks in
    float64. For float32 input this is float32 BLAS (twice the speed of float64); centring
    keeps the rounding proportional to the rows' distances from the pivot, so distances
    between nearby rows keep about float32 relative accuracy whatever the outliers. Where finite
    float32 rows overflow those products (entries above about 1e19), the pass is made again in
    float64 (:func:`overflowed`), so that the rules get finite figures. A tensor's passes run on
    its device (:func:`._kernels_torch.gram_pass`).
    """
    one_pass = _torch().gram_pass if is_torch_array(X) else _gram_pass
    p = pivot_row(X)
    G = one_pass(X, extra, p, wide=False)
    if X.dtype.itemsize < 8 and overflowed(G, X, extra):
        G = one_pass(X, extra, p, wide=True)
    return G


def overflowed(G: Gram, X, extra=None) -> bool:
    """Whether the Gram pass ``G`` of X (then ``extra``) is non-finite because products of finite
    rows overflowed in their precision (float32 entries above about 1e19, a Byzantine upload's),
    so that a float64 pass would give finite figures: a row with a non-finite ``C[i, i]`` holds
    finite values only. A row holding NaN or an infinity makes its own figures non-finite in any
    precision."""
    if np.isfinite(G.C).all() and np.isfinite(G.h).all() and np.isfinite(G.pp):
        return False
    suspects = np.flatnonzero(~np.isfinite(np.diag(G.C)))
    n = X.shape[0]
    rows, extras = suspects[suspects < n], suspects[suspects >= n] - n
    return (
        suspects.size == 0
        or not nonfinite_rows(X[rows]).all()
        or (extras.size > 0 and extra is not None and not nonfinite_rows(extra[extras]).all())
    )


def _gram_pass(X: np.ndarray, extra: np.ndarray | None, p: int, wide: bool) -> Gram:
    """:func:`gram`'s pass around row ``p``, with products in X's dtype, or in float64 if ``wide``."""
    wd = np.dtype(np.float64) if wide else X.dtype
    n, d = X.shape
    k = 0 if extra is None else extra.shape[0]
    m = n + k
    width = min(d, block_width(m, wd.itemsize))

    def task(sls):
        C = np.zeros((m, m))
        h = np.zeros(m)
        pp = 0.0
        flat = np.empty(m * width, wd)
        # non-finite rows give non-finite distances, which GramRule reads; a worker thread does
        # not inherit the caller's np.errstate
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                # a contiguous block: np.dot gives matmul's bits on it, not on a strided view
                B = flat[: m * (sl.stop - sl.start)].reshape(m, -1)
                piv = X[p, sl].astype(wd, copy=False)
                np.subtract(X[:, sl], piv, out=B[:n], dtype=wd)
                if k:
                    np.subtract(extra[:, sl], piv, out=B[n:], casting="unsafe")
                C += np.dot(B, B.T)
                h += np.dot(B, piv)
                pp += float(np.dot(piv, piv))
        return C, h, pp

    parts = map_blocks(task, d, width)
    with np.errstate(over="ignore", invalid="ignore"):
        C = sum(c for c, _, _ in parts)
        C = 0.5 * (C + C.T)
        return Gram(C, sum(h for _, h, _ in parts), sum(pp for _, _, pp in parts))


def sqdist_to(X, v=None, idx: int | None = None) -> np.ndarray:
    """(n,) float64 squared distances from the rows of X to the vector ``v`` (d,), or to row ``idx``.

    From the differences themselves, one blocked pass with no n x n products (the Gram pass would
    spend n times the arithmetic for one row of its distances): on the host, each block's
    differences in X's dtype (``v`` rounded to it), their squares summed as :func:`sq_norms` sums
    them, to X's precision; a row whose squares overflow or underflow, or that holds NaN or an
    infinity, is taken again in float64. On a tensor's device, :func:`._kernels_torch.sqdist_to`
    (docs/arrays.md, "Rules on the device").

    >>> sqdist_to(np.array([[0.0, 0.0], [3.0, 4.0]]), idx=1).tolist()
    [25.0, 0.0]
    """
    if (v is None) == (idx is None):
        raise ValueError("sqdist_to takes a vector v or a row idx, not both or neither")
    if is_torch_array(X):
        return _torch().sqdist_to(X, v, idx)
    n, d = X.shape
    target = X[idx] if v is None else np.asarray(v).astype(X.dtype)
    width = min(d, max(SEGMENT, block_width(n, X.itemsize) // SEGMENT * SEGMENT))

    def task(sls):
        sq = np.zeros(n)
        flat = np.empty(n * width, X.dtype)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            for sl in sls:
                B = flat[: n * (sl.stop - sl.start)].reshape(n, -1)
                np.subtract(X[:, sl], target[sl], out=B)
                sq += _segment_squares(B)
        return sq

    d2 = sum(map_blocks(task, d, width))
    again = _inexact_squares(d2, X)
    if idx is not None:  # row idx's own distance is 0 by definition, not an underflow to take again
        again = again[again != idx]
    if again.size:
        wide = target.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # a row holding NaN or an infinity stays non-finite
            for i in again.tolist():
                diff = X[i].astype(np.float64) - wide
                d2[i] = float(np.dot(diff, diff))
    if idx is not None:
        d2[idx] = 0.0
    return d2


def combine(w: np.ndarray, X: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """``w @ [X; extra]`` in X's dtype (w: (m,) or (k, m)), one parallel BLAS pass.

    Each block's product is BLAS's on that block, in a worker whose BLAS runs one thread: the
    bits depend on d and :data:`COMBINE_BYTES` only. (A whole ``w @ X`` is split over OpenBLAS's own
    threads, and its bits can depend on their number.)"""
    if is_torch_array(X):
        return _torch().combine(w, X, extra)
    n, d = X.shape
    w = np.asarray(w, dtype=np.float64)
    wx = w[..., :n].astype(X.dtype)
    we = None if extra is None or not extra.shape[0] else w[..., n:].astype(X.dtype)
    out = np.empty((*w.shape[:-1], d), X.dtype)

    def task(sls):
        for sl in sls:
            out[..., sl] = np.dot(wx, X[:, sl])
            if we is not None:
                out[..., sl] += np.dot(we, extra[:, sl].astype(X.dtype, copy=False))

    map_blocks(task, d, block_width(n, X.itemsize, COMBINE_BYTES))
    return out


def scaled_mean(X: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The mean of the rows of X, each first multiplied by ``scale[i]`` (in X's dtype), in X's dtype.

    The bits of ``(X * scale[:, None].astype(X.dtype)).mean(axis=0)`` without the scaled copy, in
    one parallel pass over column blocks: for d > 1 numpy reduces axis 0 row after row (the
    first row, then each next one added), which each block repeats in place, multiplying only
    the rows whose scale is not 1 (with every scale 1, numpy's reduction of the block along axis
    0 does it); the division is elementwise. (For d = 1 numpy sums the column pairwise: that
    case takes numpy's own path, and a block of one column the loop.)

    >>> scaled_mean(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([1.0, 0.5])).tolist()
    [1.25, 2.0]
    """
    if is_torch_array(X):
        return _torch().scaled_mean(X, scale)
    n, d = X.shape
    sc = scale.astype(X.dtype)
    if d == 1:
        return (X * sc[:, None]).mean(axis=0)
    out = np.empty(d, X.dtype)
    ones = bool(np.all(sc == 1)) and X.strides[1] == X.itemsize  # numpy sums such a block row after row
    width = min(d, ROW_RUN_BYTES // X.itemsize)

    def task(sls):
        tmp = np.empty(width, X.dtype)
        # a worker thread does not inherit the caller's np.errstate; the caller checks the result
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                acc, t = out[sl], tmp[: sl.stop - sl.start]
                if ones and sl.stop - sl.start > 1:  # numpy's own loop: row after row, as below
                    np.add.reduce(X[:, sl], axis=0, out=acc)
                    np.true_divide(acc, np.intp(n), out=acc, casting="unsafe")
                    continue
                np.multiply(X[0, sl], sc[0], out=acc)
                for i in range(1, n):
                    if sc[i] == 1:
                        np.add(acc, X[i, sl], out=acc)
                    else:
                        np.multiply(X[i, sl], sc[i], out=t)
                        np.add(acc, t, out=acc)
                np.true_divide(acc, np.intp(n), out=acc, casting="unsafe")  # as ndarray.mean divides

    map_blocks(task, d, width, last_first=True)  # after the norms' pass (clipping, ARC)
    return out


def mean(X):
    """``X.mean(axis=0)``, its bits, in one parallel pass over column blocks on the host
    (:func:`scaled_mean` with every scale 1); ``X.mean(0)`` on a tensor's device.

    >>> mean(np.array([[1.0, 2.0], [4.0, 8.0]], np.float32)).tolist()
    [2.5, 5.0]
    """
    if is_torch_array(X):
        return X.mean(0)
    return scaled_mean(X, np.ones(X.shape[0]))


def nonfinite_rows(X: np.ndarray) -> np.ndarray:
    """(n,) bool: the rows of X that hold a NaN or an infinity, in one blocked pass.

    A block's row sums are finite exactly when its rows are (unless finite values overflow
    the sum), so only rows with a non-finite sum are checked value by value.

    >>> nonfinite_rows(np.array([[1.0, 2.0], [np.nan, 0.0], [3e38, 3e38], [-np.inf, 1.0]], np.float32)).tolist()
    [False, True, False, True]
    """
    if is_torch_array(X):
        return _torch().nonfinite_rows(X)
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


def nonfinite_flags(X):
    """:func:`nonfinite_rows` as an ``(n,)`` bool array of X's kind, on its device, made without a read
    on the host: the training round computes its uploads' flags where they are and reads them at its
    end (:func:`fedring.arrays.host`), after its work is queued; on a GPU a read waits for the
    device. Host rows: :func:`nonfinite_rows` itself.

    >>> nonfinite_flags(np.array([[1.0, 2.0], [np.inf, 0.0]], np.float32)).tolist()
    [False, True]
    """
    if is_torch_array(X):
        return _torch().nonfinite_flags(X)
    return nonfinite_rows(X)


def row_stats(X: np.ndarray, R: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Squared row norms of X and, if R (k, d) is given, the dots ``X @ R.T``; float64, one pass."""
    if is_torch_array(X):
        return _torch().row_stats(X, R)
    n, d = X.shape
    k = 0 if R is None else R.shape[0]
    width = min(d, block_width(n + k))

    def task(sls):
        sq = np.zeros(n)
        dots = np.zeros((n, k))
        # one float64 buffer per worker, each block a contiguous (n, w) view of it: the layout
        # (so the bits) of X[:, sl].astype(np.float64) without an allocation per block, which
        # took a third of the pass
        flat = np.empty(n * width)
        for sl in sls:
            B = flat[: n * (sl.stop - sl.start)].reshape(n, -1)
            B[...] = X[:, sl]
            sq += np.einsum("ij,ij->i", B, B)
            if k:
                dots += np.dot(B, R[:, sl].astype(np.float64).T)
        return sq, dots

    parts = map_blocks(task, d, width)
    sq = sum(a for a, _ in parts)
    return sq, (sum(b for _, b in parts) if k else None)


def sq_norms(X) -> np.ndarray:
    """Squared row norms to scale the rows by (static clipping, ARC): float64, to float32 accuracy.

    On float32 rows, as the device takes them (:func:`._kernels_torch.row_stats`), in float32 and
    summed in float64: the dot products of runs of :data:`SEGMENT` values (BLAS, through
    ``np.vecdot``), added in float64. A float32 sum of 256 non-negative values is within 255 u of
    the exact one in any order (u = 2^-24), so the norms are within 1.6e-5 relative, whatever d;
    the factors are rounded to float32 anyway. One pass with no copy, where :func:`row_stats`
    keeps about 1e-15 at twice the cost. A row whose float32 squares overflow (entries beyond
    about 1e19) or underflow (a norm below about 3e-16 sqrt(d)) is taken again by
    :func:`row_stats`, as is a row holding NaN or an infinity (it stays non-finite). Other dtypes
    and tensors: :func:`row_stats`.

    >>> sq_norms(np.array([[3.0, 4.0], [1e20, 0.0], [1e-30, 0.0]], np.float32)).tolist()
    [25.0, 1.0000000400817551e+40, 1.0000000063421537e-60]
    """
    if is_torch_array(X) or X.dtype != np.float32:
        return row_stats(X)[0]
    n, d = X.shape
    width = min(d, max(SEGMENT, block_width(n, X.itemsize) // SEGMENT * SEGMENT))

    def task(sls):
        sq = np.zeros(n)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            for sl in sls:
                sq += _segment_squares(X[:, sl])
        return sq

    sq = sum(map_blocks(task, d, width))
    again = _inexact_squares(sq, X)
    if again.size:
        sq[again] = row_stats(X[again])[0]
    return sq


def _segment_squares(B: np.ndarray) -> np.ndarray:
    """(n,) float64: each row's sum of squares, as dot products of runs of :data:`SEGMENT` values in
    B's dtype added in float64 (:func:`sq_norms`)."""
    n = B.shape[0]
    m = B.shape[1] // SEGMENT * SEGMENT
    sq = np.zeros(n)
    if m:
        S = B[:, :m].reshape(n, -1, SEGMENT)
        sq += np.vecdot(S, S).sum(axis=1, dtype=np.float64)
    if m < B.shape[1]:
        sq += np.vecdot(B[:, m:], B[:, m:])
    return sq


def _inexact_squares(sq: np.ndarray, X: np.ndarray) -> np.ndarray:
    """The rows whose :func:`_segment_squares` over X's d columns are not to X's precision: non-finite
    (squares that overflowed, or NaN or an infinity) or below the underflow of its squares (a
    square below the smallest normal loses up to ``tiny``: no more than eps of a sum above ``d tiny / eps``)."""
    info = np.finfo(X.dtype)
    return np.flatnonzero(~np.isfinite(sq) | (sq < X.shape[1] * float(info.tiny) / float(info.eps)))


def for_sorted_columns(X: np.ndarray, fn: Callable[[slice, np.ndarray], None], scale: np.ndarray | None = None) -> None:
    """Call ``fn(columns, T)`` where ``T[j]`` holds the sorted values of column j, in parallel.

    With ``scale`` (n,), the values sorted are ``|x_ij| * scale_i``. T is a (width, n) buffer
    reused by the worker: ``fn`` must copy what it keeps (it writes into disjoint slices) and may
    overwrite T.
    """
    if is_torch_array(X):
        return _torch().for_sorted_columns(X, fn, scale)
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


@functools.cache
def sorting_network(n: int, keep: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """The comparators ``(a, b)``, ``a < b``, of Batcher's odd-even merge sort of n values, in order;
    with ``keep``, only those that the sorted positions ``keep`` depend on.

    A comparator puts the smaller of wires a and b on a. The network is that of the next power of
    two with the comparators reaching beyond wire n - 1 dropped: padded with +inf, those wires
    never move. The pruning walks back from the wires ``keep``: a comparator stays when one of its
    wires is read later (Knuth, TAOCP 5.3.4).

    >>> sorting_network(4)
    ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2))
    >>> sorting_network(4, keep=(0,))
    ((0, 1), (2, 3), (0, 2))
    """
    p2 = 1 << max(0, n - 1).bit_length()
    net = []
    p = 1
    while p < p2:
        k = p
        while k >= 1:
            for j in range(k % p, p2 - k, 2 * k):
                for i in range(min(k, p2 - j - k)):
                    a, b = i + j, i + j + k
                    if a // (2 * p) == b // (2 * p) and b < n:
                        net.append((a, b))
            k //= 2
        p *= 2
    if keep is None:
        return tuple(net)
    needed, kept = set(keep), []
    for a, b in reversed(net):
        if a in needed or b in needed:
            kept.append((a, b))
            needed |= {a, b}
    return tuple(kept[::-1])


def for_sorted_rows(
    X, fn: Callable[[slice, Any], None], rows: Sequence[int] | None = None, check: bool = False
) -> np.ndarray | None:
    """Call ``fn(columns, S)`` where ``S[k]`` holds the k-th smallest value of each column, in parallel.

    S is a sequence of n rows of the block, correct at the sorted positions ``rows`` (default:
    all), reused by the worker: ``fn`` must copy what it keeps and must not write into S. On the
    host, columns of at most :data:`NETWORK_MAX` values go through :func:`sorting_network` (pruned
    to ``rows``) as elementwise minima and maxima of whole rows: no transposition, and a block of
    :data:`NETWORK_BYTES` makes each call long enough that two threads do not wait on each other
    for the GIL. Longer columns, and a tensor's device, sort transposed blocks
    (:func:`for_sorted_columns`; S is then the block's transpose). The values are the sort's;
    which of -0 and +0 comes first is not defined, as in ``np.sort``.

    With ``check``, returns :func:`nonfinite_rows` of X, on the host's network path read off the
    block's row sums as the block is loaded (no pass of its own); where a row is not finite, what
    ``fn`` wrote is to be discarded (it may not have been called on every block).
    """
    n, d = X.shape
    if is_torch_array(X) or n > NETWORK_MAX:
        bad = nonfinite_rows(X) if check else None
        if bad is None or not bad.any():
            for_sorted_columns(X, lambda sl, T: fn(sl, T.T))
        return bad
    net = sorting_network(n, None if rows is None else tuple(sorted(set(rows))))
    width = min(d, block_width(n, X.itemsize, NETWORK_BYTES))

    def task(sls):
        bufs = [np.empty(width, X.dtype) for _ in range(n + 2)]  # n wires held, two being written
        lesser, greater = np.minimum, np.maximum
        suspect = np.zeros(n, bool)
        # a worker thread does not inherit the caller's np.errstate; the caller checks the result
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                if check:  # finite sums mean finite rows (a sum that overflows is checked value by value)
                    suspect |= ~np.isfinite(np.add.reduce(X[:, sl], axis=1))
                m = sl.stop - sl.start
                views, free = [buf[:m] for buf in bufs], list(range(n + 2))
                S = [X[i, sl] for i in range(n)]  # a wire reads the input until a comparator writes it
                held = [-1] * n  # the buffer each wire's values are in (-1: still the input)
                # buffers by index, no generator: this loop's Python runs under the GIL
                for a, b in net:
                    i, j = free.pop(), free.pop()
                    lesser(S[a], S[b], out=views[i])
                    greater(S[a], S[b], out=views[j])
                    if held[a] >= 0:
                        free.append(held[a])
                    if held[b] >= 0:
                        free.append(held[b])
                    held[a], held[b] = i, j
                    S[a], S[b] = views[i], views[j]
                fn(sl, S)
        return suspect

    suspect = np.logical_or.reduce(map_blocks(task, d, width))
    if not check:
        return None
    bad = np.zeros(n, bool)
    if suspect.any():
        bad[suspect] = nonfinite_rows(X[suspect])
    return bad


def sum_rows(S: Sequence, start: int, stop: int, out=None):
    """``S[start] + ... + S[stop - 1]`` as the row sums of a contiguous (w, n) block add them up: the
    bits of ``T[:, start:stop].sum(axis=1)`` on the host, for S the rows of :func:`for_sorted_rows`
    (a list of rows, or the transpose of such a block T); on a tensor's device, S's own reduction.
    Written into ``out`` where given.

    >>> sum_rows([np.float32([1.0, 2.0]), np.float32([3.0, 4.0]), np.float32([5.0, 6.0])], 0, 3).tolist()
    [9.0, 12.0]
    """
    if is_torch_array(S):
        total = S[start:stop].sum(0)
        if out is None:
            return total
        out[...] = total
        return out
    if isinstance(S, np.ndarray) and S.T.flags.c_contiguous:  # the block itself: numpy's reduction
        return S[start:stop].T.sum(axis=1, out=out)
    return pairwise_sum([S[i] for i in range(start, stop)], out)


_scratch = threading.local()


def scratch_rows(k: int, like: np.ndarray, use: str) -> list[np.ndarray]:
    """k arrays of like's shape and dtype for the purpose ``use``, this thread's own, reused from call
    to call (their contents are left over). A fresh array per row of a block (more than 128 KiB, so
    glibc maps and unmaps it each time) made :func:`pairwise_sum` several times slower."""
    m, key = like.size, f"{use}-{like.dtype.str}"
    pool = getattr(_scratch, key, [])
    if len(pool) < k or (pool and pool[0].size < m):
        size = max(m, pool[0].size if pool else 0)
        pool = [np.empty(size, like.dtype) for _ in range(max(k, len(pool)))]
        setattr(_scratch, key, pool)
    return [buf[:m].reshape(like.shape) for buf in pool[:k]]


def pairwise_sum(vals: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The elementwise sum of the equal-length rows ``vals`` with the bits of ``add.reduce`` over a
    contiguous axis of ``len(vals)`` values, ``np.stack(vals, axis=1).sum(axis=1)``, without the
    transposition for up to 32 float32 or float64 rows: +0 plus numpy's ``pairwise_sum`` (fewer
    than 8 values added one after another from -0; 8 to 128, eight running sums combined as
    ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest one after another). Written
    into ``out`` where given (it must not be one of ``vals``). A NaN that two operands meet may
    take the other one's sign (the rules never add one: their rows are finite)."""
    m = len(vals)
    if m > 32 or vals[0].dtype not in (np.float32, np.float64):
        return np.stack(vals, axis=1).sum(axis=1, out=out)
    if out is None:
        out = np.empty_like(vals[0])
    if m < 8:
        out[...] = -0.0
        for v in vals:
            out += v
    else:
        r = [out, *scratch_rows(7, out, "pairwise_sum")]
        if m >= 16:  # the running sums r_j of v_j, v_(j+8), v_(j+16) ...
            for j in range(8):
                np.add(vals[j], vals[j + 8], out=r[j])
            for i in range(16, m - m % 8, 8):
                for j in range(8):
                    r[j] += vals[i + j]
            for j in (0, 2, 4, 6):
                r[j] += r[j + 1]
        else:
            for j in (0, 2, 4, 6):
                np.add(vals[j], vals[j + 1], out=r[j])
        r[0] += r[2]
        r[4] += r[6]
        r[0] += r[4]
        for v in vals[m - m % 8 :]:
            out += v
    out += 0  # the reduction starts from the identity, +0 (the sign of a zero sum)
    return out


def abs_row_quantiles(X: np.ndarray, q: float) -> np.ndarray:
    """Exact ``np.quantile(|X[i]|, q)`` (linear interpolation) for every row, O(d) per row."""
    if is_torch_array(X):
        return _torch().abs_row_quantiles(X, q)
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
    if is_torch_array(X):
        return _torch().sign_gram(X)
    n, d = X.shape
    width = min(d, block_width(n, 4))

    def task(sls):
        acc = np.zeros((n, n), np.int64)
        buf = np.empty((n, width), np.float32)
        for sl in sls:
            S = buf[:, : sl.stop - sl.start]
            np.sign(X[:, sl], out=S, casting="unsafe")
            acc += np.rint(np.dot(S, S.T)).astype(np.int64)
        return acc

    return sum(map_blocks(task, d, width))


def column_count(mask: np.ndarray) -> np.ndarray:
    """Number of True entries per column of a boolean (n, w) block (int8 view: no float casts)."""
    if is_torch_array(mask):
        return _torch().column_count(mask)
    return mask.view(np.int8).sum(axis=0, dtype=np.int32)


def column_sign_sum(B: np.ndarray) -> np.ndarray:
    """sum_i sgn(B_ij) per column, exact, as counts of positives minus negatives."""
    if is_torch_array(B):
        return _torch().column_sign_sum(B)
    return column_count(B > 0) - column_count(B < 0)


def signs(B: np.ndarray, dtype=np.float32) -> np.ndarray:
    """sgn(B) as a float matrix, from two comparisons (faster than np.sign)."""
    if is_torch_array(B):
        return _torch().signs(B, dtype)
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
