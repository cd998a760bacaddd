"""MoNNA, the mean of a trusted vector's nearest neighbours (Farhadkhani, Guerraoui, Gupta, Hoang,
Pinot, Stephan, ICML 2023)."""

from __future__ import annotations

import copy

import numpy as np

from fedring.validate import integer

from ._kernels import all_finite, combine, sqdist_to, zero_row
from .base import AggregateResult, Aggregator, nonfinite_from_norms, register


@register
class MoNNA(Aggregator):
    r"""MoNNA: the mean of the n - f clients nearest to a trusted vector (Farhadkhani et al.,
    ICML 2023; ByzFL ``MoNNA(f, idx)``).

    .. math:: \mathrm{MoNNA}_f(x_1..x_n) = \frac{1}{n - f} \sum_{i \in N(t)} x_i

    with N(t) the n - f rows nearest to the trusted vector t (ties to the lower index; ByzFL's
    ``argpartition`` breaks a tie at the boundary in an order numpy does not specify). In the
    paper, t is the aggregating node's own vector (peer-to-peer learning). On fedring's server:

    - ``idx = None`` (default): t is the server's own gradient on its clean samples
      (``reference``, as FLTrust's root data set; ``server_samples``); needs the reference.
    - ``idx = i``: t is client i's row (ByzFL ``MoNNA(f, idx=i)``; the row is among its own
      neighbours). Client i must be honest for the guarantee. When rows are left out (a
      non-finite upload, client sampling), ``idx`` still names client i; if client i's row is
      missing or non-finite the round's update is zero with every weight 0, and a sampled
      cohort of fewer than i + 1 clients gets no update (``check``).

    Distances come from one pass over the differences to the trusted vector
    (:func:`._kernels.sqdist_to`, no copy of the input), which also finds the non-finite rows.
    Needs n > 2f (as ByzFL).

    Parameters
    ----------
    idx : int or None
        The trusted client (None: the server's reference gradient).

    selected: 1 for the n - f averaged clients.

    Examples
    --------
    ByzFL's test vector (``MoNNA(1, 1)``):

    >>> MoNNA(1, idx=1)(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([2.5, 3.5, 4.5])

    Around the server's reference gradient:

    >>> MoNNA(1)(np.array([[0., 1.], [1., 1.], [9., 9.]]), reference=np.array([1., 0.]))
    array([0.5, 1. ])
    """

    name = "monna"
    selects = True
    on_device = True

    def __init__(self, f: int = 0, *, idx: int | None = None):
        super().__init__(f)
        self.idx = None if idx is None else integer("monna.idx", idx, lo=0)
        self.needs_reference = self.idx is None

    def check(self, n):
        if n <= 2 * self.f:
            return f"monna needs n > 2f, got n={n}, f={self.f}"
        if self.idx is not None and self.idx >= n:
            return f"monna.idx={self.idx} names no client: there are n={n}"
        return super().check(n)

    def _distances(self, X, reference) -> np.ndarray:
        return sqdist_to(X, reference) if self.idx is None else sqdist_to(X, idx=self.idx)

    def _aggregate_checked(self, X, state, reference, rng):
        # the distances' pass shows the non-finite rows: a distance is finite when its row and the
        # trusted vector are (row idx's own is 0 whatever it holds, so that row is checked apart)
        d2 = self._distances(X, reference)
        check = d2
        if self.idx is not None and not all_finite(X[self.idx]):
            check = d2.copy()
            check[self.idx] = np.nan
        excluded = nonfinite_from_norms(X, check)
        if excluded.any():
            return excluded
        return self._nearest_mean(X, d2)

    def _aggregate(self, X, state, reference, rng):
        return self._nearest_mean(X, self._distances(X, reference))

    def _nearest_mean(self, X, d2: np.ndarray) -> AggregateResult:
        n = X.shape[0]
        near = np.argsort(d2, kind="stable")[: n - self.f]
        selected = np.zeros(n)
        selected[near] = 1.0
        return AggregateResult(combine(selected / len(near), X), selected)

    # client idx keeps its identity when rows are left out ------------------------------------

    def _trusting(self, position: int) -> MoNNA:
        other = copy.copy(self)
        other.idx = position
        return other

    def _without_trusted(self, X, n: int) -> AggregateResult:
        return AggregateResult(zero_row(X), np.zeros(n))

    def _aggregate_finite_rows(self, X, excluded, state, reference, rng):
        if self.idx is None:
            return super()._aggregate_finite_rows(X, excluded, state, reference, rng)
        n = X.shape[0]
        keep = np.flatnonzero(~excluded)
        rule = self._trusting(int(np.count_nonzero(~excluded[: self.idx])))
        rule = rule.with_f(max(self.f - (n - keep.size), 0))
        if excluded[self.idx] or rule.check(keep.size) is not None:
            return self._without_trusted(X, n)._replace(excluded=excluded)
        result = rule.aggregate(X[keep], reference=reference, rng=rng)
        selected = np.zeros(n)
        selected[keep] = result.selected
        return AggregateResult(result.vector, selected, excluded)

    def aggregate_part(self, rule, rows, keep, state, reference, rng):
        if self.idx is None:
            return super().aggregate_part(rule, rows, keep, state, reference, rng)
        position = int(np.searchsorted(keep, self.idx))
        if position == len(keep) or keep[position] != self.idx:
            return self._without_trusted(rows, len(keep))
        return super().aggregate_part(rule._trusting(position), rows, keep, state, reference, rng)
