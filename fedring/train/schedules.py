"""Learning-rate schedules: the step size ``lr_t`` of round ``t`` (0-based) of a ``rounds``-round run.

``w <- w - lr_t * aggregate``. A schedule is chosen with the ``lr_schedule`` setting; its
parameters live in a settings section named after it (``[step]``, ``[invsqrt]``,
``[cosine]``), as a component's do. Every schedule is a pure function of ``t``, so a resumed
run applies exactly the rates of an uninterrupted one.

Why schedules matter for the sign rules: BRACE's printed consensus map (eq. 1) sends every
coordinate with ``S <= lambda`` to -1, so weakly agreed coordinates move by ``+lr`` every
round and the weights drift; a decaying ``lr`` bounds the drift (``docs/brace.md``).
"""

from __future__ import annotations

import math

from fedring.errors import ConfigError
from fedring.registry import Registry
from fedring.validate import real

#: the learning-rate schedules (setting ``lr_schedule``; parameters in the section named after it)
SCHEDULES = Registry("lr_schedule")


@SCHEDULES.register
@SCHEDULES.base
class Schedule:
    """``factor(t, rounds)``: the multiplier of ``lr`` in round ``t``; 1 for ``constant``."""

    name = "constant"
    params: tuple[str, ...] = ()

    def factor(self, t: int, rounds: int) -> float:
        return 1.0


@SCHEDULES.register
class Step(Schedule):
    """``lr_t = lr * gamma ** #{m in milestones : t >= m * rounds}`` (milestones are fractions of the run).

    >>> s = Step(milestones=[0.5, 0.75], gamma=0.1)
    >>> [s.factor(t, 8) for t in (0, 3, 4, 5, 6, 7)]
    [1.0, 1.0, 0.1, 0.1, 0.010000000000000002, 0.010000000000000002]
    """

    name = "step"
    params = ("milestones", "gamma")

    def __init__(self, milestones=(0.6,), gamma: float = 0.1):
        if isinstance(milestones, (int, float)) and not isinstance(milestones, bool):
            milestones = [milestones]
        if not isinstance(milestones, (list, tuple)) or not milestones:
            raise ConfigError(
                "step.milestones", f"must be a list of fractions of the run in (0, 1], got {milestones!r}"
            )
        self.milestones = sorted(real("step.milestones", m, lo=0, hi=1, lo_open=True) for m in milestones)
        self.gamma = real("step.gamma", gamma, lo=0, lo_open=True)

    def factor(self, t: int, rounds: int) -> float:
        return self.gamma ** sum(t >= m * rounds for m in self.milestones)


@SCHEDULES.register
class InvSqrt(Schedule):
    """``lr_t = lr / sqrt(1 + t / tau)``: halves by round ``3 tau``.

    >>> InvSqrt(tau=1).factor(3, 100)
    0.5
    """

    name = "invsqrt"
    params = ("tau",)

    def __init__(self, tau: float = 1.0):
        self.tau = real("invsqrt.tau", tau, lo=0, lo_open=True)

    def factor(self, t: int, rounds: int) -> float:
        return 1.0 / math.sqrt(1.0 + t / self.tau)


@SCHEDULES.register
class Cosine(Schedule):
    """``lr_t = lr * (final + (1 - final) (1 + cos(pi t / rounds)) / 2)``: from ``lr`` down to ``final * lr``.

    >>> Cosine().factor(0, 10), Cosine().factor(5, 10), Cosine(final=0.1).factor(10, 10)
    (1.0, 0.5, 0.1)
    """

    name = "cosine"
    params = ("final",)

    def __init__(self, final: float = 0.0):
        self.final = real("cosine.final", final, lo=0, hi=1)

    def factor(self, t: int, rounds: int) -> float:
        return self.final + (1.0 - self.final) * (1.0 + math.cos(math.pi * t / rounds)) / 2.0


def make_schedule(name: str, params: dict | None = None) -> Schedule:
    """Schedule ``name`` from its settings section; unknown names or keys raise ConfigError."""
    return SCHEDULES.build(name, params, key="lr_schedule")


class StepSizes:
    """The run's step sizes: ``lr_t = lr * factor(t)``, the schedule's factor of round ``t`` of ``rounds``.

    >>> StepSizes(0.1, Step(milestones=[0.5]), rounds=4)(3)
    0.010000000000000002
    """

    def __init__(self, lr: float, schedule: Schedule, rounds: int):
        self.lr, self.schedule, self.rounds = lr, schedule, rounds

    def factor(self, t: int) -> float:
        return self.schedule.factor(t, self.rounds)

    def __call__(self, t: int) -> float:
        return self.lr * self.factor(t)
