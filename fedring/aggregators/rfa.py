"""Geometric median by smoothed Weiszfeld: RFA (Pillutla, Kakade, Harchaoui, IEEE TSP 2022)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace, device
from fedring.validate import choice, integer, real

from ._kernels import combine, fixed_point, gram
from .base import AggregateResult, GramRule, register


@register
class GeoMed(GramRule):
    r"""Geometric median :math:`\arg\min_z \sum_i \|z - x_i\|_2` (RFA, smoothed Weiszfeld).

    .. math::
        z^{(r+1)} = \frac{\sum_i \beta_i x_i}{\sum_i \beta_i}, \qquad
        \beta_i = \frac{1}{\max(\nu, \|z^{(r)} - x_i\|_2)}

    (RFA Algorithm 2 with uniform weights; FedSECA Eq. 25; the H+ paper's GM). Every iterate
    is an affine combination of the rows, so after one Gram pass the iterations cost O(n^2)
    each, whatever their number; only the final point is materialised.

    Parameters
    ----------
    iters : int
        Maximum Weiszfeld updates (100; FedSECA's RFA baseline uses 3, ByzFL ``T=3``).
    tol : float
        Stop once an update moves z by at most tol (1e-5, the H+ paper's tolerance; 0 = run
        all ``iters``).
    nu : float
        Smoothing floor on the distances (1e-6, the FedSECA code's ``stability_nu``; ByzFL 0.1).
    init : {"mean", "zero"}
        Starting point: the mean of the rows, or the zero vector (ByzFL, the FedSECA code in
        weight space).

    selected: beta_i / max(beta), the relative Weiszfeld weights at the final point.

    Example
    -------
    ByzFL's ``GeometricMedian()`` (nu = 0.1, T = 3, start at 0):

    >>> GeoMed(iters=3, tol=0, nu=0.1, init="zero")(np.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]]))
    array([3.78788764, 4.78788764, 5.78788764])
    """

    name = "geomed"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, iters: int = 100, tol: float = 1e-5, nu: float = 1e-6, init: str = "mean"):
        super().__init__(f)
        self.iters = integer("geomed.iters", iters, lo=0)
        self.tol = real("geomed.tol", tol, lo=0.0)
        self.nu = real("geomed.nu", nu, lo=0.0, lo_open=True)
        self.init = choice("geomed.init", init, ("mean", "zero"))

    def first_gram(self, X, state, reference):
        d = X.shape[1]
        return gram(
            X, array_namespace(X).zeros((1, d), dtype=X.dtype, device=device(X)) if self.init == "zero" else None
        )

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        w0 = np.zeros(G.m)
        if G.m == n:  # the mean's start
            w0[:] = 1.0 / n
        else:
            w0[n] = 1.0
        w, beta = fixed_point(G, n, w0, lambda d2: 1.0 / np.maximum(self.nu, np.sqrt(d2)), self.iters, self.tol)
        return AggregateResult(combine(w[:n], X), beta / beta.max())
