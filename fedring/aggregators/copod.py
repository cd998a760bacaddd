"""COPOD distance-based outlier suppression, COPOD-DOS (Alkhunaizi et al., MICCAI 2022; FedSECA Supp. E.3, Eq. 24),
with COPOD by Li, Zhao, Botta, Ionescu, Hu (ICDM 2020) as implemented in pyod."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice

from ._kernels import combine
from .base import AggregateResult, GramRule, register


def _skew_sign(M: np.ndarray) -> np.ndarray:
    """Sign of the biased sample skewness of each column (scipy.stats.skew); 0 for constant columns."""
    c = M - M.mean(axis=0)
    m2 = (c**2).mean(axis=0)
    m3 = (c**3).mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(m2 > 0, m3 / np.where(m2 > 0, m2, 1.0) ** 1.5, 0.0)
    return np.sign(s)


def copod_scores(M: np.ndarray) -> np.ndarray:
    r"""COPOD outlier score of every row of M (rows = samples, columns = features), as pyod computes it.

    Per feature j, with the empirical CDFs :math:`F_l(x) = \#\{x_{kj} \le x\}/n` and
    :math:`F_r(x) = \#\{x_{kj} \ge x\}/n`: :math:`U_l = -\log F_l(x_{ij})`,
    :math:`U_r = -\log F_r(x_{ij})`, :math:`U_s` = U_l if the feature's skewness is negative,
    U_r if positive, U_l + U_r if zero (pyod's formula), and the score is
    :math:`\sum_j \max(U_s, (U_l + U_r)/2)`.
    """
    n = M.shape[0]
    left = (M[None, :, :] <= M[:, None, :]).sum(axis=1) / n
    right = (M[None, :, :] >= M[:, None, :]).sum(axis=1) / n
    U_l, U_r = -np.log(left), -np.log(right)
    s = _skew_sign(M)
    U_skew = U_l * -np.sign(s - 1) + U_r * np.sign(s + 1)
    return np.maximum(U_skew, 0.5 * (U_l + U_r)).sum(axis=1)


@register
class CopodDos(GramRule):
    r"""COPOD-DOS: softmax-weighted mean with COPOD outlier scores of the pairwise distances.

    .. math::
        a^S_{ij} = 1 - \frac{x_i^\top x_j}{\|x_i\|\|x_j\|}, \quad a^E_{ij} = \|x_i - x_j\|, \quad
        r = \tfrac12\big(\mathrm{COPOD}(M^S) + \mathrm{COPOD}(M^E)\big), \quad
        \lambda = \mathrm{softmax}(-r), \quad \tilde g = \sum_k \lambda_k x_k

    The paper prints softmax(r), which would give outliers the largest weights; the sign is
    taken as a typo (the FedSECA code negates it too). Both K x K matrices come from one Gram
    pass. Cosines of a zero vector are 0.

    Parameters
    ----------
    variant : {"halved", "code"}
        ``"halved"`` (default): lambda = softmax(-(r^S + r^E)/2), the paper's r (the mean of
        the two outlier scores) with the sign corrected; ``"code"``: softmax(-(r^S + r^E)) as
        the FedSECA code does (no halving).

    selected: lambda / max(lambda).

    Example
    -------
    Identical clients get equal weights:

    >>> CopodDos()(np.array([[1., 2, 3], [1, 2, 3], [1, 2, 3]]))
    array([1., 2., 3.])
    """

    name = "copod"
    on_device = True
    selects = True

    def __init__(self, f: int = 0, *, variant: str = "halved"):
        super().__init__(f)
        self.variant = choice("copod.variant", variant, ("halved", "code"))

    def weights(self, G) -> np.ndarray:
        inner = G.inner()
        norms = np.sqrt(np.maximum(np.diag(inner), 0.0))
        denom = np.outer(norms, norms)
        cos = np.divide(inner, denom, out=np.zeros_like(inner), where=denom > 0)
        MS = 1.0 - np.clip(cos, -1.0, 1.0)
        ME = np.sqrt(G.sqdist())
        r = copod_scores(MS) + copod_scores(ME)
        if self.variant == "halved":
            r = 0.5 * r
        z = -r - (-r).max()
        lam = np.exp(z)
        return lam / lam.sum()

    def _aggregate_gram(self, X, G, state, reference, rng):
        lam = self.weights(G)
        return AggregateResult(combine(lam, X), lam / lam.max())
