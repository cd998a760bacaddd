"""A rank's clients computing their uploads: the local steps, written once for every source of
gradients (:mod:`fedring.train.gradients`: one client at a time, or B at a time with ``vmap``).

Client ``i``'s upload of round ``t``: with one local step, its stochastic gradient (FedSGD, the
BRACE paper's setting); with more (``local_steps`` > 1, or ``local_epochs``), ``(w - w_local) / lr``
after that many SGD steps. Each mini-batch gradient is clipped and decayed, and the client's
momentum turns the result into the vector it uploads (:class:`fedring.train.optim.ClientOptimizer`).
A Byzantine client under a data attack trains on poisoned batches, or lets the attack run its
local steps (:attr:`fedring.attacks.DataAttack.owns_steps`, AlterMin), and scales its upload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain, count
from typing import Any

import numpy as np
import torch

from fedring.arrays import host, like
from fedring.attacks import DataAttack
from fedring.attacks.base import LocalRun
from fedring.comm import Layout
from fedring.config import Config
from fedring.rng import Stream, client_generators, generator

from .batched import VmapGradients
from .data import Shard
from .device import Staging
from .gradients import Batches, Group, ModelGradients
from .optim import ClientOptimizer, ClientState, Vector, f32

#: the key of a data attack's memory rows in :attr:`Clients.state` (checkpoint array ``client_attack``)
ATTACK_MEMORY = "attack"


class Clients:
    """This rank's clients: their shards, optimizer rows (``state``) and the ``(clients, d)`` float32
    buffer of their uploads (``rows``, rewritten every round): a numpy array on the host path, a tensor
    on the device on the device path (:class:`fedring.train.device.Staging`), where each client's
    update writes its row in place."""

    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        shards: list[Shard],
        stage: Staging,
        source: ModelGradients | VmapGradients,
        optimizer: ClientOptimizer,
        poisoned: np.ndarray,
        data_attack: DataAttack | None,
        lr_at: Callable[[int], float],
        d: int,
    ):
        self.seed, self.batch_size = cfg.seed, cfg.batch_size
        self.local_steps, self.local_epochs = cfg.local_steps, cfg.local_epochs
        self.layout, self.shards, self.stage, self.source = layout, shards, stage, source
        self.optimizer, self.poisoned, self.data_attack, self.lr_at = optimizer, poisoned, data_attack, lr_at
        self.rows: Vector = stage.empty((layout.n_local, d))
        # the device path's copy of the shards, one after the other: a round's batches are gathered
        # there, by indices that cross once a round, instead of each batch crossing (and waiting for
        # the device)
        self.device_data = None if stage.on_host else DeviceData(stage, shards)
        self.state: ClientState = optimizer.init(layout.n_local, d, None if stage.on_host else stage.device)
        if data_attack is not None and data_attack.remembers:  # checkpointed with the optimizer rows
            self.state[ATTACK_MEMORY] = np.full((layout.n_local, d), np.nan, np.float32)

    def updates(self, t: int, w: Vector, taking: np.ndarray) -> tuple[Vector, BatchLosses]:
        """Round ``t`` from the shared weights ``w`` (staged): the uploads of the local clients that take
        part (``taking``, per local client) in ``rows``, and each one's first batch loss, unread
        (:class:`BatchLosses`). Returns ``(rows, losses)``; ``rows`` is this object's buffer, valid
        until the next round."""
        remembers = self.data_attack is not None and self.data_attack.remembers
        # an attack that remembers reads the weights in host memory: copied once a round, not per attacker
        w_host = host(w) if remembers else None
        groups = self.source.groups(self.layout.local_clients, taking)
        ready = self.device_batches(t, taking, groups)
        losses: list[tuple[list[int], Any]] = []
        for group in groups:
            self.steps_of(t, w, group, ready, losses, w_host)
        return self.rows, BatchLosses(self.layout.n_clients, losses)

    def device_batches(self, t: int, taking: np.ndarray, groups: list[Group]) -> RoundBatches | None:
        """On the device path, round ``t``'s batches of the local clients that take part (``taking``)
        and train on clean data, gathered on the device from :attr:`device_data`: every batch's
        indices drawn first (the draws of :meth:`local_batches`, each client's in the same order), laid
        out group by group and step by step (``groups``, in the order :meth:`steps_of` takes them), and moved
        in one copy. None on the host path, or when no such client takes part; a poisoned client's
        batches stay host batches. A group whose slots all hold such clients gets each step's batches
        in one gather (:meth:`RoundBatches.stacked`)."""
        if self.device_data is None:
            return None
        lo = self.layout.lo
        clean = {c for c in self.layout.local_clients if taking[c - lo] and not self.data_poisoned(c)}
        rngs = self.batch_draws(t, sorted(clean))
        drawn = {c: list(self.batch_indices(self.shards[c - lo], rng)) for c, rng in rngs.items()}
        if not drawn:
            return None
        offsets = self.device_data.offsets
        spans: dict[int, list[tuple[int, int]]] = {c: [] for c in drawn}
        parts, at = [], 0
        for group in groups:
            held = [c for c in group.held if c in clean]
            for step in range(max((len(drawn[c]) for c in held), default=0)):
                for c in held:
                    if step < len(drawn[c]):
                        idx = drawn[c][step]
                        parts.append(idx + offsets[c - lo])
                        spans[c].append((at, len(idx)))
                        at += len(idx)
        return RoundBatches(self.device_data, self.stage.tensor(np.concatenate(parts)), spans)

    def steps_of(
        self,
        t: int,
        w: Vector,
        group: Group,
        ready: RoundBatches | None,
        losses: list[tuple[list[int], Any]],
        w_host: np.ndarray | None,
    ) -> None:
        """The local steps of ``group``'s held clients (their batches from ``ready``, else drawn now),
        their uploads into ``rows`` and their first batch losses into ``losses``; a poisoned client
        whose attack runs its steps (:attr:`fedring.attacks.DataAttack.owns_steps`) runs alone."""
        if self.data_attack is not None and self.data_attack.owns_steps:
            for c in [c for c in group.held if self.poisoned[c]]:
                self.attack_steps(t, w, Group(group.first, group.size, [c]), self.data_attack, losses, w_host)
            group = Group(group.first, group.size, [c for c in group.held if not self.poisoned[c]])
            if not group.held:
                return
        lo, held, lr = self.layout.lo, group.held, f32(self.lr_at(t))
        rngs = self.batch_draws(t, [c for c in held if ready is None or c not in ready])
        on_host = {c: self.batches(t, c, rng) for c, rng in rngs.items()}
        steps = self.step_count(self.shards[held[0] - lo])
        block = self.block(group)
        w_local, g = self.source.start(w, group, steps, block)
        for step in range(steps):
            batches: Batches | None = ready.stacked(group, step) if ready is not None else None
            if batches is None:
                drawn: dict[int, tuple[Any, Any]] = {c: next(it) for c, it in on_host.items()}
                if ready is not None:
                    drawn.update({c: ready.batch(c, step) for c in held if c not in on_host})
                batches = [drawn.get(c, drawn[held[0]]) for c in slots(group)]
            step_losses = self.source.gradients(step, w_local, batches, g)
            if step == 0:
                first_loss = step_losses
            # every slot's row at once, row by row the same arithmetic (a padded slot's is dropped);
            # w_local may be one row for all
            self.optimizer.gradient(g, w_local)
            if steps > 1:
                w_local -= lr * g
        self.source.end(w, group, steps)
        if block is not None:  # the gradients are in the rows already
            if steps > 1:
                block[:] = (w - w_local) / lr
            k = group.first - lo
            self.optimizer.direction(self.state, slice(k, k + group.size), block)
        else:
            for c in held:
                s, out = c - group.first, self.rows[c - lo]
                out[:] = (w - w_local[s]) / lr if steps > 1 else g[s]
                self.optimizer.direction(self.state, c - lo, out)
        for c in held:
            self.release(c, w_host, lr)
        losses.append((held, first_loss if block is not None else first_loss[[c - group.first for c in held]]))

    def block(self, group: Group) -> Vector | None:
        """The rows of ``group``'s slots when each holds one of its clients: its gradients are computed
        there; else None."""
        if len(group.held) != group.size:
            return None
        k = group.first - self.layout.lo
        return self.rows[k : k + group.size]

    def attack_steps(
        self, t: int, w: Vector, solo: Group, data_attack: DataAttack, losses: list, w_host: np.ndarray | None
    ) -> None:
        """The local steps of ``solo``'s one poisoned client, run by ``data_attack``
        (:meth:`fedring.attacks.DataAttack.local_steps`) on host vectors, and its upload
        ``(w - w_attack) / lr`` into ``rows``. Its gradients come from the group's source, the
        client's batch in every slot of a batched group (the other slots' results discarded)."""
        (c,) = solo.held
        s, out, lr = c - solo.first, self.rows[c - self.layout.lo], f32(self.lr_at(t))
        shard = self.shards[c - self.layout.lo]
        attack = data_attack.attacker(int(self.poisoned[:c].sum()))  # its index among the attackers
        # as with several steps: local weights of their own
        w_local, g = self.source.start(w, solo, 2, self.block(solo))
        first: list[float] = []

        def gradient(v: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
            w_local[s] = like(v, w_local)
            loss = float(self.source.gradients(1, w_local, [(x, y)] * solo.size, g)[s])  # step 1: loads w_local
            self.optimizer.gradient(g[s], w_local[s])
            if not first:  # the client's first batch loss, as an honest client reports it
                first.append(loss)
            return host(g[s]).copy(), loss

        rng = self.batch_draws(t, [c])[c]  # the draws of its honest batches, continued
        batches = chain.from_iterable(self.local_batches(shard, rng) for _ in count())
        w0 = host(w).view()
        w0.flags.writeable = False  # the replica's weights on the host path
        run = LocalRun(w0, batches, (shard.x, shard.y), gradient, lr, self.step_count(shard))
        w_attack = attack.local_steps(run)
        self.source.end(w, solo, 2)
        out[:] = (w - like(w_attack, w)) / lr
        self.upload(c, w_host, lr)
        losses.append(([c], first[0] if first else 0.0))

    def upload(self, client: int, w_host: np.ndarray | None, lr: float) -> None:
        """``client``'s update direction, in its row of :attr:`rows`, made the vector it uploads, in
        place: its momentum direction (:meth:`ClientOptimizer.direction`), then :meth:`release`."""
        k = client - self.layout.lo
        self.optimizer.direction(self.state, k, self.rows[k])
        self.release(client, w_host, lr)

    def release(self, client: int, w_host: np.ndarray | None, lr: float) -> None:
        """Under a data attack, poisoned ``client``'s row of :attr:`rows` changed
        (:meth:`fedring.attacks.DataAttack.release`, from the round's host weights ``w_host``, given
        to an attack that remembers, and ``lr``) and scaled, in place; nothing for another client. A
        data attack works on host rows: on the device path its attacker's row goes to host memory
        and back."""
        if not self.poisoned[client] or self.data_attack is None:
            return
        k = client - self.layout.lo
        out = self.rows[k]
        memory = self.state[ATTACK_MEMORY][k] if self.data_attack.remembers else None
        row = host(out)  # out itself on the host path
        self.data_attack.release(row, lr, w_host, memory)
        if self.data_attack.scale != 1:
            row *= np.float32(self.data_attack.scale)
        if row is not out:
            out[...] = like(row, out)

    def batch_draws(self, t: int, clients: list[int]) -> dict[int, np.random.Generator]:
        """The generators of ``clients``' batches in round ``t``, on either path
        (:func:`fedring.rng.client_generators`: made together where that is faster)."""
        return dict(zip(clients, client_generators(self.seed, Stream.BATCH, clients, t), strict=True))

    def data_poisoned(self, client: int) -> bool:
        """Whether ``client`` trains on batches a data attack changes."""
        return bool(self.poisoned[client]) and self.data_attack is not None

    def batches(
        self, t: int, client: int, rng: np.random.Generator | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``client``'s mini-batches of round ``t`` on the host, poisoned when it runs a data attack;
        ``rng`` its generator of :meth:`batch_draws`, unused (made here when None)."""
        shard = self.shards[client - self.layout.lo]
        rng = self.batch_draws(t, [client])[client] if rng is None else rng
        if not self.data_poisoned(client):
            return self.local_batches(shard, rng)
        assert self.data_attack is not None
        poison_rng = generator(self.seed, Stream.POISON, client=client, step=t)
        attack = self.data_attack.attacker(int(self.poisoned[:client].sum()))  # its index among the attackers
        return (attack.poison(x, y, poison_rng) for x, y in self.local_batches(shard, rng))

    def step_count(self, shard: Shard) -> int:
        """Local SGD steps of a client: ``local_steps``, or ``local_epochs`` passes of ceil(|shard| / batch_size)."""
        if self.local_epochs is None:
            return self.local_steps
        return self.local_epochs * -(-len(shard.y) // self.batch_size)

    def local_batches(self, shard: Shard, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The mini-batches of one round on the host (:meth:`batch_indices`)."""
        for idx in self.batch_indices(shard, rng):
            yield shard.x[idx], shard.y[idx]

    def batch_indices(self, shard: Shard, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """The sorted sample indices of one round's mini-batches: ``local_steps`` drawn without
        replacement each, or ``local_epochs`` passes over a fresh permutation of the shard (the last
        batch of a pass may be smaller)."""
        if self.local_epochs is None:
            size = min(self.batch_size, len(shard.y))
            for _ in range(self.local_steps):
                yield np.sort(rng.choice(len(shard.y), size, replace=False))
            return
        for _ in range(self.local_epochs):
            order = rng.permutation(len(shard.y))
            for a in range(0, len(order), self.batch_size):
                yield np.sort(order[a : a + self.batch_size])


class BatchLosses:
    """A round's first batch loss of each local client that took part, read by :meth:`read`: the
    model's losses are tensors, on a device read in one copy, which waits for the device, so the
    round reads them at its end, once its work is queued; an attack that runs its own steps reports
    a number."""

    def __init__(self, n_clients: int, losses: list[tuple[list[int], Any]]):
        self.n_clients = n_clients
        measured = [(cs, v) for cs, v in losses if isinstance(v, torch.Tensor)]
        self.measured = [c for cs, _ in measured for c in cs]
        self.values = torch.cat([v for _, v in measured]) if measured else None
        self.reported = [(cs, v) for cs, v in losses if not isinstance(v, torch.Tensor)]

    def read(self) -> np.ndarray:
        """The losses in a ``(n_clients,)`` array, zero for the clients that did not take part."""
        out = np.zeros(self.n_clients)
        if self.values is not None:
            out[self.measured] = host(self.values)
        for cs, v in self.reported:
            out[cs] = v
        return out


class DeviceData:
    """A rank's shards on the device, one after the other: ``x`` and ``y``, and where each local
    client's samples start (``offsets``)."""

    def __init__(self, stage: Staging, shards: list[Shard]):
        self.x = stage.tensor(np.concatenate([s.x for s in shards]))
        self.y = stage.tensor(np.concatenate([s.y for s in shards]))
        self.offsets = np.cumsum([0, *(len(s.y) for s in shards[:-1])]).tolist()


class RoundBatches:
    """One round's batches on the device (:meth:`Clients.device_batches`): the samples' indices into
    ``data``, in one device array, and each client's batches as ``(start, length)`` spans of it."""

    def __init__(self, data: DeviceData, index: torch.Tensor, spans: dict[int, list[tuple[int, int]]]):
        self.data, self.index, self.spans = data, index, spans

    def __contains__(self, client: int) -> bool:
        return client in self.spans

    def batch(self, client: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``client``'s batch of local step ``step``."""
        at, m = self.spans[client][step]
        part = self.index[at : at + m]
        return self.data.x.index_select(0, part), self.data.y.index_select(0, part)

    def stacked(self, group: Group, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``(size, batch, ...)`` batches of step ``step`` of every slot of ``group``, gathered at
        once, when every slot is a client of this round's with a batch of one size at that step (laid
        out one after the other); else None."""
        spans = [s[step] for c in slots(group) if step < len(s := self.spans.get(c, []))]
        if not spans or spans != [(spans[0][0] + k * spans[0][1], spans[0][1]) for k in range(group.size)]:
            return None
        (at, m), size = spans[0], group.size
        part = self.index[at : at + size * m]
        x, y = self.data.x.index_select(0, part), self.data.y.index_select(0, part)
        return x.view(size, m, *x.shape[1:]), y.view(size, m, *y.shape[1:])


def slots(group: Group) -> range:
    """The client ids of ``group``'s slots."""
    return range(group.first, group.first + group.size)
