"""Mean around the median, Meamed (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018)."""

from __future__ import annotations

import numpy as np  # noqa: F401 (the doctests)

from fedring.arrays import array_namespace, device

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
            # step s -> s + 1 (s < f) when the entering value T[s + k] beats the leaving T[s]
            start = xp.count_nonzero(T[:, k:] - med[:, None] < med[:, None] - T[:, :f], axis=1)
            run = (positions >= start[:, None]) & (positions < start[:, None] + k)
            out[sl] = xp.where(run, T, 0).sum(axis=1) / k

        for_sorted_columns(X, fn)
        return AggregateResult(out)
