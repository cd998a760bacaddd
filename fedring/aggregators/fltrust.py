"""FLTrust (Cao, Fang, Liu, Gong, NDSS 2021): trust scores from a clean server gradient."""

from __future__ import annotations

import numpy as np

from ._kernels import combine, row_stats, sqnorm, zero_row
from .base import AggregateResult, Aggregator, register


@register
class FLTrust(Aggregator):
    r"""FLTrust with the server's gradient g_0 on its small clean data set (a clean-data baseline of the H+ paper).

    .. math::
        TS_m = \mathrm{ReLU}(\cos(g_m, g_0)), \quad \bar g_m = \frac{\|g_0\|}{\|g_m\|} g_m, \quad
        \mathrm{FLTrust} = \frac{\sum_m TS_m \bar g_m}{\sum_m TS_m}

    (zero vector when every trust score is 0; zero uploads get TS = 0). The training loop
    computes ``reference`` on the server's clean set (its size is the ``server_samples``
    setting; FLTrust's root data set has 100 samples).

    selected: the trust scores TS_m.

    Example
    -------
    Trust scores (0.8, 0, 1); rescaled rows (0.6, 0.8) and (0, 1):

    >>> FLTrust()(np.array([[3., 4.], [-3., -4.], [0., 10.]]), reference=np.array([0., 1.]))
    array([0.26666667, 0.91111111])
    """

    name = "fltrust"
    selects = True
    needs_reference = True
    on_device = True

    def _aggregate(self, X, state, reference, rng):
        sq, dots = row_stats(X, reference[None, :])
        norms = np.sqrt(sq)
        ref_norm = float(np.sqrt(sqnorm(reference)))
        ok = norms > 0
        cos = np.zeros(len(sq))
        if ref_norm > 0:
            cos[ok] = dots[ok, 0] / (norms[ok] * ref_norm)
        ts = np.maximum(cos, 0.0)
        if ts.sum() <= 0:
            return AggregateResult(zero_row(X), ts)
        coef = np.zeros(len(sq))
        coef[ok] = ts[ok] * ref_norm / norms[ok]
        return AggregateResult(combine(coef / ts.sum(), X), ts)
