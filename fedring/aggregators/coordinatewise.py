"""FedAvg mean, coordinate-wise median and trimmed mean (Yin et al., ICML 2018)."""

from __future__ import annotations

import math

import numpy as np  # noqa: F401 (the doctests)

from fedring.errors import ConfigError
from fedring.validate import choice, integer, real

from ._kernels import empty_row, for_sorted_rows, sum_rows
from .base import AggregateResult, Aggregator, SortedRule, checked_mean, register


@register
class Mean(Aggregator):
    r"""FedAvg without defence: :math:`\frac1n\sum_i x_i` (FedSECA Eq. 2, uniform weights).

    Example
    -------
    >>> Mean()(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([4., 5., 6.])
    """

    name = "mean"
    on_device = True

    def _aggregate_checked(self, X, state, reference, rng):
        out, excluded = checked_mean(X)  # one pass when every row is finite
        return AggregateResult(out) if excluded is None else excluded


@register
class Median(SortedRule):
    r"""Coordinate-wise median (Yin et al., ICML 2018; Xie et al. 2018).

    :math:`[\mathrm{Med}(x_1..x_n)]_j = \mathrm{median}(x_{1j}, \dots, x_{nj})`.

    Parameters
    ----------
    variant : {"average", "lower"}
        For even n, ``"average"`` takes the mean of the two middle values (``np.median``,
        ByzFL, fedlib, FLDetector); ``"lower"`` takes the lower one (``torch.median``, the
        FedSECA code).

    Example
    -------
    fedlib's test vector (even n = 4):

    >>> Median()(np.array([[1., 2, 3], [-1, 4, -1], [2, 2, 3], [3, 1, 3]]))
    array([1.5, 2. , 3. ])
    >>> Median(variant="lower")(np.array([[1., 2, 3], [-1, 4, -1], [2, 2, 3], [3, 1, 3]]))
    array([1., 2., 3.])
    """

    name = "median"
    on_device = True

    def __init__(self, f: int = 0, *, variant: str = "average"):
        super().__init__(f)
        self.variant = choice("median.variant", variant, ("average", "lower"))

    def _sorted(self, X, check: bool):
        n = X.shape[0]
        out = empty_row(X)
        lo, hi = (n - 1) // 2, n // 2
        lower = self.variant == "lower" or lo == hi

        def fn(sl, S):
            out[sl] = S[lo] if lower else 0.5 * (S[lo] + S[hi])

        return out, for_sorted_rows(X, fn, rows=(lo, hi), check=check)


@register
class TrimmedMean(SortedRule):
    r"""Coordinate-wise trimmed mean (Yin et al., ICML 2018).

    Per coordinate, sort the n values, drop the b smallest and b largest, average the
    remaining n - 2b: :math:`\frac{1}{n-2b}\sum_{i=b+1}^{n-b} x_{(i)j}`.

    Parameters
    ----------
    trim : int or None
        Values dropped per side. Default: the declared f (ByzFL ``TrMean(f)``, fedlib,
        FLDetector; the server is told the Byzantine count, as Fang et al. assume).
    fraction : float in [0, 0.5) or None
        Alternative to ``trim``: b = floor(fraction * n) (Flower, FedML; FedSECA's CWTM is
        fraction = 0.2, and since its printed normaliser K(1 - 2 beta) is not an integer for
        K = 6, 7, the n - 2b values left are averaged). Give at most one of the two.

    Example
    -------
    >>> TrimmedMean(1)(np.array([[1., 2, 3], [-1, 4, -1], [2, 2, 3], [3, 1, 3]]))
    array([1.5, 2. , 3. ])
    """

    name = "trimmed_mean"
    on_device = True

    def __init__(self, f: int = 0, *, trim: int | None = None, fraction: float | None = None):
        super().__init__(f)
        if trim is not None and fraction is not None:
            raise ConfigError("trimmed_mean.trim", "give either trim (values per side) or fraction, not both")
        self.trim = None if trim is None else integer("trimmed_mean.trim", trim, lo=0)
        self.fraction = None if fraction is None else real("trimmed_mean.fraction", fraction, 0.0, 0.5, hi_open=True)

    def per_side(self, n: int) -> int:
        if self.fraction is not None:
            return math.floor(self.fraction * n + 1e-12)
        return self.f if self.trim is None else self.trim

    def check(self, n):
        b = self.per_side(n)
        if n - 2 * b < 1:
            return f"trimming {b} values per side leaves nothing of n={n} clients; needs n >= 2*{b} + 1"
        return super().check(n)

    def sorts(self, n):
        return self.per_side(n) > 0

    def _sorted(self, X, check: bool):
        n = X.shape[0]
        b = self.per_side(n)
        out = empty_row(X)

        def fn(sl, S):
            o = out[sl]
            sum_rows(S, b, n - b, out=o)
            o /= n - 2 * b

        return out, for_sorted_rows(X, fn, rows=range(b, n - b), check=check)
