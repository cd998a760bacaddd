"""Gaussian noise attack (Blanchard et al., NeurIPS 2017)."""

from __future__ import annotations

from fedring.arrays import Array, like
from fedring.validate import real

from .base import ATTACKS, AttackContext, ModelAttack


@ATTACKS.register
class Gaussian(ModelAttack):
    r"""Every Byzantine client sends pure Gaussian noise.

    .. math:: \tilde g_j \sim \mathcal N(\text{mean}\cdot\mathbf 1,\ \sigma^2 I_d),

    drawn fresh per client and per round from the context's generator.

    Parameters
    ----------
    sigma : float, default 200
        Standard deviation (not variance). 200 is the value of the Fang/Zeno-lineage code,
        used for the BRACE paper's Gaussian attack, whose scale the paper does not give; the
        H+ paper's "N(0, 90)" is ``sigma = sqrt(90)`` if 90 is a variance.
    mean : float, default 0

    References
    ----------
    P. Blanchard, E. M. El Mhamdi, R. Guerraoui, J. Stainer, "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import AttackContext, Gaussian
    >>> ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=None)
    >>> Gaussian(sigma=2.0)(np.zeros((1, 3)), None, ctx).round(4)
    array([[ 0.2515, -0.2642,  1.2808]])
    """

    name = "gaussian"
    knowledge = "own"
    on_device = True

    def __init__(self, sigma: float = 200.0, mean: float = 0.0):
        self.sigma = real("attack.sigma", sigma, lo=0.0, lo_open=True)
        self.mean = real("attack.mean", mean)

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        return like(ctx.rng.normal(self.mean, self.sigma, size=byz.shape), byz)
