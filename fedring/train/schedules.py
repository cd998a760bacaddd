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


def _number(key: str, value, *, low: float, low_open: bool = False, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"{'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and <= {high:g}")
        raise ConfigError(key, f"must be {bound}, got {value!r}")
    return float(value)


class Schedule:
    """``factor(t, rounds)``: the multiplier of ``lr`` in round ``t``; 1 for ``constant``."""

    name = "constant"
    params: tuple[str, ...] = ()

    def factor(self, t: int, rounds: int) -> float:
        return 1.0


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
            raise ConfigError("step.milestones", f"must be a list of fractions of the run in (0, 1), got {milestones!r}")
        self.milestones = sorted(_number("step.milestones", m, low=0.0, low_open=True, high=1.0) for m in milestones)
        self.gamma = _number("step.gamma", gamma, low=0.0, low_open=True)

    def factor(self, t: int, rounds: int) -> float:
        return self.gamma ** sum(t >= m * rounds for m in self.milestones)


class InvSqrt(Schedule):
    """``lr_t = lr / sqrt(1 + t / tau)``: halves by round ``3 tau``.

    >>> InvSqrt(tau=1).factor(3, 100)
    0.5
    """

    name = "invsqrt"
    params = ("tau",)

    def __init__(self, tau: float = 1.0):
        self.tau = _number("invsqrt.tau", tau, low=0.0, low_open=True)

    def factor(self, t: int, rounds: int) -> float:
        return 1.0 / math.sqrt(1.0 + t / self.tau)


class Cosine(Schedule):
    """``lr_t = lr * (final + (1 - final) (1 + cos(pi t / rounds)) / 2)``: from ``lr`` down to ``final * lr``.

    >>> Cosine().factor(0, 10), Cosine().factor(5, 10), Cosine(final=0.1).factor(10, 10)
    (1.0, 0.5, 0.1)
    """

    name = "cosine"
    params = ("final",)

    def __init__(self, final: float = 0.0):
        self.final = _number("cosine.final", final, low=0.0, high=1.0)

    def factor(self, t: int, rounds: int) -> float:
        return self.final + (1.0 - self.final) * (1.0 + math.cos(math.pi * t / rounds)) / 2.0


SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (Schedule, Step, InvSqrt, Cosine)}


def make_schedule(name: str, params: dict | None = None) -> Schedule:
    """Schedule ``name`` from its settings section; unknown names or keys raise ConfigError."""
    if name not in SCHEDULES:
        raise ConfigError("lr_schedule", f"{name!r} is not allowed; allowed: {', '.join(SCHEDULES)}")
    cls, params = SCHEDULES[name], dict(params or {})
    for key in params:
        if key not in cls.params:
            raise ConfigError(f"{name}.{key}", f"unknown setting of lr_schedule {name}; allowed: {', '.join(cls.params) or '(none)'}")
    return cls(**params)
