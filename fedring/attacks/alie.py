"""A Little Is Enough (Baruch, Baruch & Goldberg, NeurIPS 2019)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from fedring.arrays import Array, array_namespace, like
from fedring.validate import choice, real

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, by_columns, known, need_rows


def alie_z(n: int, f: int) -> float:
    r"""Baruch et al.'s :math:`z_{\max}` for n clients of which f attack.

    .. math:: s = \lfloor n/2 + 1 \rfloor - f, \qquad z_{\max} = \Phi^{-1}\!\left(\frac{n - f - s}{n - f}\right)

    s is the number of honest "supporters" the attackers need so that, with their f votes,
    they hold a majority; z is then the largest shift (in honest standard deviations) that
    leaves s honest values farther from the mean than the attackers. This is the form of
    Blades, FLPoison and Garfield. At small n it degenerates: it is negative for
    (n, f) = (10, 1) and zero for (10, 2); it is undefined (infinite) once f >= floor(n/2 + 1),
    where this function raises.

    Examples
    --------
    >>> from fedring.attacks.alie import alie_z
    >>> [round(alie_z(n, f), 4) for n, f in [(10, 1), (10, 2), (25, 5), (50, 20)]]
    [-0.1397, 0.0, 0.2533, 0.8416]
    """
    s = math.floor(n / 2 + 1) - f
    if not (n > f >= 1) or not 0 < (n - f - s) / (n - f) < 1:
        raise ConfigError(
            "attack.z",
            f"Baruch et al.'s z_max is undefined for n={n} clients with f={f} "
            f"attackers (needs 1 <= f < floor(n/2 + 1)); give attack.z explicitly",
        )
    return NormalDist().inv_cdf((n - f - s) / (n - f))


@ATTACKS.register
class ALIE(ModelAttack):
    r"""Shift the honest mean by z coordinate-wise standard deviations.

    .. math:: \tilde g_j = \mu + (z + \delta_j)\,\sigma, \qquad \delta_j \sim U(-\text{jitter}, \text{jitter})

    μ and σ are the coordinate-wise mean and standard deviation (``ddof``) of the honest
    gradients (``stats="honest"``, the omniscient form FedSECA and H+ assume) or of
    the attackers' own pre-attack gradients (``stats="byzantine"``: Baruch et al.'s
    non-omniscient setting, knowledge ``collusion``). z defaults to :func:`alie_z` with n the
    number of clients and f the *actual* number of attackers (the attackers know how many they
    are). δ is FedSECA's per-attacker jitter (Supp. D; it draws δ once per client, here it is
    drawn per round from the context's generator).

    Sign convention: ``+ z sigma`` as in Blades, FLPoison, ByzFL and the H+ paper (``a + c nu``,
    c = 0.7). FedSECA's eq. (13) prints ``mu - z sigma``; pass a negative z for that.
    ddof: 1 (unbiased, ``torch.std``, ByzFL) by default; FLPoison uses 0.

    Parameters
    ----------
    z : float or None, default None (Baruch's formula)
    ddof : {0, 1}, default 1
    stats : {"honest", "byzantine"}, default "honest"
    jitter : float >= 0, default 0

    References
    ----------
    M. Baruch, G. Baruch, Y. Goldberg, "A Little Is Enough: Circumventing Defenses For
    Distributed Learning", NeurIPS 2019; FedSECA Supp. D.2, eq. (13); H+ Appendix D.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import ALIE
    >>> ALIE(z=1.5).craft(np.zeros((1, 3)), np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]), None)
    array([[ 8.5,  9.5, 10.5]])
    """

    name = "alie"
    blockwise = True
    on_device = True

    def __init__(self, z: float | None = None, ddof: int = 1, stats: str = "honest", jitter: float = 0.0):
        self.z = None if z is None else real("attack.z", z)
        self.ddof = choice("attack.ddof", ddof, (0, 1))
        self.stats = choice("attack.stats", stats, ("honest", "byzantine"))
        self.jitter = real("attack.jitter", jitter, lo=0.0)
        self.knowledge = "omniscient" if stats == "honest" else "collusion"

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if self.z is None:
            try:
                alie_z(n, b)
            except ConfigError as e:
                return e
        return None

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        rows = known(honest) if self.stats == "honest" else byz
        need_rows(rows, self.ddof, "attack alie")
        xp = array_namespace(rows)
        z: float | np.ndarray = alie_z(ctx.n, byz.shape[0]) if self.z is None else self.z
        z = z + (ctx.rng.uniform(-self.jitter, self.jitter, size=(byz.shape[0], 1)) if self.jitter else 0.0)
        zs = like(np.broadcast_to(z, (byz.shape[0], 1)).copy(), rows)

        def shifted(c: slice) -> Array:  # the formula on one column block
            block = xp.astype(rows[:, c], xp.float64)
            return xp.mean(block, axis=0) + zs * xp.std(block, axis=0, correction=self.ddof)

        return by_columns(byz, shifted)
