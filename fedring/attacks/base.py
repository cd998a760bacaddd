"""The attack interface: the context an attack sees, the two attack kinds, parameter checks.

An attack is a small stateless callable, as in ByzFL. A *model* attack replaces the gradients
of the Byzantine clients after they computed them honestly on their own data; a *data* attack
changes the training batch of each Byzantine client before it computes its gradient.

What an attack may know is part of its definition (``knowledge``):

* ``"own"``: each attacker its own data and gradient only;
* ``"collusion"``: every Byzantine client's pre-attack gradient;
* ``"omniscient"``: the honest clients' gradients of the round too.

The caller passes honest gradients only to omniscient attacks, and :meth:`ModelAttack.__call__`
drops them otherwise, so an attack cannot use more than it declares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedring.registry import Registry

#: the attacks, by name (``--attack NAME``; parameters ``attack.*``)
ATTACKS = Registry("attack")


@dataclass
class AttackContext:
    """What the attackers know about the round besides the gradients.

    Attributes
    ----------
    rng : numpy.random.Generator
        Seeded per (run seed, round); every random draw of an attack comes from it.
    n : int
        Total number of clients.
    f : int
        Declared number of Byzantine clients (what the defence is told); the actual number is
        the number of rows of ``byz``.
    lr : float
        Learning rate of the run (the update is ``w <- w - lr * aggregate``).
    round : int
        Round index.
    aggregator : callable or None
        The defence's rule ``(n, d) -> (d,)``, for aggregator-aware attacks.
    aggregator_name : str
        Its name, for messages.
    """

    rng: np.random.Generator
    n: int
    f: int
    lr: float
    round: int
    aggregator: Callable[[np.ndarray], np.ndarray] | None
    aggregator_name: str = ""


@ATTACKS.base
class ModelAttack:
    """Base of the model-poisoning attacks.

    Subclasses implement :meth:`craft` on float64 arrays; :meth:`__call__` checks the inputs,
    hides the honest gradients from non-omniscient attacks and returns the rows in the dtype of
    ``byz``. ``knowledge`` is a class default that an instance may narrow or widen when a
    parameter changes what the attack uses (e.g. Fang's full vs partial knowledge).
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "model"
    knowledge: str = "own"

    def __call__(self, byz: np.ndarray, honest: np.ndarray | None, ctx: AttackContext) -> np.ndarray:
        """Malicious gradients.

        Parameters
        ----------
        byz : ndarray, shape (b, d)
            Gradients the Byzantine clients computed honestly on their own data.
        honest : ndarray, shape (h, d), or None
            Honest gradients of the round; used only when ``knowledge == "omniscient"``.
        ctx : AttackContext

        Returns
        -------
        ndarray, shape (b, d), dtype of ``byz``
        """
        byz = np.asarray(byz)
        if byz.ndim != 2 or byz.shape[0] < 1 or not np.issubdtype(byz.dtype, np.floating):
            raise ValueError(
                f"attack {self.name}: byz must be a float (b, d) array with b >= 1, got {byz.dtype} {byz.shape}"
            )
        if self.knowledge == "omniscient":
            if honest is None:
                raise ValueError(f"attack {self.name} is omniscient: it needs the honest gradients")
            honest = np.asarray(honest)
            if honest.ndim != 2 or honest.shape[1] != byz.shape[1] or honest.shape[0] < 1:
                raise ValueError(
                    f"attack {self.name}: honest must be (h, {byz.shape[1]}) with h >= 1, got {honest.shape}"
                )
            honest = honest.astype(np.float64, copy=False)
        else:
            honest = None
        self.check(ctx.n, byz.shape[0], ctx.f)
        out = self.craft(byz.astype(np.float64, copy=False), honest, ctx)
        return np.array(out, dtype=byz.dtype)  # a fresh writable (b, d) array, never a view

    def check(self, n: int, b: int, f: int | None = None) -> None:
        """Raise :class:`ConfigError` if the attack is undefined for n clients, b of them Byzantine,
        f declared to the defence (default b).

        Called by :meth:`__call__`; the caller may call it once before training starts so a bad
        setting fails before any work.
        """

    def craft(self, byz: np.ndarray, honest: np.ndarray | None, ctx: AttackContext) -> np.ndarray:
        raise NotImplementedError


@ATTACKS.base
class DataAttack:
    """Base of the data-poisoning attacks: they change the Byzantine clients' batches.

    ``scale`` multiplies the gradient the client then computes (1 unless the attack replaces
    the model, as the backdoor does).
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "data"
    knowledge: ClassVar[str] = "own"
    scale: float = 1.0

    def poison(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


def known(honest: np.ndarray | None) -> np.ndarray:
    """The honest gradients in :meth:`ModelAttack.craft` of an attack that is omniscient (as
    configured): :meth:`ModelAttack.__call__` has checked that they are there."""
    if honest is None:
        raise ValueError("an omniscient attack was called without the honest gradients")
    return honest


def std(rows: np.ndarray, ddof: int, who: str, block: int = 1 << 16) -> np.ndarray:
    """Coordinate-wise standard deviation; needs more rows than ``ddof``.

    Computed ``block`` columns at a time, so numpy's ``rows - mean`` temporary is (h, block),
    not another (h, d) array; each column is reduced over the rows in the same order as by
    ``rows.std(axis=0)``, so the values are the same bit for bit. A last block of one column
    joins the one before (numpy would sum a single column pairwise, in another order).
    """
    if rows.shape[0] <= ddof:
        raise ValueError(
            f"{who}: a standard deviation with ddof={ddof} needs at least {ddof + 1} rows, got {rows.shape[0]}"
        )
    d = rows.shape[1]
    starts = list(range(0, d, block))
    if len(starts) > 1 and d - starts[-1] == 1:
        starts.pop()
    return np.concatenate([rows[:, lo:hi].std(axis=0, ddof=ddof) for lo, hi in zip(starts, [*starts[1:], d])])
