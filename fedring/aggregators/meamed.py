"""Mean around the median, Meamed (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace, device, on_host

from ._kernels import empty_row, for_sorted_columns
from .base import AggregateResult, Aggregator, register


@register
class Meamed(Aggregator):
    r"""Mean around the median: per coordinate, the mean of the n - f values closest to the
    median (Xie et al. 2018; ByzFL ``Meamed(f)``).

    .. math::
        [\mathrm{Meamed}_f(x_1..x_n)]_j = \frac{1}{n - f} \sum_{i \in N_j} x_{ij}, \qquad
        N_j = \text{the } n - f \text{ indices } i \text{ with the smallest } |x_{ij} - \mathrm{med}_j|

    with med_j the coordinate-wise median (mean of the two middle values for even n, as
    ``np.median``). Since n - f > n/2, the chosen values are a run of n - f consecutive sorted
    values that contains the median; the run starts at s, the number of steps s -> s + 1 for
    which the value entering on the right is strictly closer to the median than the one leaving
    on the left. So on a tie at the boundary (two values at the same distance on either side of
    the median) the lower value is kept, whatever the clients' order. ByzFL keeps the one
    ``np.argpartition`` happens to place first, which depends on the order of the rows (the
    tests show a case where it keeps the upper one).

    Sorted column blocks, no copy of the input. Needs n > 2f (as ByzFL).

    Examples
    --------
    ByzFL's test vector:

    >>> Meamed(1)(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([2.5, 3.5, 4.5])

    Median 2 of (0, 1, 2, 3, 4): the n - f = 4 closest values are 1, 2, 3 and one of the
    equally close 0 and 4; the lower, 0, is kept:

    >>> Meamed(1)(np.array([[0.], [1.], [2.], [3.], [4.]]))
    array([1.5])
    """

    name = "meamed"
    on_device = True

    def check(self, n):
        if n <= 2 * self.f:
            return f"meamed needs n > 2f, got n={n}, f={self.f}"
        return super().check(n)

    def _aggregate(self, X, state, reference, rng):
        n = X.shape[0]
        f = self.f
        if f == 0:
            return AggregateResult(X.mean(axis=0))
        k = n - f
        lo, hi = (n - 1) // 2, n // 2
        xp = array_namespace(X)
        positions = xp.arange(n, device=device(X))
        out = empty_row(X)

        def fn(sl, T):
            med = T[:, lo] if lo == hi else (T[:, lo] + T[:, hi]) / 2
            if on_host(T):
                out[sl] = _host_run_sums(T, med, f) / k
                return
            # step s -> s + 1 (s < f) when the entering value T[s + k] beats the leaving T[s]
            start = xp.count_nonzero(T[:, k:] - med[:, None] < med[:, None] - T[:, :f], axis=1)
            run = (positions >= start[:, None]) & (positions < start[:, None] + k)
            out[sl] = xp.where(run, T, 0).sum(axis=1) / k

        for_sorted_columns(X, fn)
        return AggregateResult(out)


def _host_run_sums(T: np.ndarray, med: np.ndarray, f: int) -> np.ndarray:
    """The device's ``where(run, T, 0).sum(axis=1)``, its bits, on a host block T (w, n) of sorted
    rows, which it overwrites: the start s counted one column at a time (only the f columns on
    either side can leave the run), the values outside the run set to +0 through the row of a
    table of the f + 1 possible runs, then the same reduction of the same contiguous (w, n)
    values. numpy's broadcast compares over rows of f values cost several times more."""
    n = T.shape[1]
    k = n - f
    start = np.zeros(len(T), np.intp)
    closer = np.empty(len(T), bool)
    for e in range(f):
        np.less(T[:, k + e] - med, med - T[:, e], out=closer)
        start += closer
    positions = np.arange(n)
    starts = np.arange(f + 1)[:, None]
    outside = (positions < starts) | (positions >= starts + k)
    np.copyto(T, 0, where=np.take(outside, start, axis=0))
    return T.sum(axis=1)
