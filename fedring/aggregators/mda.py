"""Minimum-diameter averaging (El Mhamdi, Guerraoui, Guirguis, Hoang, Rouault, PODC 2020)."""

from __future__ import annotations

import math

import numpy as np

from fedring.validate import integer

from ._kernels import combine, gram
from .base import AggregateResult, GramRule, register


def fibonacci(k: int) -> int:
    """F(k) with F(1) = F(2) = 1."""
    a, b = 0, 1
    for _ in range(k):
        a, b = b, a + b
    return a


def mda_search_bound(n: int, f: int) -> int:
    """Most nodes the exact search of :class:`MDA` can visit for n rows and f removals.

    One vertex-cover test with budget f visits at most ``F(f + 3) - 1`` nodes (each node
    either removes a forced vertex, or branches on a vertex of degree >= 2: remove it, or
    keep it and remove its >= 2 far neighbours, so N(f) <= 1 + N(f - 1) + N(f - 2)); the
    search runs at most ``ceil(log2(n(n-1)/2))`` tests to find the diameter and ``n`` to pick
    the subset.

    >>> [mda_search_bound(n, f) for n, f in [(7, 1), (11, 2), (100, 10), (100, 18)]]
    [24, 68, 26216, 1236785]
    """
    if f == 0 or n < 2:
        return 0
    return (n + math.ceil(math.log2(n * (n - 1) / 2))) * (fibonacci(f + 3) - 1)


class _FarGraph:
    """The graph joining the rows farther apart than r (bitsets), and vertex-cover tests on it."""

    def __init__(self, D2: np.ndarray, r: float):
        bits = np.packbits(D2 > r, axis=1, bitorder="little")
        self.adj = [int.from_bytes(row.tobytes(), "little") for row in bits]

    def cover(self, alive: int, budget: int) -> bool:
        """Whether removing at most ``budget`` of the ``alive`` vertices leaves no edge among them."""
        adj = self.adj
        best_v, best_deg, deg_sum = -1, 0, 0
        rest = alive
        while rest:
            low = rest & -rest
            v = low.bit_length() - 1
            rest ^= low
            deg = (adj[v] & alive).bit_count()
            deg_sum += deg
            if deg > best_deg:
                best_v, best_deg = v, deg
        if best_deg == 0:
            return True
        edges = deg_sum // 2
        if budget == 0 or edges > budget * best_deg:  # each removal covers at most best_deg edges
            return False
        if best_deg == 1:  # a matching: one removal per edge
            return edges <= budget
        bit = 1 << best_v
        if best_deg > budget:  # keeping v would remove more than the budget: v goes
            return self.cover(alive & ~bit, budget - 1)
        return self.cover(alive & ~bit, budget - 1) or self.cover(alive & ~bit & ~adj[best_v], budget - best_deg)


def min_diameter_subset(D2: np.ndarray, f: int) -> np.ndarray:
    """Indices (sorted) of the first ``n - f`` rows, in ``itertools.combinations`` order, whose
    largest pairwise squared distance is smallest; ``D2`` is the (n, n) squared distances.

    A subset S of n - f rows has diameter <= r exactly when the rows left out cover every
    pair farther apart than r (a vertex cover of at most f vertices of the "far" graph), so
    the smallest diameter is the least pairwise distance r that admits such a cover (binary
    search over the distinct distances), and the lexicographically first subset of that
    diameter keeps each row in turn whenever a cover still exists. Exact; O(phi^f) per test
    (:func:`mda_search_bound`) instead of the C(n, f) subsets of a plain enumeration.

    >>> D2 = np.array([[0, 1, 4, 81], [1, 0, 1, 64], [4, 1, 0, 49], [81, 64, 49, 0]])
    >>> min_diameter_subset(D2, 1).tolist(), min_diameter_subset(D2, 2).tolist()
    ([0, 1, 2], [0, 1])
    """
    n = D2.shape[0]
    k = n - f
    if f == 0 or k < 2:
        return np.arange(k)
    values = np.unique(D2[np.triu_indices(n, 1)])
    everyone = (1 << n) - 1
    lo, hi = 0, len(values) - 1  # the largest distance always works: nothing is farther
    while lo < hi:
        mid = (lo + hi) // 2
        if _FarGraph(D2, values[mid]).cover(everyone, f):
            hi = mid
        else:
            lo = mid + 1
    far = _FarGraph(D2, values[lo])
    kept: list[int] = []
    kept_bits, alive, removed = 0, everyone, 0
    for i in range(n):
        bit = 1 << i
        if not alive & bit:  # already removed: it is far from a kept row
            continue
        if len(kept) < k and not far.adj[i] & kept_bits:
            drop = far.adj[i] & alive  # keeping i removes its far neighbours
            cost = drop.bit_count()
            if removed + cost <= f and far.cover(alive & ~bit & ~drop, f - removed - cost):
                kept.append(i)
                kept_bits |= bit
                alive &= ~bit & ~drop
                removed += cost
                continue
        alive &= ~bit
        removed += 1
    return np.array(kept, dtype=np.int64)


@register
class MDA(GramRule):
    r"""Minimum-diameter averaging: the mean of the n - f clients whose largest pairwise
    distance is smallest (El Mhamdi et al., PODC 2020; ByzFL ``MDA(f)``).

    .. math::
        S^\star \in \arg\min_{S \subset [n],\ |S| = n - f}\ \max_{i, j \in S} \|x_i - x_j\|_2,
        \qquad \mathrm{MDA}_f(x_1..x_n) = \frac{1}{n - f} \sum_{i \in S^\star} x_i

    Among subsets of equal diameter the first in ``itertools.combinations(range(n), n - f)``
    order wins, as in ByzFL (which enumerates all C(n, f) subsets). fedring finds the same
    subset without enumerating (:func:`min_diameter_subset`): the diameter is a pairwise
    distance r, and the rows left out must cover every pair farther apart than r, a vertex
    cover of at most f vertices, found by a bounded search whose size depends on f, not on
    C(n, f); the distances come from one Gram pass (no d x d or n x n x d array).

    Needs n > 2f (as ByzFL). The search's worst case grows as phi^f (:func:`mda_search_bound`);
    ``check`` refuses a configuration whose worst case exceeds ``max_nodes`` search nodes (the
    default allows f <= 17 at n = 100, about 10 s in the worst case at some 10 µs a node; usual
    inputs need a few thousand nodes, milliseconds).

    Parameters
    ----------
    max_nodes : int
        Most search nodes allowed in the worst case (1,000,000).

    selected: 1 for the n - f averaged clients.

    Examples
    --------
    ByzFL's test vector:

    >>> MDA(1)(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([2.5, 3.5, 4.5])

    An outlier is left out; of the two subsets of diameter 2 the first in order is taken:

    >>> MDA(2).aggregate(np.array([[0., 0.], [1., 0.], [2., 0.], [3., 0.], [50., 50.]]))
    AggregateResult(vector=array([1., 0.]), selected=array([1., 1., 1., 0., 0.]), excluded=None)
    """

    name = "mda"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, max_nodes: int = 1_000_000):
        super().__init__(f)
        self.max_nodes = integer("mda.max_nodes", max_nodes, lo=1)

    def check(self, n):
        if n <= 2 * self.f:
            return f"mda needs n > 2f, got n={n}, f={self.f}"
        bound = mda_search_bound(n, self.f)
        if bound > self.max_nodes:
            return (
                f"mda's exact search for f={self.f} among n={n} clients may visit {bound:,} nodes, more than "
                f"mda.max_nodes={self.max_nodes:,}: use a smaller f or raise mda.max_nodes"
            )
        return super().check(n)

    def first_gram(self, X, state, reference):
        return gram(X) if self.f else None

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        chosen = min_diameter_subset(G.sqdist(), self.f) if self.f else np.arange(n)
        selected = np.zeros(n)
        selected[chosen] = 1.0
        return AggregateResult(combine(selected / len(chosen), X), selected)
