"""R-TiesMerge: TIES-Merging (Yadav et al., NeurIPS 2023) with sign-count election (FedSECA Supp. E.8)."""

from __future__ import annotations

import numpy as np  # noqa: F401 (the doctests)

from fedring.arrays import array_namespace
from fedring.validate import choice, real

from ._kernels import (
    abs_row_quantiles,
    column_count,
    column_sign_sum,
    empty_row,
    map_columns,
    ratio,
    small,
)
from .base import AggregateResult, Aggregator, register


@register
class RTiesMerge(Aggregator):
    r"""Robust TIES-Merging (FedSECA Supp. E.8, Eqs. 29-30).

    .. math::
        u = \mathrm{sgn}\Big[\sum_k \mathrm{sgn}(g_k)\Big], \quad
        v_k^\varphi = g_k^\varphi\, I\big(|g_k^\varphi| > \mathrm{quantile}(|g_k|, \gamma)\big), \quad
        \tilde g^\varphi = \frac{\sum_k \delta_k^\varphi v_k^\varphi}{\sum_k \delta_k^\varphi},\
        \delta_k^\varphi = I(u^\varphi v_k^\varphi > 0)

    (0 where no client agrees). The quantile is numpy's linear-interpolation quantile of
    each client's |g_k| over all coordinates.

    Parameters
    ----------
    gamma : float in [0, 1)
        Sparsification factor (0.9: keep the top 10 % magnitudes of each client).
    election : {"sign", "magnitude"}
        ``"sign"``: u from the raw sign counts (Eq. 30, the paper); ``"magnitude"``:
        u = sgn(sum_k v_k), vanilla TIES, which the FedSECA code uses although the text
        rejects it (attackers can scale their magnitudes).

    Example
    -------
    gamma = 0 drops each client's smallest magnitudes (strict ">" against the minimum):

    >>> RTiesMerge(gamma=0.0)(np.array([[1., -2, 3], [2, 2, -1], [4, -1, 1]]))
    array([ 3., -2.,  3.])
    """

    name = "ties"
    on_device = True

    def __init__(self, f: int = 0, *, gamma: float = 0.9, election: str = "sign"):
        super().__init__(f)
        self.gamma = real("ties.gamma", gamma, 0.0, 1.0, hi_open=True)
        self.election = choice("ties.election", election, ("sign", "magnitude"))

    def _aggregate(self, X, state, reference, rng):
        xp = array_namespace(X)
        lam = small(abs_row_quantiles(X, self.gamma)[:, None], X)
        out = empty_row(X)

        def task(sls):
            for sl in sls:
                B = X[:, sl]
                V = B * (xp.abs(B) > lam)  # multiplying by the mask beats np.where on random masks
                u = xp.astype(xp.sign(column_sign_sum(B) if self.election == "sign" else V.sum(axis=0)), X.dtype)
                keep = (V * u) > 0
                num = (V * keep).sum(axis=0)
                den = column_count(keep)
                out[sl] = ratio(num, den)

        map_columns(X, task)
        return AggregateResult(out)
