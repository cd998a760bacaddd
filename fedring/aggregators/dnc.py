"""Divide-and-Conquer, DnC (Shejwalkar, Houmansadr, NDSS 2021), as FLPoison's ``aggregators/dnc.py``."""

from __future__ import annotations

import numpy as np

from fedring.errors import ConfigError
from fedring.validate import integer, real

from ._clustering import centred_column_gram
from ._kernels import combine
from .base import AggregateResult, Aggregator, register


def dnc_scores(X: np.ndarray, cols: np.ndarray) -> np.ndarray:
    r"""DnC's outlier scores on the coordinates ``cols``: :math:`s_i = \langle x_i - \mu, v\rangle^2`.

    :math:`\mu` is the mean of the subsampled rows and v the top right singular vector of the
    centred subsample :math:`X_c`. With :math:`X_c = U \Sigma V^\top`, :math:`X_c v = \sigma_1 u_1`,
    so :math:`s_i = \lambda_1 u_{1i}^2` from the top eigenpair of the n x n matrix
    :math:`X_c X_c^\top`: no SVD of the (n, b) subsample.

    >>> dnc_scores(np.array([[0., 0.], [1., 0.], [2., 0.], [9., 0.]]), np.array([0, 1]))
    array([ 9.,  4.,  1., 36.])
    """
    lam, U = np.linalg.eigh(centred_column_gram(X, np.asarray(cols)))
    return max(float(lam[-1]), 0.0) * U[:, -1] ** 2


@register
class DnC(Aggregator):
    r"""Divide-and-Conquer: drop the clients with the largest projections on the top singular vector.

    Runs on the host: its column subsamples go through the numpy-only helper of the clustering rules (``centred_column_gram``).

    Each of ``iters`` rounds draws b of the d coordinates at random (without replacement),
    centres the subsampled rows on their mean, and scores every client by its squared
    projection on the top right singular vector v of the centred subsample,

    .. math:: s_i = \langle x_{i,S} - \mu_S, v\rangle^2 ,

    keeping the :math:`k = \lfloor n - c f\rfloor` clients of smallest score (ties to the lower
    index). The output is the mean of the clients kept in every round (Shejwalkar and
    Houmansadr, NDSS 2021; the defaults are FLPoison's). When no client is kept in
    every round the output is the zero vector.

    Parameters
    ----------
    fraction : float in (0, 1]
        b = int(fraction * d) coordinates per round (0.2, FLPoison's ``subsample_frac``), at least 1.
    sub_dim : int or None
        Alternative to ``fraction``: b = min(sub_dim, d) (the paper's b, 10,000 in Blades). Give
        at most one of the two.
    iters : int
        Rounds of subsampling (5, FLPoison's ``num_iters``).
    c : float
        Filtering fraction: c f clients are dropped per round (1.0, FLPoison's ``fliter_frac``).

    selected: 1 for the clients kept in every round.

    Examples
    --------
    One round on every coordinate (``fraction=1``): the scores are those of ``dnc_scores``'s
    example, 9, 4, 1 and 36 on the first coordinate, and f = 1 drops the last client:

    >>> DnC(1, fraction=1.0, iters=1)(np.array([[0., 1.], [1., 1.], [2., 1.], [9., 1.]]))
    array([1., 1.])
    """

    name = "dnc"
    selects = True

    def __init__(
        self, f: int = 0, *, fraction: float | None = None, sub_dim: int | None = None, iters: int = 5, c: float = 1.0
    ):
        super().__init__(f)
        if fraction is not None and sub_dim is not None:
            raise ConfigError("dnc.sub_dim", "give either sub_dim (coordinates per round) or fraction, not both")
        self.fraction = None if fraction is None else real("dnc.fraction", fraction, 0.0, 1.0, lo_open=True)
        self.sub_dim = None if sub_dim is None else integer("dnc.sub_dim", sub_dim, lo=1)
        self.iters = integer("dnc.iters", iters, lo=1)
        self.c = real("dnc.c", c, lo=0.0)

    def keep_count(self, n: int) -> int:
        """k = int(n - c f), FLPoison's rounding (so c f = 4.5 of n = 7 keeps 2)."""
        return int(n - self.c * self.f)

    def sample_size(self, d: int) -> int:
        if self.sub_dim is not None:
            return min(self.sub_dim, d)
        fraction = 0.2 if self.fraction is None else self.fraction
        return max(1, min(d, int(fraction * d)))

    def check(self, n):
        k = self.keep_count(n)
        if k < 1:
            return f"dnc keeps int(n - c*f) = {k} clients per round; needs n > c*f, got n={n}, f={self.f}, c={self.c:g}"
        return super().check(n)

    def subsets(self, rng: np.random.Generator, d: int) -> list[np.ndarray]:
        """The random coordinate subsets of the ``iters`` rounds, sorted (the only draws of the rule)."""
        b = self.sample_size(d)
        return [np.sort(rng.choice(d, b, replace=False)) for _ in range(self.iters)]

    def select(self, X: np.ndarray, subsets: list[np.ndarray]) -> np.ndarray:
        """(n,) bool: the clients among the k smallest scores on every subset."""
        n = X.shape[0]
        k = self.keep_count(n)
        keep = np.ones(n, bool)
        for cols in subsets:
            if k < n:
                good = np.zeros(n, bool)
                good[np.argsort(dnc_scores(X, cols), kind="stable")[:k]] = True
                keep &= good
        return keep

    def combine_kept(self, X: np.ndarray, keep: np.ndarray) -> AggregateResult:
        if not keep.any():
            return AggregateResult(np.zeros(X.shape[1], X.dtype), keep.astype(float))
        return AggregateResult(combine(keep, X) / int(keep.sum()), keep.astype(float))

    def _aggregate(self, X, state, reference, rng):
        return self.combine_kept(X, self.select(X, self.subsets(rng, X.shape[1])))
