"""Bulyan (El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace, device

from ._kernels import empty_row, for_sorted_columns, gram
from .base import AggregateResult, GramRule, register
from .krum import krum_scores


@register
class Bulyan(GramRule):
    r"""Bulyan on top of Krum (El Mhamdi et al. 2018, Algorithm 1).

    1. Selection: apply Krum recursively, theta = n - 2f times, each time to the clients not
       yet selected (Krum score over the remaining set R with ``|R| - f - 2`` neighbours,
       at least 1; ties to the lowest index).
    2. Aggregation, per coordinate j: with beta = theta - 2f, the mean of the beta selected
       values closest to their median,
       :math:`\frac1\beta \sum_{i \in M_j} x_{ij}`.

    The beta values closest to the median are a contiguous run of the sorted column; among
    equally close runs the lower one is taken. Needs n >= 4f + 3.

    Example
    -------
    >>> Bulyan(1)(np.array([[0.], [1.], [2.], [3.], [100.], [4.], [5.]]))
    array([2.])
    """

    name = "bulyan"
    selects = True
    on_device = True

    def check(self, n):
        if n < 4 * self.f + 3:
            return (
                f"bulyan needs n >= 4f + 3, got n={n}, f={self.f}: use at least {4 * self.f + 3} clients or a smaller f"
            )
        return super().check(n)

    def select(self, D2: np.ndarray) -> np.ndarray:
        n = D2.shape[0]
        theta = n - 2 * self.f
        remaining = list(range(n))
        chosen = []
        for _ in range(theta):
            sub = D2[np.ix_(remaining, remaining)]
            k = max(1, len(remaining) - self.f - 2)
            i = int(np.argmin(krum_scores(sub, self.f, "paper", neighbours=min(k, len(remaining) - 1))))
            chosen.append(remaining.pop(i))
        return np.array(sorted(chosen))

    def first_gram(self, X, state, reference):
        return gram(X) if self.f else None

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        chosen = self.select(G.sqdist()) if self.f else np.arange(n)
        S = X[chosen] if self.f else X
        theta = len(chosen)
        beta = theta - 2 * self.f
        xp, dev = array_namespace(X), device(X)
        out = empty_row(X)
        lo, hi = (theta - 1) // 2, theta // 2
        starts = xp.arange(theta - beta + 1, device=dev)
        run = xp.arange(beta, device=dev)

        def fn(sl, T):
            med = 0.5 * (T[:, lo] + T[:, hi])
            # window [s, s + beta): its farthest member from the median decides how close it is
            reach = xp.maximum(med[:, None] - T[:, starts], T[:, starts + beta - 1] - med[:, None])
            window = xp.argmin(reach, axis=1)[:, None] + run
            out[sl] = xp.take_along_axis(T, window, axis=1).sum(axis=1) / beta

        for_sorted_columns(S, fn)
        selected = np.zeros(n)
        selected[chosen] = 1.0
        return AggregateResult(out, selected)
