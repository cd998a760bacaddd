"""signSGD with majority vote (Bernstein et al., ICLR 2019) and sign-aggregated RLR (Ozdayi, Kantarcioglu, Gel, AAAI 2021)."""

from __future__ import annotations

import math

import numpy as np

from fedring.arrays import array_namespace
from fedring.validate import integer

from ._kernels import column_sign_sum, empty_row, map_columns
from .base import AggregateResult, Aggregator, register


def sign_sum(X: np.ndarray) -> np.ndarray:
    """S = sum_i sgn(x_i), exact (integer-valued, in X's dtype)."""
    S = empty_row(X)

    def task(sls):
        for sl in sls:
            S[sl] = column_sign_sum(X[:, sl])

    map_columns(X, task)
    return S


@register
class SignSGD(Aggregator):
    r"""Majority vote of the clients' signs (the BRACE paper's signSGD baseline): :math:`\mathrm{sgn}\big(\sum_i \mathrm{sgn}(g_i)\big)`.

    The output is in {-1, 0, +1} (0 on ties, sgn(0) = 0); the loop applies ``w <- w - lr * vector``.

    Example
    -------
    >>> SignSGD()(np.array([[1., -2, 3], [2, 2, -1], [-4, 1, 0], [3, 5, 0]]))
    array([1., 1., 0.])
    """

    name = "signsgd"
    on_device = True

    def _aggregate(self, X, state, reference, rng):
        return AggregateResult(array_namespace(X).sign(sign_sum(X)))


@register
class RLR(Aggregator):
    r"""Robust learning rate on the sign vote (sign-aggregated RLR, the form whose 1-bit cost the BRACE paper counts).

    .. math::
        S = \sum_i \mathrm{sgn}(g_i), \quad \rho_k = \begin{cases} +1 & |S_k| \ge \theta \\ -1 & \text{otherwise}\end{cases},
        \quad \mathrm{RLR} = \rho \odot \mathrm{sgn}(S)

    Where too few clients agree, the step is reversed. Output in {-1, 0, +1}.

    Parameters
    ----------
    theta : int or None
        Agreement threshold. Default None: ceil(0.2 n), the ratio of the RLR authors' CIFAR-10
        setting (8 of 40 agents); 20 for the BRACE paper's 100 clients (it gives no theta).

    Example
    -------
    Sign sums S = (2, 2, 0): with theta = 3 every coordinate lacks agreement and is reversed:

    >>> RLR(theta=3)(np.array([[1., -2, 3], [2, 2, -1], [-4, 1, 0], [3, 5, 0]]))
    array([-1., -1.,  0.])
    """

    name = "rlr"
    on_device = True

    def __init__(self, f: int = 0, *, theta: int | None = None):
        super().__init__(f)
        self.theta = None if theta is None else integer("rlr.theta", theta, lo=0)

    def threshold(self, n: int) -> int:
        return math.ceil(0.2 * n) if self.theta is None else self.theta

    def _aggregate(self, X, state, reference, rng):
        xp = array_namespace(X)
        S = sign_sum(X)
        rho = xp.astype(xp.where(xp.abs(S) >= self.threshold(X.shape[0]), 1, -1), X.dtype)
        out = rho * xp.sign(S)
        out += 0.0  # -0 -> 0
        return AggregateResult(out)
