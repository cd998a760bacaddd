"""The H+ paper's own attack (Appendix D, "our attack")."""

from __future__ import annotations

from fedring.arrays import Array, array_namespace

from .base import ATTACKS, AttackContext, ModelAttack, known, mean


@ATTACKS.register
class HPlusAttack(ModelAttack):
    r"""Send minus the honest mean.

    .. math:: \tilde g_j = -\frac{1}{h}\sum_{i\in\mathcal H} g_i

    The H+ paper designs it so that the norm penalty of similarity-based rules cannot help:
    the malicious vector has exactly the honest mean's norm. (The paper's clean-data variant
    also averages the server's clean gradient g_0 in; fedring's attacks never see the server's
    clean gradient, so only the no-clean-data form is implemented.)

    References
    ----------
    H+: An Efficient Similarity-Aware Aggregation for Byzantine Resilient Federated Learning,
    Appendix D ("our attack").

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import HPlusAttack
    >>> HPlusAttack().craft(np.zeros((1, 2)), np.array([[1., 2.], [3., -6.]]), None)
    array([[-2.,  2.]])
    """

    name = "hplus_attack"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        mu = mean(known(honest))
        return array_namespace(mu).broadcast_to(-mu, byz.shape)
