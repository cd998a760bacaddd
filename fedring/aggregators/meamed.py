"""Mean around the median, Meamed (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace, device, on_host

from ._kernels import empty_row, for_sorted_rows, pairwise_sum, scratch_rows
from .base import SortedRule, register


@register
class Meamed(SortedRule):
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

    def sorts(self, n):
        return self.f > 0

    def _sorted(self, X, check: bool):
        n = X.shape[0]
        f = self.f
        k = n - f
        lo, hi = (n - 1) // 2, n // 2
        xp = array_namespace(X)
        positions = xp.arange(n, device=device(X))
        out = empty_row(X)

        def fn(sl, S):
            if on_host(X):
                _host_run_sums(S, f, out=out[sl])
                out[sl] /= k
                return
            T = S.T
            med = T[:, lo] if lo == hi else (T[:, lo] + T[:, hi]) / 2
            # step s -> s + 1 (s < f) when the entering value T[s + k] beats the leaving T[s]
            start = xp.count_nonzero(T[:, k:] - med[:, None] < med[:, None] - T[:, :f], axis=1)
            run = (positions >= start[:, None]) & (positions < start[:, None] + k)
            out[sl] = xp.where(run, T, 0).sum(axis=1) / k

        return out, for_sorted_rows(X, fn, check=check)


def _host_run_sums(S, f: int, out: np.ndarray | None = None) -> np.ndarray:
    """The device's ``where(run, T, 0).sum(axis=1)``, its bits, on the host's n sorted rows S
    (:func:`._kernels.for_sorted_rows`): the median, the start s counted row by row (only the f rows
    on either side can leave the run), the values outside the run +0, the sum in numpy's order
    (:func:`._kernels.pairwise_sum`), into ``out`` where given. Its rows are this thread's scratch
    (:func:`._kernels.scratch_rows`): no fresh array per row of a block."""
    n = len(S)
    k = n - f
    lo, hi = (n - 1) // 2, n // 2
    med, lower, upper, *masked = scratch_rows(3 + 2 * f, S[0], "meamed")
    if lo == hi:
        np.copyto(med, S[lo])
    else:
        np.add(S[lo], S[hi], out=med)
        med /= 2
    word = np.dtype(f"i{med.itemsize}")
    start = np.zeros(len(med), np.uint8 if f < 256 else word)  # counted in bytes where they suffice
    closer = np.empty(len(med), bool)
    for e in range(f):
        np.subtract(S[k + e], med, out=upper)
        np.subtract(med, S[e], out=lower)
        np.less(upper, lower, out=closer)
        np.add(start, closer.view(np.uint8), out=start)
    # +0 outside the run through a mask of whole words (a masked copy branches on every value):
    # row i < f is in the run when start <= i, row i >= k when start > i - k; the sign of
    # i - start (resp. i - k - start), spread over a word by an arithmetic shift, is that mask
    start_w = start.astype(word)
    keep = np.empty(len(med), word)
    for buf, i in zip(masked, [*range(f), *range(k, n)]):
        np.subtract(i if i < f else i - k, start_w, out=keep)
        np.right_shift(keep, 8 * word.itemsize - 1, out=keep)  # -1 where negative, else 0
        if i < f:
            np.invert(keep, out=keep)
        np.bitwise_and(S[i].view(word), keep, out=buf.view(word))
    return pairwise_sum([*masked[:f], *(S[i] for i in range(f, k)), *masked[f:]], out)
