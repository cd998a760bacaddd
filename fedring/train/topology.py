"""How the clients' gradients become the update every replica applies: the two topologies.

- :class:`RingTopology`: a ring rule over the logical ring (:mod:`fedring.comm.ring`,
  :mod:`fedring.comm.brace`); every replica computes the update itself.
- :class:`ServerTopology`: rank 0 gathers every client's row, applies a server rule
  (:mod:`fedring.aggregators`) and broadcasts the update.

Both return an :class:`Aggregation` from :meth:`aggregate` and apply their rule centrally in
:meth:`reference_rule` (what aggregator-aware attacks optimise against). With client sampling
(:mod:`fedring.train.participation`) ``aggregate`` is given the round's cohort: only its members
send, and the rule aggregates their rows (``docs/training.md``, client sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, make_aggregator
from fedring.comm import Network
from fedring.comm.ring import RING_RULES, RingRule
from fedring.config import Config, defence_f
from fedring.errors import ConfigError
from fedring.rng import Stream, fixed_generator, generator

from .participation import Cohort, cohort_f, cohort_size


@dataclass(frozen=True)
class Aggregation:
    """One round's aggregate: the ``(d,)`` ``update``; the server rule's weight per client
    (``selected``, rank 0; None for rules that report none and on the ring); the ring rule's
    scalar ``figures`` and per-client ``rows`` (empty on the server)."""

    update: np.ndarray
    selected: np.ndarray | None = None
    figures: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    #: False when the round has no update (an empty cohort, or one too small for the rule): the model stays
    updated: bool = True


def catch_up(net: Network, senders: np.ndarray | None, d: int, stale: int = 0) -> None:
    """Book the model's download (``d`` float32, phase ``catch_up``) by each of a cohort's members that
    do not hold it: sent by each client of ``senders`` (one entry per download), or by the server
    (``senders`` None: ``stale`` downloads)."""
    lay = net.layout
    if senders is None:
        if lay.rank == 0 and stale:
            net.ledger.add_server("catch_up", 4 * d * stale)
        return
    for client in senders:
        if lay.lo <= client < lay.hi:
            net.ledger.add(int(client), "catch_up", 4 * d)


class RingTopology:
    """A ring rule over the logical ring of clients; no server, no state to checkpoint."""

    needs_reference = False

    def __init__(self, cfg: Config, net: Network, byzantine: np.ndarray, d: int):
        self.net, self.d, self.n, self.byzantine = net, d, cfg.n_clients, byzantine
        self.section, self.name, self.seed = cfg.section(cfg.aggregator), cfg.aggregator, cfg.seed
        self.rule = RING_RULES.build(self.name, self.section, key="aggregator", n_clients=self.n, seed=self.seed)
        self.rule.set_byzantine(byzantine)
        self.cohort_rules: dict[int, RingRule] = {}
        self.state: dict[str, np.ndarray] = {}

    def rule_for(self, m: int) -> RingRule:
        """The rule for a ring of ``m`` of the clients: built for ``m``, its settings read relative
        to the cohort (:meth:`fedring.comm.ring.RingRule.cohort_params`)."""
        if m == self.n:
            return self.rule
        if m not in self.cohort_rules:
            params = type(self.rule).cohort_params(self.section, m, self.n)
            self.cohort_rules[m] = RING_RULES.build(self.name, params, key="aggregator", n_clients=m, seed=self.seed)
        return self.cohort_rules[m]

    def reference_rule(
        self, X: np.ndarray, reference: np.ndarray | None = None, cohort: Cohort | None = None
    ) -> np.ndarray:
        return (self.rule if cohort is None else self.rule_for(cohort.size)).centralized(X)

    def aggregate(
        self, grads: np.ndarray, t: int, reference: np.ndarray | None, cohort: Cohort | None = None
    ) -> Aggregation:
        """The round's update; with a ``cohort``, over the ring of its members (:meth:`over_cohort`)."""
        if cohort is not None:
            return self.over_cohort(grads, t, cohort)
        self.rule.round = t  # relay attacks draw per round: keeps --resume exact
        result = self.rule.aggregate(self.net, grads)
        return Aggregation(result.update, None, result.figures, result.rows)

    def over_cohort(self, grads: np.ndarray, t: int, cohort: Cohort) -> Aggregation:
        """The rule over the round's logical ring of the cohort's ``m`` members, in client order: member
        ``j`` sends to member ``j + 1 (mod m)``, its Byzantine members are the relays, and the rule's
        per-client rows come back as rows over every client (zero for the others). A rank that hosts
        no member sends and relays nothing and receives the update from the rank of the first member
        (outside the protocol: it stands for the download of the model by a member that missed rounds
        when it joins, booked as ``catch_up`` from its ring predecessor). An empty cohort has no update."""
        m, lay = cohort.size, self.net.layout
        update = np.zeros(self.d, np.float32)
        if m == 0:
            idle = self.rule.idle(self.d)
            return Aggregation(idle.update, None, idle.figures, idle.rows, updated=False)
        ring = self.net.over(cohort.clients)
        position = np.searchsorted(cohort.clients, cohort.stale)
        catch_up(self.net, cohort.clients[position - 1], self.d)
        figures: dict = {}
        rows: dict = {}
        if ring is not None:
            rule = self.rule_for(m)
            rule.round = t
            rule.set_byzantine(np.searchsorted(cohort.clients, self.byzantine[cohort.member[self.byzantine]]))
            result = rule.aggregate(ring, np.ascontiguousarray(grads[cohort.member[lay.lo : lay.hi]]))
            update[:] = result.update
            figures = result.figures
            for name, row in result.rows.items():
                rows[name] = np.zeros(self.n, row.dtype)
                rows[name][cohort.clients] = row
        hosts = np.unique(lay.owner(cohort.clients))
        if len(hosts) < lay.size:
            figures, rows = self.to_bystanders(update, figures, rows, hosts, m)
        return Aggregation(update, None, figures, rows)

    def to_bystanders(self, update: np.ndarray, figures: dict, rows: dict, hosts: np.ndarray, m: int) -> tuple:
        """From the rank of the first member, point to point (a simulation step, booked nowhere): the
        update into ``update`` on every rank that hosts no member, and the rule's figures and rows to
        rank 0, which records them, when it hosts none. Those travel as one float64 buffer (counts
        are exact in it) laid out as the rule's :meth:`~fedring.comm.ring.RingRule.idle` report."""
        comm, lay, root = self.net.comm, self.net.layout, int(hosts[0])
        bystanders = np.setdiff1d(np.arange(lay.size), hosts)
        if lay.rank == root:
            self.net.complete([comm.Isend(update, dest=int(r)) for r in bystanders])
        elif lay.rank in bystanders:
            comm.Recv(update, source=root)
        if hosts[0] == 0 or lay.rank not in (0, root):
            return figures, rows
        template = self.rule_for(m).idle(self.d)
        names, row_names = sorted(template.figures), sorted(template.rows)
        packed = np.empty(len(names) + self.n * len(row_names), np.float64)
        if lay.rank == root:
            packed[: len(names)] = [figures[k] for k in names]
            packed[len(names) :] = np.concatenate([rows[k] for k in row_names] or [np.empty(0)])
            comm.Send(packed, dest=0)
            return figures, rows
        comm.Recv(packed, source=root)
        figures = {k: type(template.figures[k])(v) for k, v in zip(names, packed)}
        blocks = packed[len(names) :].reshape(len(row_names), self.n)
        rows = {k: block.astype(template.rows[k].dtype) for k, block in zip(row_names, blocks)}
        return figures, rows


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
        m = cohort_size(cfg.participation, cfg.n_clients)
        reason = self.rule.with_f(cohort_f(cfg.cohort_f, defence_f(cfg), m, cfg.n_clients)).check(m)
        if reason is not None:
            raise ConfigError("participation", f"a cohort of {m} per round: {reason}")
        self.state: dict[str, np.ndarray] = self.rule.init_state(cfg.n_clients, d) if net.layout.rank == 0 else {}

    @property
    def needs_reference(self) -> bool:
        return self.rule.needs_reference

    def reference_rule(
        self, X: np.ndarray, reference: np.ndarray | None = None, cohort: Cohort | None = None
    ) -> np.ndarray:
        rule = self.rule if cohort is None else self.rule.with_f(cohort.f)
        return rule.aggregate(X, state=None, reference=reference, rng=fixed_generator(Stream.WHAT_IF)).vector

    def aggregate(
        self, grads: np.ndarray, t: int, reference: np.ndarray | None, cohort: Cohort | None = None
    ) -> Aggregation:
        """The round's update; with a ``cohort``, of its members' rows (:meth:`over_cohort`)."""
        if cohort is not None:
            return self.over_cohort(grads, t, reference, cohort)
        stacked = self.net.gather_to_server(grads, "uplink")
        vec = selected = None
        if stacked is not None:
            rng = generator(self.cfg.seed, Stream.AGGREGATOR, step=t)
            result = self.rule.aggregate(stacked, state=self.state, reference=reference, rng=rng)
            vec, selected = result.vector, result.selected
        return Aggregation(self.net.broadcast_from_server(vec, "downlink", (self.d,), np.float32), selected)

    def over_cohort(self, grads: np.ndarray, t: int, reference: np.ndarray | None, cohort: Cohort) -> Aggregation:
        """The cohort's members upload their rows; the rule, told the cohort's ``f``, aggregates them
        (per-client state of the others stays) and the update goes to the members. A cohort the rule
        cannot work with (``check``: empty, or too small for its ``f``) has no update and sends nothing."""
        rule, m = self.rule.with_f(cohort.f), cohort.size
        if m == 0 or rule.check(m) is not None:  # every rank knows the cohort: all skip alike
            selected = np.zeros(self.cfg.n_clients) if rule.selects and self.net.layout.rank == 0 else None
            return Aggregation(np.zeros(self.d, np.float32), selected, updated=False)
        catch_up(self.net, None, self.d, len(cohort.stale))
        lay = self.net.layout
        stacked = self.net.gather_to_server(grads[cohort.member[lay.lo : lay.hi]], "uplink", cohort.clients)
        vec = selected = None
        if stacked is not None:
            rng = generator(self.cfg.seed, Stream.AGGREGATOR, step=t)
            result = self.rule.aggregate_part(rule, stacked, cohort.clients, self.state, reference, rng)
            vec = result.vector
            if result.selected is not None:
                selected = np.zeros(self.cfg.n_clients)
                selected[cohort.clients] = result.selected
        update = self.net.broadcast_from_server(vec, "downlink", (self.d,), np.float32, receivers=m)
        return Aggregation(update, selected)


def make_topology(cfg: Config, net: Network, byzantine: np.ndarray, d: int) -> RingTopology | ServerTopology:
    """The run's topology (``cfg.topology``)."""
    return (RingTopology if cfg.topology == "ring" else ServerTopology)(cfg, net, byzantine, d)
