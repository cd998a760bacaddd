"""Maximum correntropy aggregation, MCA (Luan, Li, Liu, Chen, IEEE TNNLS 2024)."""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ._kernels import combine, fixed_point
from .base import AggregateResult, GramRule, register


@register
class MCA(GramRule):
    r"""Maximum-correntropy centre (a base rule of the H+ paper's experiments).

    .. math::
        z = \arg\max_z \sum_m \exp\Big(-\frac{\|z - x_m\|^2}{2\sigma^2}\Big), \qquad
        z \leftarrow \frac{\sum_m a_m x_m}{\sum_m a_m},\ a_m = \exp\Big(-\frac{\|z - x_m\|^2}{2\sigma^2}\Big)

    by fixed-point iteration from the mean, weights computed in log space (no underflow).

    Parameters
    ----------
    sigma : float or None
        Kernel width. The H+ paper does not give it; default None sets
        sigma = median_m ||x_m - x_med|| with x_med the medoid (the row with the least summed
        distance), a scale that outliers cannot inflate while they are a minority.
    iters : int
        Maximum updates (100).
    tol : float
        Stop when an update moves z by at most tol (1e-5, the H+ paper's tolerance).

    selected: a_m / max(a) at the final centre.

    Example
    -------
    With a wide kernel every row gets weight ~1 and the centre is ~the mean:

    >>> MCA(sigma=1e6)(np.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]]))
    array([4., 5., 6.])
    """

    name = "mca"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, sigma: float | None = None, iters: int = 100, tol: float = 1e-5):
        super().__init__(f)
        self.sigma = None if sigma is None else real("mca.sigma", sigma, lo=0.0, lo_open=True)
        self.iters = integer("mca.iters", iters, lo=0)
        self.tol = real("mca.tol", tol, lo=0.0)

    def kernel_width(self, D2: np.ndarray) -> float:
        if self.sigma is not None:
            return self.sigma
        D = np.sqrt(D2)
        spread = float(np.median(D[int(D.sum(axis=1).argmin())]))
        if spread > 0:
            return spread
        positive = D[D > 0]
        return float(positive.min()) if positive.size else 1.0

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        two_s2 = 2.0 * self.kernel_width(G.sqdist()) ** 2

        def weights(d2):
            logw = -d2 / two_s2
            return np.exp(logw - logw.max())

        w, a = fixed_point(G, n, np.full(n, 1.0 / n), weights, self.iters, self.tol)
        return AggregateResult(combine(w, X), a / a.max())
