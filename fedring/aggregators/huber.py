"""Huber-loss minimisation by modified Weiszfeld (Zhao, Yu, Wan, AAAI 2024; FedSECA Supp. E.9)."""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ._kernels import combine, fixed_point
from .base import AggregateResult, GramRule, register


@register
class Huber(GramRule):
    r"""Huber-loss centre (FedSECA's "HuberLoss" baseline, Supp. E.9, Eqs. 31-32).

    .. math::
        \tilde w = \arg\min_v \sum_k \Phi(\|v - x_k\|), \quad
        \Phi(u) = \begin{cases} u^2/2 & u \le \tau \\ \tau u - \tau^2/2 & u > \tau \end{cases}

    solved by iteratively reweighted averaging (the modified Weiszfeld of Eq. 32):

    .. math:: c^{(r+1)} = \frac{\sum_k a_k x_k}{\sum_k a_k}, \quad a_k = \min\Big(1, \frac{\tau}{\max(\epsilon, \|c^{(r)} - x_k\|)}\Big)

    starting at the mean, a point inside the data whatever the rows hold (the paper gives no
    starting point; the FedSECA code starts at 0 in weight space).

    Parameters
    ----------
    tau : float
        Huber threshold (0.2, the paper; its config file has 0.02).
    iters : int
        Maximum updates (100).
    tol : float
        Stop when an update moves c by at most tol (1e-3, the code's early stop).
    eps : float
        Distance floor (1e-6).

    selected: a_k at the final centre (1 = inside the quadratic zone).

    Example
    -------
    With tau larger than every distance the loss is quadratic and the centre is the mean:

    >>> Huber(tau=100.0)(np.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]]))
    array([4., 5., 6.])
    """

    name = "huber"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, tau: float = 0.2, iters: int = 100, tol: float = 1e-3, eps: float = 1e-6):
        super().__init__(f)
        self.tau = real("huber.tau", tau, lo=0.0, lo_open=True)
        self.iters = integer("huber.iters", iters, lo=0)
        self.tol = real("huber.tol", tol, lo=0.0)
        self.eps = real("huber.eps", eps, lo=0.0, lo_open=True)

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        w, a = fixed_point(
            G,
            n,
            np.full(n, 1.0 / n),
            lambda d2: np.minimum(1.0, self.tau / np.maximum(self.eps, np.sqrt(d2))),
            self.iters,
            self.tol,
        )
        return AggregateResult(combine(w, X), a)
