"""Zeno++ (Xie, Koyejo, Gupta, ICML 2020), synchronous filtering with a clean server gradient."""

from __future__ import annotations

import numpy as np

from fedring.validate import real

from ._kernels import combine, row_stats, sqnorm, zero_row
from .base import AggregateResult, Aggregator, register


@register
class ZenoPP(Aggregator):
    r"""Zeno++ score test against the server's clean gradient v (a clean-data baseline of the H+ paper).

    Each upload is rescaled to the reference norm, :math:`\tilde g_m = \frac{\|v\|}{\|g_m\|} g_m`,
    scored by the estimated descent :math:`\mathrm{score}_m = \gamma \langle v, \tilde g_m\rangle - \rho \|\tilde g_m\|^2`
    and accepted if :math:`\mathrm{score}_m \ge -\gamma \epsilon`. The result is the mean of
    the accepted rescaled uploads (Zeno++ applies the rescaled candidate); the zero vector
    (no step) if none is accepted. The asynchronous machinery is dropped.

    Parameters
    ----------
    gamma : float
        The learning-rate factor of the score (1.0; the score only compares gamma with rho and eps).
    rho : float
        Weight of the norm penalty (0.001).
    eps : float
        Tolerance (0.1).

    ``reference`` is the server's gradient on its clean set (``server_samples``).

    The H+ paper gives no rho and eps for Zeno++; these defaults accept a
    rescaled upload when cos(g_m, v) >= rho / gamma - eps / ||v||^2.

    selected: 1 for accepted uploads.

    Example
    -------
    >>> ZenoPP()(np.array([[3., 4.], [-3., -4.], [0., 10.]]), reference=np.array([0., 1.]))
    array([0.3, 0.9])
    """

    name = "zenopp"
    selects = True
    needs_reference = True
    on_device = True

    def __init__(self, f: int = 0, *, gamma: float = 1.0, rho: float = 0.001, eps: float = 0.1):
        super().__init__(f)
        self.gamma = real("zenopp.gamma", gamma, lo=0.0, lo_open=True)
        self.rho = real("zenopp.rho", rho, lo=0.0)
        self.eps = real("zenopp.eps", eps, lo=0.0)

    def _aggregate(self, X, state, reference, rng):
        sq, dots = row_stats(X, reference[None, :])
        norms = np.sqrt(sq)
        v2 = sqnorm(reference)
        scale = np.divide(np.sqrt(v2), norms, out=np.zeros_like(norms), where=norms > 0)
        score = self.gamma * scale * dots[:, 0] - self.rho * v2 * (norms > 0)
        accepted = (score >= -self.gamma * self.eps) & (norms > 0)
        if not accepted.any():
            return AggregateResult(zero_row(X), accepted.astype(float))
        coef = np.where(accepted, scale, 0.0) / accepted.sum()
        return AggregateResult(combine(coef, X), accepted.astype(float))
