"""Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace
from fedring.validate import choice, integer

from ._kernels import combine
from .base import AggregateResult, GramRule, register

# variant -> (distance, neighbours = n - f - offset); self is never its own neighbour
KRUM_VARIANTS: dict[str, tuple[str, int]] = {
    "paper": ("squared", 2),  # Blanchard et al. 2017, Flower, fedlib, FLDetector, FedSECA Eq. 21
    "byzfl": ("squared", 1),  # ByzFL Krum: mean of the n - f - 1 smallest (same ranking as the sum)
    "flpoison": ("euclidean", 1),  # FLPoison krum_compute_scores, Garfield krum.py
    "fedml": ("euclidean", 0),  # FedML KrumDefense (survey version): n - f plain distances
}


def neighbour_count(n: int, f: int, variant: str) -> int:
    """Neighbours summed in a Krum score: ``n - f - offset``, capped at the ``n - 1`` other rows.

    The cap matters for ``fedml`` with ``f = 0``, which asks for ``n`` neighbours: FedML's
    code takes at most ``n - 1`` (without it every score is inf and row 0 always wins).
    """
    return min(n - f - KRUM_VARIANTS[variant][1], n - 1)


def krum_scores(D2: np.ndarray, f: int, variant: str, neighbours: int | None = None) -> np.ndarray:
    r"""Krum score of every row: :math:`s(i) = \sum_{j \in N_i} \|x_i - x_j\|^2` (paper Sec. 4).

    ``D2`` holds squared distances; N_i are the ``neighbours`` closest other rows (default
    from the variant). ``"flpoison"``/``"fedml"`` sum plain distances instead.
    """
    n = D2.shape[0]
    k = neighbour_count(n, f, variant) if neighbours is None else neighbours
    D = np.sqrt(D2) if KRUM_VARIANTS[variant][0] == "euclidean" else D2.copy()
    np.fill_diagonal(D, np.inf)
    return np.sort(D, axis=1)[:, :k].sum(axis=1)


def krum_check(name: str, n: int, f: int, variant: str) -> str | None:
    k = neighbour_count(n, f, variant)
    if variant == "paper" and n <= 2 * f + 2:
        return f"{name} needs n > 2f + 2 (Blanchard et al.), got n={n}, f={f}: use at least {2 * f + 3} clients or a smaller f"
    if variant == "byzfl" and 2 * f >= n:
        return f"{name} (byzfl variant) needs 2f < n, got n={n}, f={f}"
    if k < 1:
        return f"{name} ({variant} variant) sums n - f - {KRUM_VARIANTS[variant][1]} = {k} neighbours; needs at least 1 (n={n}, f={f})"
    return None


@register
class Krum(GramRule):
    r"""Krum: the client whose ``n - f - 2`` nearest neighbours are closest (Blanchard et al. 2017).

    .. math:: i^\star = \arg\min_i \sum_{j \in N_i} \|x_i - x_j\|_2^2, \qquad \mathrm{Krum} = x_{i^\star}

    Ties go to the lowest client index. All pairwise distances come from one float64 Gram
    matrix (one BLAS pass over the input).

    Parameters
    ----------
    variant : {"paper", "byzfl", "flpoison", "fedml"}
        Convention of the distance and the neighbour count; they can pick different clients:

        ==========  ===========  ==============  ==========================================
        variant     distance     neighbours      used by
        ==========  ===========  ==============  ==========================================
        paper       squared      n - f - 2       Blanchard et al., Flower, fedlib, FLDetector
        byzfl       squared      n - f - 1       ByzFL
        flpoison    plain L2     n - f - 1       FLPoison, Garfield
        fedml       plain L2     n - f           FedML (older KrumDefense)
        ==========  ===========  ==============  ==========================================

    Examples
    --------
    >>> Krum(1, variant="byzfl")(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([1., 2., 3.])

    FedML's convention with f = 0 sums the n - 1 other rows (the outlier is never picked):

    >>> Krum(0, variant="fedml").aggregate(np.array([[100, 100], [0, 0], [.1, 0], [0, .1], [.1, .1]])).selected
    array([0., 0., 0., 0., 1.])
    """

    name = "krum"
    selects = True
    on_device = True

    def __init__(self, f: int = 0, *, variant: str = "paper"):
        super().__init__(f)
        self.variant = choice(f"{self.name}.variant", variant, tuple(KRUM_VARIANTS))

    def check(self, n):
        return krum_check(self.name, n, self.f, self.variant) or super().check(n)

    def _select(self, G) -> np.ndarray:
        scores = krum_scores(G.sqdist(), self.f, self.variant)
        return np.argsort(scores, kind="stable")

    def _aggregate_gram(self, X, G, state, reference, rng):
        i = int(self._select(G)[0])
        selected = np.zeros(X.shape[0])
        selected[i] = 1.0
        return AggregateResult(array_namespace(X).asarray(X[i], copy=True), selected)


@register
class MultiKrum(Krum):
    r"""Multi-Krum: the mean of the ``m`` clients with the lowest Krum scores (Blanchard et al. 2017, Sec. 5).

    Parameters
    ----------
    variant : as for ``krum``.
    m : int or None
        Number of clients averaged; default ``n - f`` (ByzFL ``MultiKrum(f)``). ``m = 1`` is Krum.

    Example
    -------
    >>> MultiKrum(1, variant="byzfl")(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([2.5, 3.5, 4.5])
    """

    name = "multikrum"

    def __init__(self, f: int = 0, *, variant: str = "paper", m: int | None = None):
        super().__init__(f, variant=variant)
        self.m = None if m is None else integer("multikrum.m", m, lo=1)

    def count(self, n: int) -> int:
        return n - self.f if self.m is None else self.m

    def check(self, n):
        if self.count(n) > n or self.count(n) < 1:
            return f"multikrum averages m={self.count(n)} clients but there are n={n}"
        return super().check(n)

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        chosen = self._select(G)[: self.count(n)]
        selected = np.zeros(n)
        selected[chosen] = 1.0
        return AggregateResult(combine(selected, X) / len(chosen), selected)
