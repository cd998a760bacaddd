"""How the clients' gradients become the update every replica applies: the two topologies.

- :class:`RingTopology`: a ring rule over the logical ring (:mod:`fedring.comm.ring`,
  :mod:`fedring.comm.brace`); every replica computes the update itself.
- :class:`ServerTopology`: rank 0 gathers every client's row, applies a server rule
  (:mod:`fedring.aggregators`) and broadcasts the update.

Both return an :class:`Aggregation` from :meth:`aggregate` and apply their rule centrally in
:meth:`reference_rule` (what aggregator-aware attacks optimise against).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, make_aggregator
from fedring.comm import Network
from fedring.comm.ring import RING_RULES
from fedring.config import Config, defence_f
from fedring.errors import ConfigError
from fedring.rng import Stream, fixed_generator, generator


@dataclass(frozen=True)
class Aggregation:
    """One round's aggregate: the ``(d,)`` ``update``; the server rule's weight per client
    (``selected``, rank 0; None for rules that report none and on the ring); the ring rule's
    scalar ``figures`` and per-client ``rows`` (empty on the server)."""

    update: np.ndarray
    selected: np.ndarray | None = None
    figures: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)


class RingTopology:
    """A ring rule over the logical ring of clients; no server, no state to checkpoint."""

    needs_reference = False

    def __init__(self, cfg: Config, net: Network, byzantine: np.ndarray, d: int):
        self.net = net
        self.rule = RING_RULES.build(
            cfg.aggregator, cfg.section(cfg.aggregator), key="aggregator", n_clients=cfg.n_clients, seed=cfg.seed
        )
        self.rule.set_byzantine(byzantine)
        self.state: dict[str, np.ndarray] = {}

    def reference_rule(self, X: np.ndarray, reference: np.ndarray | None = None) -> np.ndarray:
        return self.rule.centralized(X)

    def aggregate(self, grads: np.ndarray, t: int, reference: np.ndarray | None) -> Aggregation:
        self.rule.round = t  # relay attacks draw per round: keeps --resume exact
        result = self.rule.aggregate(self.net, grads)
        return Aggregation(result.update, None, result.figures, result.rows)


class ServerTopology:
    """A server rule on rank 0 (with its pre-aggregators); its state is checkpointed."""

    def __init__(self, cfg: Config, net: Network, byzantine: np.ndarray, d: int):
        self.cfg, self.net, self.d = cfg, net, d
        # the rule's section, and the sections of the components it may use (pre-aggregators, H+'s base)
        params = {
            **cfg.section(cfg.aggregator),
            **{k: v for k, v in cfg.sections.items() if k in PRE_AGGREGATORS or k in AGGREGATORS},
        }
        params.pop(cfg.aggregator, None)
        self.rule = make_aggregator(cfg.aggregator, defence_f(cfg), params, pre=cfg.pre_aggregators)
        reason = self.rule.check(cfg.n_clients)
        if reason is not None:
            raise ConfigError("aggregator", reason)
        self.state: dict[str, np.ndarray] = self.rule.init_state(cfg.n_clients, d) if net.layout.rank == 0 else {}

    @property
    def needs_reference(self) -> bool:
        return self.rule.needs_reference

    def reference_rule(self, X: np.ndarray, reference: np.ndarray | None = None) -> np.ndarray:
        return self.rule.aggregate(X, state=None, reference=reference, rng=fixed_generator(Stream.WHAT_IF)).vector

    def aggregate(self, grads: np.ndarray, t: int, reference: np.ndarray | None) -> Aggregation:
        stacked = self.net.gather_to_server(grads, "uplink")
        vec = selected = None
        if stacked is not None:
            rng = generator(self.cfg.seed, Stream.AGGREGATOR, step=t)
            result = self.rule.aggregate(stacked, state=self.state, reference=reference, rng=rng)
            vec, selected = result.vector, result.selected
        return Aggregation(self.net.broadcast_from_server(vec, "downlink", (self.d,), np.float32), selected)


def make_topology(cfg: Config, net: Network, byzantine: np.ndarray, d: int) -> RingTopology | ServerTopology:
    """The run's topology (``cfg.topology``)."""
    return (RingTopology if cfg.topology == "ring" else ServerTopology)(cfg, net, byzantine, d)
