"""Smallest maximum eigenvalue averaging (Allouah, Guerraoui, Gupta, Pinot, Stephan, ICML 2023)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from fedring.validate import integer

from ._kernels import combine, gram
from .base import AggregateResult, GramRule, register

#: matrix entries of the subsets whose eigenvalues one batched LAPACK call computes (32 MiB)
BATCH_ENTRIES = 1 << 22


def subset_max_eigenvalues(C: np.ndarray, subsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Largest eigenvalue of the covariance of every subset of rows, from their Gram matrix.

    For a subset S of k rows, :math:`\Sigma_S = \frac1k \sum_{i \in S} (x_i - \mu_S)(x_i - \mu_S)^\top`
    has the nonzero eigenvalues of :math:`\frac1k J C_{SS} J` (J = I - 11ᵀ/k, C any Gram matrix
    of the rows around a common point), a k x k problem whatever d. Returns the eigenvalues
    and the largest absolute entry of each C_SS (the scale of their rounding error).

    >>> C = np.array([[0., 0, 0], [0, 1, 2], [0, 2, 4]])  # rows 0, 1, 2 on a line, at 0, 1, 2
    >>> subset_max_eigenvalues(C, np.array([[0, 1], [0, 2], [1, 2]]))[0]
    array([0.25, 1.  , 0.25])
    """
    sub = C[subsets[:, :, None], subsets[:, None, :]]
    scale = np.abs(sub).max(axis=(1, 2))
    sub -= sub.mean(axis=1, keepdims=True)
    sub -= sub.mean(axis=2, keepdims=True)
    return np.linalg.eigvalsh(sub)[:, -1] / subsets.shape[1], scale


@register
class SMEA(GramRule):
    r"""Smallest maximum eigenvalue averaging: the mean of the n - f clients whose empirical
    covariance has the smallest largest eigenvalue (Allouah et al., ICML 2023; ByzFL ``SMEA(f)``).

    .. math::
        S^\star \in \arg\min_{S \subset [n],\ |S| = n - f} \lambda_{\max}\Big(\frac{1}{|S|}
        \sum_{i \in S} (x_i - \mu_S)(x_i - \mu_S)^\top\Big), \qquad
        \mathrm{SMEA}_f = \frac{1}{n - f} \sum_{i \in S^\star} x_i

    Every one of the C(n, f) subsets is examined, as in ByzFL, in
    ``itertools.combinations(range(n), n - f)`` order; the first of the smallest wins, with
    eigenvalues within a relative 1e-12 counted as equal (so that rounding does not decide
    between subsets of equal spread). The eigenvalue is exact (LAPACK on the k x k centred Gram
    matrix of the subset, k = n - f, from one Gram pass over the input: no d x d matrix); ByzFL
    estimates it with one power-iteration step from a random vector (``np.random.randn``), so
    its choice is random unless one subset clearly wins.

    Needs n > 2f (as ByzFL); ``check`` refuses more than ``max_subsets`` subsets (each costs an
    eigenvalue problem of size n - f: about 10 µs at n - f = 20, 0.3 ms at 98).

    Parameters
    ----------
    max_subsets : int
        Most subsets C(n, f) examined (100,000).

    selected: 1 for the n - f averaged clients.

    Examples
    --------
    ByzFL's test vector:

    >>> SMEA(1)(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([2.5, 3.5, 4.5])

    Scalars 0, 1, 2, 3: {0, 1, 2} and {1, 2, 3} have the same spread, the first is taken:

    >>> SMEA(1).aggregate(np.array([[0.], [1.], [2.], [3.]])).selected
    array([1., 1., 1., 0.])
    """

    name = "smea"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, max_subsets: int = 100_000):
        super().__init__(f)
        self.max_subsets = integer("smea.max_subsets", max_subsets, lo=1)

    def check(self, n):
        if n <= 2 * self.f:
            return f"smea needs n > 2f, got n={n}, f={self.f}"
        count = math.comb(n, self.f)
        if count > self.max_subsets:
            return (
                f"smea examines every subset of n - f clients: C({n}, {self.f}) = {count:,} is more than "
                f"smea.max_subsets={self.max_subsets:,}; use a smaller f or raise smea.max_subsets"
            )
        return super().check(n)

    def first_gram(self, X, state, reference):
        return gram(X) if self.f else None

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        k = n - self.f
        chosen = np.arange(n)
        if self.f:
            C = G.C
            subsets = itertools.combinations(range(n), k)
            lam, scale = [], []
            batch_size = min(4096, max(1, BATCH_ENTRIES // (k * k)))
            while batch := list(itertools.islice(subsets, batch_size)):
                values, spread = subset_max_eigenvalues(C, np.array(batch, dtype=np.int64))
                lam.append(values)
                scale.append(spread)
            lams, scales = np.concatenate(lam), np.concatenate(scale)
            best = int(np.argmin(lams))
            tie = lams <= lams[best] + 1e-12 * (abs(lams[best]) + scales[best] / k)
            first = int(np.argmax(tie))
            chosen = np.array(next(itertools.islice(itertools.combinations(range(n), k), first, None)))
        selected = np.zeros(n)
        selected[chosen] = 1.0
        return AggregateResult(combine(selected / k, X), selected)
