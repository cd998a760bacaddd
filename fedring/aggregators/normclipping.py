"""Norm clipping with optional weak DP (Sun, Kairouz, Suresh, McMahan, 2019), as FLPoison's
``aggregators/normclipping.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import real

from ._kernels import combine, row_stats, small
from .base import AggregateResult, Aggregator, nonfinite_from_norms, register


def clip_factors(norms: np.ndarray, threshold: float, eps: float = 1e-6) -> np.ndarray:
    r"""FLPoison's ``normclipping`` factors :math:`\min(1, c / (\|x_i\| + \epsilon))`.

    >>> clip_factors(np.array([0.0, 1.0, 6.0]), 3.0)
    array([1.        , 1.        , 0.49999992])
    """
    return np.minimum(1.0, threshold / (norms + eps))


@register
class NormClipping(Aggregator):
    r"""Norm clipping: every upload scaled to norm at most c, then the mean, with optional Gaussian noise.

    .. math:: \frac1n \sum_i x_i \min\Big(1, \frac{c}{\|x_i\| + 10^{-6}}\Big) \;+\; \mathcal N\Big(0, \frac{\sigma^2}{n} I\Big)

    Sun et al., "Can You Really Backdoor Federated Learning?", arXiv:1911.07963 (2019): norm
    bounding, and "weak differential privacy" that adds N(0, σ²) to each upload. The mean of n
    such noises is N(0, σ²/n): fedring draws that once from the round's ``rng`` instead of n
    vectors of d values (the same distribution; FLPoison draws per client, in float32).

    Parameters
    ----------
    threshold : float
        c (3.0, FLPoison's ``norm_threshold``).
    noise : float
        σ, the weak-DP noise per upload (0: off, FLPoison's ``weakDP = False``; its noise when on
        is 0.002).

    selected: the clipping factors.

    Examples
    --------
    The second upload, of norm 10, is scaled to norm 3 (less 3e-7), and the mean halves it:

    >>> NormClipping()(np.array([[1., 0.], [0., 10.]]))
    array([0.5       , 1.49999985])
    """

    name = "normclipping"
    selects = True
    on_device = True

    def __init__(self, f: int = 0, *, threshold: float = 3.0, noise: float = 0.0):
        super().__init__(f)
        self.threshold = real("normclipping.threshold", threshold, lo=0.0, lo_open=True)
        self.noise = real("normclipping.noise", noise, lo=0.0)

    def clipped_mean(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The deterministic part: (mean of the clipped uploads, clipping factors)."""
        return self._clipped_mean(X, row_stats(X)[0])

    def _clipped_mean(self, X, sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        factor = clip_factors(np.sqrt(sq), self.threshold)
        return combine(factor, X) / X.shape[0], factor

    def _aggregate_checked(self, X, state, reference, rng):
        sq = row_stats(X)[0]  # the norms show which rows are finite: no separate pass
        excluded = nonfinite_from_norms(X, sq)
        if excluded.any():
            return excluded
        n, d = X.shape
        mean, factor = self._clipped_mean(X, sq)
        if self.noise > 0:
            mean = mean + small(self.noise / np.sqrt(n) * rng.standard_normal(d), X)  # the host's draws
        return AggregateResult(mean, factor)
