"""How the cohort's uploads become the update every replica applies: the two topologies.

- :class:`RingTopology`: a ring rule over the logical ring (:mod:`fedring.comm.ring`,
  :mod:`fedring.comm.brace`) of the round's cohort; every replica computes the update itself.
- :class:`ServerTopology`: rank 0 gathers the cohort's rows, applies a server rule
  (:mod:`fedring.aggregators`) and broadcasts the update.

Both have one :meth:`aggregate`, for any cohort (full participation is the cohort of every
client, :mod:`fedring.train.participation`), returning an
:class:`~fedring.comm.ring.Aggregation`, and apply their rule centrally in
:meth:`reference_rule` (what aggregator-aware attacks optimise against). Only the cohort's
members send, and the rule aggregates their rows (``docs/training.md``, client sampling).

On the device path the rows are a tensor on the rank's device (docs/arrays.md): a rule whose
``on_device`` is True takes them there (the ring mean, sign voting; the server rules that run on tensors),
any other gets a host copy of the rows it aggregates and its update goes back to the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedring.aggregators import Aggregator
from fedring.aggregators.probe import Probe
from fedring.arrays import array_namespace, full, host, like, on_host
from fedring.comm import Network
from fedring.comm.ring import Aggregation, RingRule
from fedring.rng import Stream, fixed_generator, generator

from .optim import Vector
from .participation import Cohort


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


def members(rows: Vector, cohort: Cohort, lo: int, hi: int) -> Vector:
    """The cohort's members' rows among this rank's ``rows`` (clients ``lo .. hi - 1``, either kind):
    ``rows`` itself when every local client is a member, else a contiguous copy of theirs: on a
    device, the runs of consecutive members joined in one copy (a mask or an index from host memory
    would be a copy that waits for the device's queued work)."""
    taking = cohort.member[lo:hi]
    if taking.all():
        return rows
    if on_host(rows):
        return np.ascontiguousarray(rows[taking])
    edges = np.diff(taking.astype(np.int8), prepend=0, append=0)
    runs = zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist())
    return array_namespace(rows).concat([rows[a:b] for a, b in runs] or [rows[:0]], axis=0)


def runs_on(rule, rows: Vector) -> bool:
    """Whether ``rule`` takes ``rows`` as they are: host rows, or device rows and an ``on_device`` rule."""
    return on_host(rows) or getattr(rule, "on_device", False)


class RingTopology:
    """A ring rule over the logical ring of the cohort's clients; no server, no state to checkpoint.

    ``rule_for(m)`` builds the rule for a ring of ``m`` clients (its settings read relative to the
    cohort, :meth:`fedring.comm.ring.RingRule.cohort_params`); ``rule`` is the one for every client.
    """

    needs_reference = needs_probe = False

    def __init__(
        self, net: Network, rule: RingRule, rule_for: Callable[[int], RingRule], byzantine: np.ndarray, d: int
    ):
        self.net, self.d, self.n, self.byzantine = net, d, net.layout.n_clients, byzantine
        self.rules = {self.n: rule}
        self.rule_for = rule_for
        self.state: dict[str, np.ndarray] = {}

    def rule(self, m: int) -> RingRule:
        """The rule for a ring of ``m`` of the clients, built once."""
        if m not in self.rules:
            self.rules[m] = self.rule_for(m)
        return self.rules[m]

    def reference_rule(
        self, X: Vector, reference: np.ndarray | None, cohort: Cohort, probe: Probe | None = None
    ) -> Vector:
        rule = self.rule(cohort.size)
        return rule.centralized(X) if runs_on(rule, X) else like(rule.centralized(host(X)), X)

    def aggregate(
        self, rows: Vector, t: int, reference: np.ndarray | None, cohort: Cohort, probe: Probe | None = None
    ) -> Aggregation:
        """Round ``t``'s rule over the logical ring of the cohort's ``m`` members, in client order: member
        ``j`` sends to member ``j + 1 (mod m)``, its Byzantine members are the relays, and the rule's
        per-client rows come back as rows over every client (zero for the others). A rank that hosts
        no member sends and relays nothing and receives the update from the rank of the first member
        (outside the protocol: it stands for the download of the model by a member that missed rounds
        when it joins, booked as ``catch_up`` from its ring predecessor). An empty cohort has no
        update. The update may be a view of ``rows`` (BRACE decodes into its first row). Device rows
        go to a rule that is not ``on_device`` (a plugin's, say) as one host copy of the rank's
        members' rows, and its update back to the device."""
        m, lay = cohort.size, self.net.layout
        if m == 0:
            return self.rule(self.n).idle(self.d)
        ring = self.net.over(cohort.clients)
        position = np.searchsorted(cohort.clients, cohort.stale)
        catch_up(self.net, cohort.clients[position - 1], self.d)
        update, figures, per_client = None, {}, {}
        if ring is None:  # filled from the rank of the first member
            update = full(self.d, 0, rows, np.float32)
        else:
            rule = self.rule(m)
            rule.set_byzantine(np.searchsorted(cohort.clients, self.byzantine[cohort.member[self.byzantine]]))
            mine = members(rows, cohort, lay.lo, lay.hi)
            if runs_on(rule, rows):
                result = rule.aggregate(ring, mine, t)
                update = result.update
            else:
                result = rule.aggregate(ring, np.ascontiguousarray(host(mine)), t)
                update = like(np.ascontiguousarray(result.update), rows)
            figures = result.figures
            for name, row in result.rows.items():
                per_client[name] = np.zeros(self.n, row.dtype)
                per_client[name][cohort.clients] = row
        hosts = np.unique(lay.owner(cohort.clients))
        if len(hosts) < lay.size:
            figures, per_client = self.to_bystanders(update, figures, per_client, hosts, m)
        return Aggregation(update, figures, per_client)

    def to_bystanders(self, update: Vector, figures: dict, rows: dict, hosts: np.ndarray, m: int) -> tuple:
        """From the rank of the first member, point to point (a simulation step, booked nowhere): the
        update into ``update`` on every rank that hosts no member (through host memory for a device
        update), and the rule's figures and rows to rank 0, which records them, when it hosts none.
        Those travel as one float64 buffer (counts are exact in it) laid out as the rule's
        :meth:`~fedring.comm.ring.RingRule.idle` report."""
        comm, lay, root = self.net.comm, self.net.layout, int(hosts[0])
        bystanders = np.setdiff1d(np.arange(lay.size), hosts)
        if lay.rank == root:
            staged = np.ascontiguousarray(host(update))
            self.net.complete([comm.Isend(staged, dest=int(r)) for r in bystanders])
        elif lay.rank in bystanders and on_host(update):
            comm.Recv(update, source=root)
        elif lay.rank in bystanders:
            received = np.empty(self.d, np.float32)
            comm.Recv(received, source=root)
            update[...] = like(received, update)
        if hosts[0] == 0 or lay.rank not in (0, root):
            return figures, rows
        template = self.rule(m).idle(self.d)
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

    def __init__(self, net: Network, rule: Aggregator, seed: int, d: int):
        self.net, self.rule, self.seed, self.d = net, rule, seed, d
        self.n = net.layout.n_clients
        self.needs_reference, self.needs_probe = rule.needs_reference, rule.needs_probe
        self.state: dict[str, np.ndarray] = rule.init_state(self.n, d) if net.layout.rank == 0 else {}

    def bound_rule(self, cohort: Cohort, probe: Probe | None) -> Aggregator:
        """The rule told the cohort's ``f``, bound to the round's ``probe`` when it inspects the model."""
        rule = self.rule.with_f(cohort.f)
        return rule.with_probe(probe) if rule.needs_probe and probe is not None else rule

    def reference_rule(
        self, X: Vector, reference: np.ndarray | None, cohort: Cohort, probe: Probe | None = None
    ) -> Vector:
        rule, rng = self.bound_rule(cohort, probe), fixed_generator(Stream.WHAT_IF)
        if runs_on(rule, X):
            return rule.aggregate(X, state=None, reference=reference, rng=rng).vector
        return like(rule.aggregate(host(X), state=None, reference=reference, rng=rng).vector, X)

    def aggregate(
        self, rows: Vector, t: int, reference: np.ndarray | None, cohort: Cohort, probe: Probe | None = None
    ) -> Aggregation:
        """Round ``t``: the cohort's members upload their rows; the rule, told the cohort's ``f`` (and
        given the round's ``probe`` of the model when it inspects it, on rank 0), aggregates them
        (per-client state of the others stays) and the update goes to the members. A
        cohort the rule cannot work with (``check``: empty, or too small for its ``f``) has no update
        and sends nothing. Device rows are stacked on rank 0's device and go to an ``on_device`` rule
        as they are (with the reference there), to another as one host copy; the update is
        broadcast through host memory and returned on the rows' device."""
        rule, m, lay = self.bound_rule(cohort, probe), cohort.size, self.net.layout
        if m == 0 or rule.check(m) is not None:  # every rank knows the cohort: all skip alike
            selected = np.zeros(self.n) if rule.selects and lay.rank == 0 else None
            return Aggregation(np.zeros(self.d, np.float32), selected=selected, updated=False)
        catch_up(self.net, None, self.d, len(cohort.stale))
        stacked = self.net.gather_to_server(members(rows, cohort, lay.lo, lay.hi), "uplink", cohort.clients)
        vec = selected = None
        if stacked is not None:
            rng = generator(self.seed, Stream.AGGREGATOR, step=t)
            if not runs_on(rule, stacked):
                stacked = host(stacked)
            elif reference is not None:
                reference = like(reference, stacked)
            result = self.rule.aggregate_part(rule, stacked, cohort.clients, self.state, reference, rng)
            vec = result.vector
            if result.selected is not None:
                selected = np.zeros(self.n)
                selected[cohort.clients] = host(result.selected)
        update = self.net.broadcast_from_server(vec, "downlink", (self.d,), np.float32, receivers=m, ref=rows)
        return Aggregation(update, selected=selected)
