"""Covariance-bound agnostic filter, CAF (Allouah, Guerraoui, Stephan, ICML 2025)."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice, integer

from ._kernels import combine, gram
from .base import AggregateResult, GramRule, register


def caf_weights(C: np.ndarray, f: int, variant: str = "weighted", max_iter: int = 1000) -> np.ndarray:
    r"""CAF's weights c of the returned mean :math:`\mu_c = \sum_i c_i x_i / \sum_i c_i`.

    ``C`` is a Gram matrix of the n rows around any common point (every step is invariant to
    translation). With :math:`w = c / \sum c` and :math:`K = (I - 1w^\top) C (I - w1^\top)` (the
    Gram matrix of the rows centred on μ_c), the weighted covariance
    :math:`\Sigma_c = \sum_i w_i (x_i - \mu_c)(x_i - \mu_c)^\top` has the nonzero eigenvalues of
    :math:`M = \mathrm{diag}(\sqrt w)\, K\, \mathrm{diag}(\sqrt w)`; with (λ, u) M's top eigenpair,
    the top eigenvector of Σ_c is :math:`v = \sum_i \sqrt{w_i} u_i (x_i - \mu_c) / \sqrt\lambda`
    and the squared projections are :math:`\tau = (K (\sqrt w \odot u))^2 / \lambda`: n x n work.

    ``variant="weighted"`` divides by the largest τ of the rows that still have weight (each
    step zeroes one more row: at most n steps); ``"byzfl"`` by the largest τ of all rows, as
    ByzFL, stopping after ``max_iter`` steps.

    >>> caf_weights(np.array([[0., 0, 0], [0, 1, 2], [0, 2, 4]]), 1)  # scalars 0, 1, 2
    array([1., 1., 1.])
    """
    n = C.shape[0]
    c = np.ones(n)
    best_c, best_lam = c.copy(), np.inf
    for _ in range(max_iter):
        if not c.sum() > n - 2 * f:
            break
        w = c / c.sum()
        Cw = C @ w
        K = C - Cw[:, None] - Cw[None, :] + float(w @ Cw)
        s = np.sqrt(w)
        lams, U = np.linalg.eigh(s[:, None] * K * s[None, :])
        lam = float(lams[-1])
        if lam < best_lam:
            best_c, best_lam = c.copy(), lam
        if not lam > 0:  # the weighted rows coincide: nothing left to filter
            break
        tau = (K @ (s * U[:, -1])) ** 2 / lam
        top = tau[c > 0].max() if variant == "weighted" else tau.max()
        if not top > 0:
            break
        c = np.where(c > 0, c * np.maximum(1.0 - tau / top, 0.0), 0.0)
    return best_c


@register
class CAF(GramRule):
    r"""Covariance-bound agnostic filter: down-weight the clients along the top eigenvector of the
    weighted covariance until the weights sum to n - 2f, and return the weighted mean whose
    covariance had the smallest top eigenvalue (Allouah, Guerraoui, Stephan, ICML 2025,
    Algorithm 2; ByzFL ``CAF(f)``).

    Start from :math:`c_i = 1`; while :math:`\sum_i c_i > n - 2f`:

    .. math::
        \mu_c = \frac{\sum_i c_i x_i}{\sum_i c_i}, \quad
        \Sigma_c = \frac{\sum_i c_i (x_i - \mu_c)(x_i - \mu_c)^\top}{\sum_i c_i}, \quad
        (\lambda, v) = \text{top eigenpair of } \Sigma_c, \quad
        \tau_i = ((x_i - \mu_c)^\top v)^2, \quad c_i \leftarrow c_i \Big(1 - \frac{\tau_i}{\max_j \tau_j}\Big)

    and return the μ_c of the smallest λ met. Everything runs on the n x n Gram matrix (one
    pass over the input, no d x d matrix; :func:`caf_weights`) and the eigenpair is exact
    (LAPACK). fedring differs from ByzFL 0.0.11 where ByzFL's result is random or undefined:

    - ByzFL estimates (λ, v) with one power-iteration step from ``np.random.randn``, so its
      output is random unless Σ_c has rank one; fedring uses the exact eigenpair (when the top
      eigenvalue is repeated, v is LAPACK's choice in its eigenspace).
    - ``variant="weighted"`` (default) takes :math:`\max_j \tau_j` over the clients that still
      have weight. ByzFL takes it over every client: a far outlier already at weight 0 then
      sets the scale, the others lose only about (spread / distance)² of their weight per step,
      and the loop runs for as many steps (74,384 on 10 rows with one at distance 1000 and
      f = 4, ``X_FAR`` of tests/test_byzfl_rules.py; unbounded as the distance grows). Here each
      step zeroes at least one more client, so there are at most n steps. ``variant="byzfl"``
      takes ByzFL's maximum, stopping after ``max_iter`` steps.
    - f = 0 returns the mean (ByzFL returns None: its loop never runs), and when the weighted
      clients coincide (λ = 0) their mean is returned (ByzFL's power step divides by zero).

    Needs n > 2f (as ByzFL).

    Parameters
    ----------
    variant : {"weighted", "byzfl"}
        Which clients set :math:`\max_j \tau_j` (above).
    max_iter : int
        Most filtering steps (1000).

    selected: the weights c_i of the returned mean, in [0, 1].

    Examples
    --------
    ByzFL's test vector:

    >>> CAF(1)(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]))
    array([4., 5., 6.])

    The outlier's weight drops to 0 at the first step; the variants then differ (ByzFL's
    ``CAF(1)`` gives 1.52862199, here exact since d = 1):

    >>> X = np.array([[0.], [1.], [2.], [3.], [40.]])
    >>> CAF(1).aggregate(X).selected
    array([0.91077753, 0.92911958, 0.94535335, 0.95947883, 0.        ])
    >>> CAF(1)(X), CAF(1, variant="byzfl")(X)
    (array([1.52167549]), array([1.52862199]))
    """

    name = "caf"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, variant: str = "weighted", max_iter: int = 1000):
        super().__init__(f)
        self.variant = choice("caf.variant", variant, ("weighted", "byzfl"))
        self.max_iter = integer("caf.max_iter", max_iter, lo=1)

    def check(self, n):
        if n <= 2 * self.f:
            return f"caf needs n > 2f, got n={n}, f={self.f}"
        return super().check(n)

    def first_gram(self, X, state, reference):
        return gram(X) if self.f else None

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        if self.f == 0:
            return AggregateResult(X.mean(axis=0), np.ones(n))
        c = caf_weights(G.C, self.f, self.variant, self.max_iter)
        return AggregateResult(combine(c / c.sum(), X), c)
