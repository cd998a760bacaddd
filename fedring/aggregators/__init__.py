"""Server-side robust aggregation rules, one module per rule family (discovered on import).

Every rule is an ``Aggregator``: parameters validated at construction, ``check(n)`` explains
in words why n clients cannot work with the declared f, ``aggregate(X, state, reference, rng)``
maps the (n, d) matrix of client gradients (float32 or float64) to an ``AggregateResult``
whose ``vector`` the loop applies as ``w <- w - lr * vector``. Rules register with
``@register`` (pre-aggregators ``@register_pre``); a new rule is one new module here.

``make_aggregator(name, f, params, pre, sections)``: ``params`` is the rule's settings section,
``sections`` the other components' by name: a pre-aggregator's (``{"bucketing": {"s": 2}}``
with ``pre=["bucketing"]``) or H+'s base rule's (``params={"base": "krum"}``,
``sections={"krum": {"variant": "byzfl"}}``).
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from ._kernels import nonfinite_flags, nonfinite_rows
from .base import (
    AGGREGATORS,
    PRE_AGGREGATORS,
    AggregateResult,
    Aggregator,
    PreAggregator,
)

# every module registers its rules; the tensor kernels import torch, so they wait for the first tensor
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "_kernels_torch":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "AGGREGATORS",
    "PRE_AGGREGATORS",
    "AggregateResult",
    "Aggregator",
    "Pipeline",
    "PreAggregator",
    "make_aggregator",
    "nonfinite_flags",
    "nonfinite_rows",
]


class Pipeline(Aggregator):
    """Pre-aggregators applied in order, then a rule; ``selected`` is mapped back to the clients."""

    def __init__(self, pre: list[PreAggregator], rule: Aggregator):
        self.pre, self.rule = list(pre), rule
        self.f = rule.f
        self.name = "+".join([p.name for p in self.pre] + [rule.name])
        self.needs_reference = rule.needs_reference
        self.needs_probe, self.probe = rule.needs_probe, rule.probe
        self.selects = rule.selects
        self.client_state = rule.client_state
        self.on_device = rule.on_device and all(p.on_device for p in self.pre)
        self._rng = np.random.default_rng(0)

    def with_f(self, f):
        if f == self.f:
            return self
        return Pipeline([p.with_f(f) for p in self.pre], self.rule.with_f(f))

    def with_probe(self, probe):
        return Pipeline(self.pre, self.rule.with_probe(probe))

    def _rows_after(self, n: int) -> int:
        for p in self.pre:
            n = p.out_rows(n)
        return n

    def check(self, n):
        mixing = [p.name for p in self.pre if not p.keeps_rows]
        if self.rule.client_state and mixing:
            return (
                f"{self.rule.name} keeps state per client, and {mixing[0]} mixes the clients' rows: "
                f"leave {mixing[0]} out or choose another rule"
            )
        for p in self.pre:
            reason = p.check(n)
            if reason is not None:
                return reason
            n = p.out_rows(n)
        return self.rule.check(n)

    def init_state(self, n, d):
        return self.rule.init_state(self._rows_after(n), d)

    def reads(self):
        return (*(p.name for p in self.pre), *self.rule.reads())

    def _aggregate_checked(self, X, state, reference, rng):
        if len(self.pre) == 1:  # a stage that feeds this rule without its rows (ARC then the mean)
            fused = self.pre[0].then_checked(self.rule, X, state, reference, rng)
            if fused is not None:
                return fused
        return super()._aggregate_checked(X, state, reference, rng)

    def _aggregate(self, X, state, reference, rng):
        owners = np.arange(X.shape[0])
        for p in self.pre:
            X, owner = p.transform(X, rng)
            owners = owner[owners]
        res = self.rule.aggregate(X, state=state, reference=reference, rng=rng)
        return AggregateResult(res.vector, None if res.selected is None else res.selected[owners])

    def __repr__(self):
        return f"Pipeline({self.pre!r}, {self.rule!r})"


def make_aggregator(
    name: str, f: int = 0, params: dict | None = None, pre=(), sections: dict[str, dict] | None = None
) -> Aggregator:
    """Build rule ``name`` for ``f`` declared Byzantine clients from its settings ``params``.

    Pre-aggregators in ``pre`` run in order in front of the rule. The other components' settings
    are in ``sections``, by component name (a run's settings sections): a pre-aggregator's
    (``sections={"bucketing": {"s": 2}}``) or H+'s base rule's (``{"krum": {"variant": "byzfl"}}``).
    Unknown names or parameters raise ``ConfigError`` naming the setting and listing what is allowed.
    """
    AGGREGATORS.get(name, "aggregator")
    for p in pre:
        PRE_AGGREGATORS.get(p, "pre_aggregators")
    sections = sections or {}
    stages = [PRE_AGGREGATORS.build(p, sections.get(p), key="pre_aggregators", f=f) for p in pre]
    rule = AGGREGATORS.build(name, params, f=f, sections=sections)
    return Pipeline(stages, rule) if stages else rule
