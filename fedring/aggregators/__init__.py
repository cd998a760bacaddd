"""Server-side robust aggregation rules (issue 4).

Every rule is an ``Aggregator``: parameters validated at construction, ``check(n)`` explains
in words why n clients cannot work with the declared f, ``aggregate(X, state, reference, rng)``
maps the (n, d) matrix of client gradients (float32 or float64) to an ``AggregateResult``
whose ``vector`` the loop applies as ``w <- w - lr * vector``.

Configuration scheme of ``make_aggregator``: ``params`` is the rule's own config section.
Parameters of a component are nested under the component's name in that same dict:
``make_aggregator("krum", 2, {"variant": "byzfl", "nnm": {}, "bucketing": {"s": 2}}, pre=["nnm", "bucketing"])``
or ``make_aggregator("hplus", 10, {"base": "krum", "krum": {"variant": "byzfl"}})``.
"""

from __future__ import annotations

import numpy as np

from fedring.errors import ConfigError

from . import (  # noqa: F401  (importing registers the rules)
    bulyan,
    cclip,
    coordinatewise,
    copod,
    fedseca,
    fldetector,
    fltrust,
    hplus,
    huber,
    krum,
    mca,
    preaggregators,
    rfa,
    signsgd,
    ties,
    zenopp,
)
from ._kernels import nonfinite_rows
from .base import AGGREGATORS, PRE_AGGREGATORS, AggregateResult, Aggregator, PreAggregator

__all__ = ["AGGREGATORS", "PRE_AGGREGATORS", "AggregateResult", "Aggregator", "Pipeline", "PreAggregator",
           "make_aggregator", "nonfinite_rows"]


class Pipeline(Aggregator):
    """Pre-aggregators applied in order, then a rule; ``selected`` is mapped back to the clients."""

    def __init__(self, pre: list[PreAggregator], rule: Aggregator):
        self.pre, self.rule = list(pre), rule
        self.f = rule.f
        self.name = "+".join([p.name for p in self.pre] + [rule.name])
        self.needs_reference = rule.needs_reference
        self.needs_rng = rule.needs_rng or any(p.needs_rng for p in self.pre)
        self.stateful = rule.stateful
        self.selects = rule.selects
        self.client_state = rule.client_state
        self._rng = np.random.default_rng(0)

    def with_f(self, f):
        if f == self.f:
            return self
        return Pipeline([p.with_f(f) for p in self.pre], self.rule.with_f(f))

    def _rows_after(self, n: int) -> int:
        for p in self.pre:
            n = p.out_rows(n)
        return n

    def check(self, n):
        mixing = [p.name for p in self.pre if not p.keeps_rows]
        if self.rule.client_state and mixing:
            return (f"{self.rule.name} keeps state per client, and {mixing[0]} mixes the clients' rows: "
                    f"leave {mixing[0]} out or choose another rule")
        for p in self.pre:
            reason = p.check(n)
            if reason is not None:
                return reason
            n = p.out_rows(n)
        return self.rule.check(n)

    def init_state(self, n, d):
        return self.rule.init_state(self._rows_after(n), d)

    def _aggregate(self, X, state, reference, rng):
        owners = np.arange(X.shape[0])
        for p in self.pre:
            X, owner = p.transform(X, rng)
            owners = owner[owners]
        res = self.rule.aggregate(X, state=state, reference=reference, rng=rng)
        return AggregateResult(res.vector, None if res.selected is None else res.selected[owners])

    def __repr__(self):
        return f"Pipeline({self.pre!r}, {self.rule!r})"


def make_aggregator(name: str, f: int = 0, params: dict | None = None, pre=()) -> Aggregator:
    """Build rule ``name`` for ``f`` declared Byzantine clients from its config section ``params``.

    Pre-aggregators in ``pre`` run in order in front of the rule; their parameters are the
    sub-dict ``params[<pre name>]``. Unknown names or parameters raise ``ConfigError`` naming
    the setting and listing what is allowed.
    """
    if name not in AGGREGATORS:
        raise ConfigError("aggregator", f"unknown rule {name!r}; allowed: {', '.join(sorted(AGGREGATORS))}")
    params = dict(params or {})
    pre = list(pre or ())
    stages = []
    for p in pre:
        if p not in PRE_AGGREGATORS:
            raise ConfigError("pre", f"unknown pre-aggregator {p!r}; allowed: {', '.join(sorted(PRE_AGGREGATORS))}")
        sub = params.pop(p, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{name}.{p}", f"parameters of pre-aggregator {p} must be a table, got {sub!r}")
        stages.append(PRE_AGGREGATORS[p].from_params(f, sub))
    rule = AGGREGATORS[name].from_params(f, params)
    return Pipeline(stages, rule) if stages else rule
