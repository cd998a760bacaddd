"""Rescalings of a reference gradient: sign flipping and scaling."""

from __future__ import annotations

from fedring.arrays import Array, array_namespace
from fedring.validate import choice, real

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, column_sum, known, mean

SOURCES = ("own", "mean", "sum")


def _reference(source: str, byz: Array, honest: Array | None) -> Array:
    """The attackers' own rows (b, d), or the honest mean or sum (d,), in float64."""
    if source == "own":
        xp = array_namespace(byz)
        return xp.astype(byz, xp.float64)
    honest = known(honest)
    return mean(honest) if source == "mean" else column_sum(honest)


@ATTACKS.register
class SignFlip(ModelAttack):
    r"""Send the negated, scaled reference gradient.

    .. math:: \tilde g_j = -\,s \cdot r_j, \qquad r_j = \begin{cases}
        g_j & \text{source = own (each attacker its own gradient)}\\
        \frac1h\sum_{i\in\mathcal H} g_i & \text{source = mean}\\
        \sum_{i\in\mathcal H} g_i & \text{source = sum}\end{cases}

    ``own`` is the classic reversed-gradient attack (knowledge ``own``); ``mean`` is ByzFL's
    ``SignFlipping``; ``source=sum, scale=3`` is the H+ paper's sign-flip attack (Appendix D:
    ``-3 * sum of honest uploads``). ``mean`` and ``sum`` are omniscient.

    Parameters
    ----------
    source : {"own", "mean", "sum"}, default "own"
    scale : float > 0, default 1

    References
    ----------
    Z. Allen-Zhu, F. Ebrahimianghazani, J. Li, D. Alistarh, "Byzantine-Resilient Non-Convex
    Stochastic Gradient Descent", ICLR 2021; H+ paper, Appendix D.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import SignFlip
    >>> SignFlip(source="sum", scale=3).craft(np.zeros((1, 2)), np.array([[1., 2.], [3., -4.]]), None)
    array([[-12.,   6.]])
    """

    name = "signflip"
    blockwise = True
    on_device = True

    def __init__(self, source: str = "own", scale: float = 1.0):
        self.source = choice("attack.source", source, SOURCES)
        self.scale = real("attack.scale", scale, lo=0.0, lo_open=True)
        self.knowledge = "own" if source == "own" else "omniscient"

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        return array_namespace(byz).broadcast_to(-self.scale * _reference(self.source, byz, honest), byz.shape)


@ATTACKS.register
class Scaling(ModelAttack):
    r"""Send the reference gradient multiplied by a large factor.

    .. math:: \tilde g_j = \varepsilon \cdot \mu_{\mathcal H} \quad\text{(source = mean, FedSECA eq. 19)}
        \qquad\text{or}\qquad \tilde g_j = \varepsilon \cdot g_j \quad\text{(source = own)}

    FedSECA (Supp. D.6, eq. 19) defines Scaling on the honest mean with ε = 10, which makes
    the update explode in the honest direction. ``source=own`` scales each attacker's own
    gradient (model-replacement style, as FLDetector's ``scaling_attack`` does with ε = n);
    that variant needs no knowledge of other clients.

    Parameters
    ----------
    factor : float, default 10
        ε; must be non-zero (a negative factor on the mean is IPM).
    source : {"mean", "own", "sum"}, default "mean"

    References
    ----------
    FedSECA paper, Supp. D.6, eq. (19).

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import Scaling
    >>> Scaling().craft(np.zeros((2, 2)), np.array([[1., 2.], [3., -4.]]), None)
    array([[ 20., -10.],
           [ 20., -10.]])
    """

    name = "scaling"
    blockwise = True
    on_device = True

    def __init__(self, factor: float = 10.0, source: str = "mean"):
        self.factor = real("attack.factor", factor)
        if self.factor == 0:
            raise ConfigError("attack.factor", "must be non-zero")
        self.source = choice("attack.source", source, SOURCES)
        self.knowledge = "own" if source == "own" else "omniscient"

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        return array_namespace(byz).broadcast_to(self.factor * _reference(self.source, byz, honest), byz.shape)
