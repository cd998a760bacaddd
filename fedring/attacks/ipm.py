"""Inner product manipulation (Xie, Koyejo & Gupta, "Fall of Empires", UAI 2019/PMLR 2020).

Two names for the same attack, each with the parametrisation and default of the paper in
this project that uses it: ``ipm`` as in FedSECA (−ε μ, ε = 1.3), ``foe`` as in the H+ paper
(q μ, q = −0.1).
"""

from __future__ import annotations

import numpy as np

from fedring.arrays import Array, array_namespace, like
from fedring.validate import real

from .base import ATTACKS, AttackContext, ModelAttack, by_columns, known, mean


@ATTACKS.register
class IPM(ModelAttack):
    r"""Send a negative multiple of the honest mean, so ⟨true gradient, aggregate⟩ turns negative.

    .. math:: \tilde g_j = -(\varepsilon + \delta_j)\,\mu_{\mathcal H}, \qquad
        \delta_j \sim U(-\text{jitter}, \text{jitter})

    (Xie et al., eq. for IPM; FedSECA Supp. D.3, eqs. 14-15, with ε = 1.3 and per-attacker
    jitter δ ~ U(−0.05, 0.05); FedSECA draws δ once per client, here it is drawn per round.)

    Parameters
    ----------
    epsilon : float > 0, default 1.3
    jitter : float >= 0, default 0

    References
    ----------
    C. Xie, O. Koyejo, I. Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner
    Product Manipulation", UAI 2019, PMLR 115:261-270 (2020).

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import IPM
    >>> IPM(epsilon=0.5).craft(np.zeros((1, 2)), np.array([[1., 2.], [3., -6.]]), None)
    array([[-1.,  1.]])
    """

    name = "ipm"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def __init__(self, epsilon: float = 1.3, jitter: float = 0.0):
        self.epsilon = real("attack.epsilon", epsilon, lo=0.0, lo_open=True)
        self.jitter = real("attack.jitter", jitter, lo=0.0)

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        eps = np.full((byz.shape[0], 1), self.epsilon)
        if self.jitter:
            eps += ctx.rng.uniform(-self.jitter, self.jitter, size=eps.shape)
        mu = mean(known(honest))
        neg = like(-eps, mu)
        return by_columns(byz, lambda c: neg * mu[c])


@ATTACKS.register
class FoE(ModelAttack):
    r"""Fall of Empires in the H+ paper's form: a multiple q of the honest mean.

    .. math:: \tilde g_j = \frac{q}{h}\sum_{i\in\mathcal H} g_i = q\,\mu_{\mathcal H}

    H+ Appendix D uses q = −0.1 against every rule except MCA (q = −3h there, which equals its
    sign-flip vector). ByzFL's ``FallOfEmpires(attack_factor)`` (releases 0.0.1 to 0.0.9) is
    q = 1 − attack_factor; ByzFL 0.0.10 and later have only ``InnerProductManipulation(tau)``,
    q = −tau.

    Parameters
    ----------
    q : float, default -0.1

    References
    ----------
    Xie, Koyejo, Gupta (see :class:`IPM`); H+ paper, Appendix D.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import FoE
    >>> FoE(q=-2).craft(np.zeros((1, 3)), np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]), None)
    array([[ -8., -10., -12.]])
    """

    name = "foe"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def __init__(self, q: float = -0.1):
        self.q = real("attack.q", q)

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        mu = mean(known(honest))
        return array_namespace(mu).broadcast_to(self.q * mu, byz.shape)
