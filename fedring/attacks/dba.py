"""Distributed backdoor attack, DBA (Xie, Huang, Chen, Li, ICLR 2020): the global trigger cut into
local patterns, one per attacker; the success rate is measured with the whole trigger."""

from __future__ import annotations

import copy

import numpy as np

from fedring.validate import integer

from .backdoor import Backdoor
from .base import ATTACKS


def pattern_corner(i: int, size: int, gap: int, shift: int) -> tuple[int, int]:
    """Top-left pixel ``(row, column)`` of local pattern ``i``: patterns sit two to a row of bars,
    ``row = (i // 2)(1 + gap) + shift``, ``column = (i mod 2)(size + gap) + shift``
    (FLPoison's ``DBA.setup_trigger_position``).

    >>> [pattern_corner(i, 4, 2, 0) for i in range(4)]
    [(0, 0), (0, 6), (3, 0), (3, 6)]
    """
    return (i // 2) * (1 + gap) + shift, (i % 2) * (size + gap) + shift


@ATTACKS.register
class DBA(Backdoor):
    r"""Distributed backdoor: each attacker trains with one local part of the trigger, the model is
    tested with all of them.

    The global trigger is ``parts`` bars of 1 x ``size`` pixels set to ``value`` in every
    channel, in rows of two from the top-left corner: bar ``i`` starts at pixel

    .. math::  (r_i, c_i) = (\lfloor i/2 \rfloor (1 + \mathrm{gap}) + \mathrm{shift},\;
               (i \bmod 2)(\mathrm{size} + \mathrm{gap}) + \mathrm{shift})

    (:func:`pattern_corner`). The ``k``-th Byzantine client (in the order of client ids, from 0)
    stamps only bar ``k mod parts`` on ``round(fraction * N)`` samples of each batch, drawn from
    the round's generator, and relabels them ``target``; its gradient is multiplied by
    ``scale``, as the backdoor's (:class:`fedring.attacks.Backdoor`). The success rate
    (``attack_success_rate``) is measured with the global trigger, every bar at once
    (:meth:`stamp`), on the test samples whose label is not ``target``.

    Parameters
    ----------
    target : int >= 0, default 0
    fraction : float in (0, 1], default 0.5
    scale : float > 0 or None, default None (= number of clients)
    value : float, default 1.0
    parts : int >= 1, default 4
        Local patterns (attackers beyond ``parts`` reuse them in turn).
    size : int >= 1, default 4
        Width of a bar in pixels (the paper's MNIST trigger: 4, gap 2, shift 0; CIFAR-10: 6, 3, 0).
    gap : int >= 0, default 2
    shift : int >= 0, default 0

    References
    ----------
    C. Xie, K. Huang, P.-Y. Chen, B. Li, "DBA: Distributed Backdoor Attacks against Federated
    Learning", ICLR 2020; geometry of FLPoison's ``attackers/dba.py``.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks.dba import DBA
    >>> dba = DBA(size=2, gap=1, scale=1)
    >>> dba.stamp(np.zeros((1, 1, 5, 6)))[0, 0]          # the global trigger
    array([[1., 1., 0., 1., 1., 0.],
           [0., 0., 0., 0., 0., 0.],
           [1., 1., 0., 1., 1., 0.],
           [0., 0., 0., 0., 0., 0.],
           [0., 0., 0., 0., 0., 0.]])
    >>> dba.attacker(5).stamp(np.zeros((1, 1, 5, 6)))[0, 0]  # the 6th attacker: bar 5 mod 4 = 1
    array([[0., 0., 0., 1., 1., 0.],
           [0., 0., 0., 0., 0., 0.],
           [0., 0., 0., 0., 0., 0.],
           [0., 0., 0., 0., 0., 0.],
           [0., 0., 0., 0., 0., 0.]])
    """

    name = "dba"

    def __init__(
        self,
        target: int = 0,
        fraction: float = 0.5,
        scale: float | None = None,
        value: float = 1.0,
        parts: int = 4,
        size: int = 4,
        gap: int = 2,
        shift: int = 0,
        *,
        n_clients: int | None = None,
    ):
        super().__init__(target, fraction, scale, value, n_clients=n_clients)
        self.parts = integer("attack.parts", parts, lo=1)
        self.size = integer("attack.size", size, lo=1)
        self.gap = integer("attack.gap", gap, lo=0)
        self.shift = integer("attack.shift", shift, lo=0)
        self.bars: tuple[int, ...] = tuple(range(self.parts))  # what stamp() sets: every bar here

    def attacker(self, index: int) -> DBA:
        """The attack as the ``index``-th Byzantine client runs it: its :meth:`stamp` sets bar ``index mod parts`` only."""
        local = copy.copy(self)
        local.bars = (int(index) % self.parts,)
        return local

    def stamp(self, x: np.ndarray) -> np.ndarray:
        """A copy of the images ``x`` ``(N, ..., H, W)`` with the global trigger (an attacker's copy:
        its local bar)."""
        out = np.array(x, copy=True)
        rows = max(pattern_corner(i, self.size, self.gap, self.shift)[0] for i in range(self.parts)) + 1
        cols = max(pattern_corner(i, self.size, self.gap, self.shift)[1] for i in range(self.parts)) + self.size
        if out.ndim < 3 or out.shape[-2] < rows or out.shape[-1] < cols:
            raise ValueError(
                f"attack dba: its trigger needs images of at least {rows} x {cols} pixels, got samples of "
                f"shape {out.shape[1:]} (set attack.size, attack.gap, attack.shift, attack.parts)"
            )
        for i in self.bars:
            r, c = pattern_corner(i, self.size, self.gap, self.shift)
            out[..., r, c : c + self.size] = self.value
        return out
