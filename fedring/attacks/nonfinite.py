"""Non-finite uploads: a one-line attack that any robust rule must survive."""

from __future__ import annotations

import math

import numpy as np

from fedring.arrays import Array, array_namespace, like
from fedring.validate import choice, real

from .base import ATTACKS, AttackContext, ModelAttack

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@ATTACKS.register
class NonFinite(ModelAttack):
    r"""Every Byzantine client sends NaN or infinities on a fraction of the coordinates.

    Each attacker keeps its honest gradient except on :math:`\lceil \text{fraction}\cdot d\rceil`
    coordinates drawn uniformly (without replacement, fresh per client and round), where it
    sends ``value``: NaN, +inf, -inf, or (``mixed``) each of the three with probability 1/3.

    What fedring does with such a row: a server rule leaves it out before aggregating (the
    client counts as absent that round; ``/aggregation/nonfinite``); the ring's sign rules
    count a non-finite coordinate as a ``sign_zero`` vote; ring-all-reduce sums it, so the
    model is lost, as it would be in any plain all-reduce.

    Parameters
    ----------
    value : {"nan", "inf", "-inf", "mixed"}, default "nan"
    fraction : float in (0, 1], default 1
        Share of the coordinates poisoned.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import AttackContext, NonFinite
    >>> ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=None)
    >>> NonFinite(value="-inf", fraction=0.5)(np.ones((1, 4)), None, ctx)
    array([[  1.,   1., -inf, -inf]])
    >>> ctx.rng = np.random.default_rng(0)
    >>> NonFinite(value="mixed")(np.ones((1, 4)), None, ctx)
    array([[-inf,  inf,  inf,  nan]])
    """

    name = "nonfinite"
    knowledge = "own"
    on_device = True

    def __init__(self, value: str = "nan", fraction: float = 1.0):
        self.value = choice("attack.value", value, (*VALUES, "mixed"))
        self.fraction = real("attack.fraction", fraction, lo=0.0, lo_open=True, hi=1.0)

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        out = array_namespace(byz).asarray(byz, copy=True)
        d = out.shape[1]
        k = math.ceil(self.fraction * d)
        for row in out:
            where = slice(None) if k == d else like(ctx.rng.choice(d, k, replace=False), row)
            if self.value == "mixed":
                row[where] = like(ctx.rng.choice(list(VALUES.values()), size=k), row)
            else:
                row[where] = VALUES[self.value]
        return out
