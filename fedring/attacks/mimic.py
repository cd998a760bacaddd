"""Mimic (Karimireddy, He & Jaggi, ICLR 2022)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import Array, array_namespace
from fedring.validate import integer

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, known, mean, row_products


def mimic_target(honest: Array) -> int:
    r"""The honest client farthest from the mean along the direction of largest variance.

    .. math:: k^* = \arg\max_k |z^\top (g_k - \mu)|, \qquad
        z = \arg\max_{\|z\|=1} z^\top\Big(\sum_k (g_k-\mu)(g_k-\mu)^\top\Big) z

    z is computed exactly from the h x h Gram matrix of the centred gradients (its top
    eigenvector u gives z ∝ Cᵀu and |C z| ∝ |u|), so no random start and no sign ambiguity.
    Ties go to the lowest index. The Gram matrix is summed one column block at a time
    (:func:`~fedring.attacks.base.row_products`).
    """
    mu = mean(honest)

    def gram(c: slice, x: Array) -> tuple[Array]:
        x -= mu[c]
        return (x @ x.T,)

    _, vecs = np.linalg.eigh(row_products(honest, gram)[0])
    return int(np.argmax(np.abs(vecs[:, -1])))


@ATTACKS.register
class Mimic(ModelAttack):
    r"""Every attacker sends a copy of one honest client's gradient.

    .. math:: \tilde g_j = g_{k^*}

    Karimireddy et al. pick k* as the honest client most extreme along the top principal
    direction of the honest gradients, accumulated online over warm-up rounds and then frozen
    (FedSECA Supp. D.4, eq. 17). Attacks here are stateless, so by default k* is recomputed
    every round from that round's honest gradients (:func:`mimic_target`, exact, not the
    online estimate). ``worker`` instead fixes k* to the honest client with that position in
    ``honest`` for the whole run (ByzFL's ``Mimic(epsilon)``), the persistent choice of the
    frozen phase.

    Parameters
    ----------
    worker : int >= 0 or None, default None

    References
    ----------
    S. P. Karimireddy, L. He, M. Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
    Bucketing", ICLR 2022; FedSECA Supp. D.4.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import Mimic
    >>> Mimic().craft(np.zeros((1, 2)), np.array([[0., 0.], [1., 0.], [0., 1.], [5., 5.]]), None)
    array([[5., 5.]])
    """

    name = "mimic"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def __init__(self, worker: int | None = None):
        self.worker = None if worker is None else integer("attack.worker", worker, lo=0)

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if self.worker is not None and self.worker >= n - b:
            return ConfigError("attack.worker", f"must be < the number of honest clients ({n - b}), got {self.worker}")
        return None

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        honest = known(honest)
        k = mimic_target(honest) if self.worker is None else self.worker
        return array_namespace(honest).broadcast_to(honest[k], byz.shape)
