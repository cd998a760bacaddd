"""Pre-aggregators composing in front of any rule: NNM (Allouah et al., AISTATS 2023), bucketing
(Karimireddy, He, Jaggi, ICLR 2022) and static norm clipping."""

from __future__ import annotations

import math

import numpy as np

from fedring.arrays import on_host
from fedring.validate import integer, real

from ._blocks import Gram, block_width
from ._kernels import (
    COMBINE_BYTES,
    ROW_RUN_BYTES,
    all_finite,
    combine,
    gram,
    map_blocks,
    nonfinite_rows,
    scaled_mean,
    small,
    sq_norms,
)
from .base import AggregateResult, PreAggregator, nonfinite_from_norms, register_pre
from .coordinatewise import Mean


class RowScaling(PreAggregator):
    """A pre-aggregator that multiplies each row by a factor of the rows' norms (static clipping,
    ARC): ``factors`` from the squared norms, one blocked pass for them (:func:`._kernels.sq_norms`,
    float32-accurate); in front of the mean, the clipped mean straight from the rows
    (:meth:`then_checked`), without the scaled copy."""

    def clips(self, n: int) -> bool:
        """Whether any of ``n`` rows may be scaled (else the rows pass as they are, with no pass)."""
        return True

    def factors(self, sq: np.ndarray) -> np.ndarray:
        """The rows' factors from their squared norms ``sq``."""
        raise NotImplementedError

    def transform(self, X, rng):
        n = X.shape[0]
        if not self.clips(n):
            return X, np.arange(n)
        return X * small(self.factors(sq_norms(X))[:, None], X), np.arange(n)

    def then_checked(self, rule, X, state, reference, rng):
        """The mean of the scaled rows, the bits of ``Mean`` on ``transform(X)``, in one pass
        after the norms' (which also show which rows are finite), without the scaled copy."""
        if type(rule) is not Mean:
            return None
        sq = sq_norms(X)
        excluded = nonfinite_from_norms(X, sq)
        if excluded.any():
            return excluded
        return AggregateResult(scaled_mean(X, self.factors(sq)) if self.clips(X.shape[0]) else X.mean(axis=0))


@register_pre
class NNM(PreAggregator):
    r"""Nearest-neighbour mixing: row i becomes the mean of its n - f nearest rows, itself included.

    :math:`y_i = \frac{1}{n-f} \sum_{j \in N_i} x_j` (ByzFL ``NNM(f)``); distances from one Gram
    pass, ties to the lower index.

    Example
    -------
    >>> NNM(1).transform(np.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]]), None)[0]
    array([[2.5, 3.5, 4.5],
           [2.5, 3.5, 4.5],
           [5.5, 6.5, 7.5]])
    """

    name = "nnm"
    on_device = True

    def check(self, n):
        if n - self.f < 1:
            return f"nnm mixes n - f neighbours, needs n > f, got n={n}, f={self.f}"
        return super().check(n)

    def transform(self, X, rng):
        return self.mixed(X, gram(X)), np.arange(X.shape[0])

    def mixing(self, G: Gram) -> np.ndarray:
        """The (n, n) 0/1 matrix of each row's n - f nearest rows, from the Gram matrix ``G``."""
        n = G.m
        near = np.argsort(G.sqdist(), axis=1, kind="stable")[:, : n - self.f]
        W = np.zeros((n, n))
        np.put_along_axis(W, near, 1.0, axis=1)
        return W

    def mixed(self, X, G: Gram):
        """The mixed rows, from the Gram matrix ``G`` of X (the blocked product, :func:`._kernels.combine`)."""
        Y = combine(self.mixing(G), X)
        Y /= X.shape[0] - self.f
        return Y

    def then_checked(self, rule, X, state, reference, rng):
        """The rule on the mixed rows, with the non-finite check read off the Gram pass that the
        mixing makes anyway (:class:`.base.GramRule`), instead of a separate pass. Then the mean,
        on the host: the mean of the mixed rows in one pass that keeps each block's mixed rows in
        the cache (:func:`_mean_of_mixed`, the same bits), unless it is not finite somewhere."""
        G = gram(X)
        excluded = nonfinite_from_norms(X, np.diag(G.C))
        if excluded.any():
            return excluded
        if type(rule) is Mean and on_host(X) and X.shape[1] > 1:
            out = _mean_of_mixed(X, self.mixing(G), X.shape[0] - self.f)
            if out is not None:
                return AggregateResult(out)
        res = rule.aggregate(self.mixed(X, G), state=state, reference=reference, rng=rng)
        return AggregateResult(res.vector, res.selected)  # as a Pipeline returns it: one row per client


def _mean_of_mixed(X: np.ndarray, W: np.ndarray, k: int) -> np.ndarray | None:
    """``mean(combine(W, X) / k)``, its bits, in one parallel pass over :func:`._kernels.combine`'s
    column blocks: each block's mixed rows (the same BLAS call on the same block) divided by k and
    reduced along axis 0 as :func:`._kernels.mean` reduces them, without writing the n mixed rows
    out and reading them back (d > 1). None where the mean is not finite (an overflow), for the
    plain path to handle.

    >>> _mean_of_mixed(np.array([[1.0, 2.0], [3.0, 6.0]], np.float32), np.array([[1.0, 1.0], [0.0, 1.0]]), 2).tolist()
    [1.75, 3.5]
    """
    n, d = X.shape
    W32 = W.astype(X.dtype)
    out = np.empty(d, X.dtype)
    width = min(d, block_width(n, X.itemsize, COMBINE_BYTES))

    def task(sls):
        Y = np.empty((n, width), X.dtype)
        finite = True
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                m, acc = sl.stop - sl.start, out[sl]
                Yb = Y if m == width else np.empty((n, m), X.dtype)  # np.dot writes contiguous rows only
                np.dot(W32, X[:, sl], out=Yb)
                Yb /= k
                np.add.reduce(Yb, axis=0, out=acc)
                np.true_divide(acc, np.intp(n), out=acc, casting="unsafe")
                finite = finite and bool(np.isfinite(acc).all())
        return finite

    return out if all(map_blocks(task, d, width)) else None


@register_pre
class Bucketing(PreAggregator):
    r"""Random bucketing: shuffle, then average consecutive buckets of s rows (the last over its
    actual members), giving ceil(n/s) rows (ByzFL ``Bucketing(s)``).

    Parameters
    ----------
    s : int
        Bucket size (2).
    """

    name = "bucketing"
    keeps_rows = False
    on_device = True

    def __init__(self, f: int = 0, *, s: int = 2):
        super().__init__(f)
        self.s = integer("bucketing.s", s, lo=1)

    def out_rows(self, n):
        return math.ceil(n / self.s)

    def buckets(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The (m, n) 0/1 membership of the buckets of one draw, and each client's bucket."""
        perm = rng.permutation(n)
        m = self.out_rows(n)
        W = np.zeros((m, n))
        owner = np.empty(n, np.int64)
        for b in range(m):
            members = perm[b * self.s : (b + 1) * self.s]
            W[b, members] = 1.0
            owner[members] = b
        return W, owner

    def transform(self, X, rng):
        W, owner = self.buckets(X.shape[0], rng)
        if self.s <= 2 and on_host(X):
            # any order of two terms gives one sum: the rows' own sums have the product's bits
            return _bucket_means(X, W), owner
        Y = combine(W, X)
        Y /= small(W.sum(axis=1, keepdims=True), X)
        return Y, owner

    def then_checked(self, rule, X, state, reference, rng):
        """Then the mean. On the host (s <= 2, d > 1), the mean of the bucket means in one pass that
        keeps each block's bucket means in the cache (:func:`_mean_of_bucket_means`, the same
        bits); the buckets are drawn first, and the generator is rewound when a non-finite row (or
        an overflow) sends the call down the plain path. On a device, the mean of the bucket means
        as one weighted mean of the rows (client i's weight ``1 / (m |B(i)|)``, one product): one
        pass over the rows, the check for non-finite rows read off its result (with positive
        weights, a column's weighted mean is finite only if its values are); where it is not
        finite, the rows are checked, and with a non-finite row the generator is rewound for the
        plain path's draw over the finite rows."""
        if type(rule) is not Mean or (on_host(X) and (self.s > 2 or X.shape[1] < 2)):
            return None
        start = rng.bit_generator.state
        W, owner = self.buckets(X.shape[0], rng)
        if on_host(X):
            out = _mean_of_bucket_means(X, W)
            if out is None:
                rng.bit_generator.state = start
                return None
            return AggregateResult(out)
        out = combine((1.0 / (W.shape[0] * W.sum(axis=1)))[owner], X)
        if not all_finite(out):
            excluded = nonfinite_rows(X)
            if excluded.any():
                rng.bit_generator.state = start
                return excluded
        return AggregateResult(out)


def _bucket_means(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """The bucket means ``(W @ X) / W.sum(axis=1)`` for 0/1 memberships W of buckets of at most two
    rows, their bits, in one parallel pass over column blocks without the product's multiplications
    by 0: each bucket's members added in index order from +0 (as BLAS starts, which turns -0 into
    +0), then divided by their count. (Three or more members: BLAS adds them in an order of its
    own, so those buckets take the product.)

    >>> _bucket_means(np.array([[1.0, -0.0], [3.0, -0.0], [5.0, 7.0]], np.float32), np.array([[1.0, 1, 0], [0, 0, 1]])).tolist()
    [[2.0, 0.0], [5.0, 7.0]]
    """
    members = [np.flatnonzero(w) for w in W]
    counts = W.sum(axis=1).astype(X.dtype)
    Y = np.empty((len(members), X.shape[1]), X.dtype)

    def task(sls):
        # a worker thread does not inherit the caller's np.errstate; overflow gives inf, as the product
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                for b, rows in enumerate(members):
                    acc = Y[b, sl]
                    np.add(X[rows[0], sl], X.dtype.type(0), out=acc)
                    for r in rows[1:]:
                        np.add(acc, X[r, sl], out=acc)
                    np.true_divide(acc, counts[b], out=acc)

    map_blocks(task, X.shape[1], ROW_RUN_BYTES // X.itemsize)
    return Y


def _mean_of_bucket_means(X: np.ndarray, W: np.ndarray) -> np.ndarray | None:
    """``mean(_bucket_means(X, W))``, its bits, in one parallel pass over column blocks that adds each
    block's bucket means up while they are in the cache, instead of writing the m rows out and
    reading them back: as numpy's reduction along axis 0, +0 plus each bucket mean in turn, then
    divided by m as ``ndarray.mean`` divides (d > 1). None where the mean is not finite (a row
    holding NaN or an infinity, or an overflow), for the plain path to handle.

    >>> _mean_of_bucket_means(np.array([[1.0, -0.0], [3.0, -0.0], [5.0, 8.0]], np.float32), np.array([[1.0, 1, 0], [0, 0, 1]])).tolist()
    [3.5, 4.0]
    """
    members = [np.flatnonzero(w) for w in W]
    counts = W.sum(axis=1).astype(X.dtype)
    d = X.shape[1]
    out = np.empty(d, X.dtype)
    width = min(d, ROW_RUN_BYTES // X.itemsize)  # as the mean: long runs of each row

    def task(sls):
        mean_b = np.empty(width, X.dtype)
        finite = True
        with np.errstate(over="ignore", invalid="ignore"):
            for sl in sls:
                acc, t = out[sl], mean_b[: sl.stop - sl.start]
                acc[...] = 0
                for b, rows in enumerate(members):
                    np.add(X[rows[0], sl], X.dtype.type(0), out=t)
                    for r in rows[1:]:
                        np.add(t, X[r, sl], out=t)
                    np.true_divide(t, counts[b], out=t)
                    acc += t
                np.true_divide(acc, np.intp(len(members)), out=acc, casting="unsafe")
                finite = finite and bool(np.isfinite(acc).all())
        return finite

    return out if all(map_blocks(task, d, width)) else None


@register_pre
class Clipping(RowScaling):
    r"""Static norm clipping: :math:`y_i = \min(1, c / \|x_i\|_2)\, x_i` (ByzFL ``Clipping(c)``).

    Parameters
    ----------
    c : float
        Norm bound (2.0, ByzFL's default).

    Example
    -------
    >>> Clipping(c=5.0).transform(np.array([[3., 4.], [6., 8.]]), None)[0]
    array([[3., 4.],
           [3., 4.]])
    """

    name = "clipping"
    on_device = True

    def __init__(self, f: int = 0, *, c: float = 2.0):
        super().__init__(f)
        self.c = real("clipping.c", c, lo=0.0, lo_open=True)

    def factors(self, sq: np.ndarray) -> np.ndarray:
        """``min(1, c / ||x_i||)`` from the squared row norms ``sq`` (1 for a zero row)."""
        norms = np.sqrt(sq)
        return np.minimum(1.0, np.divide(self.c, norms, out=np.full_like(norms, np.inf), where=norms > 0))
