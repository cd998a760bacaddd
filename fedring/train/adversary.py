"""The adversary: which clients are Byzantine, and how their model attack rewrites their rows.

A data attack (:class:`fedring.attacks.DataAttack`) acts inside the Byzantine clients' local
steps (:mod:`fedring.train.clients` poisons their batches); a model attack
(:class:`fedring.attacks.ModelAttack`) replaces their rows after the clients computed them
(:meth:`Adversary.attack`). Omniscient and colluding attacks learn the other clients' rows
through an explicit side channel (ledger phase ``adversary``), whose bytes are never counted as
protocol traffic.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedring.aggregators.probe import Probe
from fedring.arrays import array_namespace, device, host, like, on_host
from fedring.attacks import AttackContext, DataAttack, ModelAttack
from fedring.attacks.base import ModelAccess
from fedring.comm import Network
from fedring.comm.network import host_dtype
from fedring.config import Config, byzantine_count
from fedring.rng import Stream, generator

from .optim import Vector
from .participation import Cohort


def byzantine_clients(cfg: Config) -> np.ndarray:
    """Sorted ids of the clients that attack: drawn from the seed, or the first ones."""
    count = byzantine_count(cfg)
    if cfg.byzantine_select == "first":
        return np.arange(count)
    return np.sort(generator(cfg.seed, Stream.BYZANTINE).choice(cfg.n_clients, count, replace=False))


#: the defence's rule on all of a cohort's rows, ``(X, reference, cohort, probe) -> (d,)``: what
#: aggregator-aware attacks optimise against (the topology's ``reference_rule``)
ReferenceRule = Callable[[np.ndarray, "np.ndarray | None", Cohort, "Probe | None"], np.ndarray]


class Adversary:
    """The Byzantine clients (``byzantine``: sorted ids; ``is_byzantine``: the same as a mask over
    every client) and their attack, built once from the run's settings (``attack``)."""

    def __init__(
        self,
        cfg: Config,
        net: Network,
        byzantine: np.ndarray,
        attack: ModelAttack | DataAttack | None,
        reference_rule: ReferenceRule,
        lr_at: Callable[[int], float],
    ):
        self.seed, self.aggregator_name, self.net = cfg.seed, cfg.aggregator, net
        self.byzantine = byzantine
        self.is_byzantine = np.zeros(cfg.n_clients, bool)
        self.is_byzantine[byzantine] = True
        self.model_attack = attack if isinstance(attack, ModelAttack) else None
        self.data_attack = attack if isinstance(attack, DataAttack) else None
        self.reference_rule, self.lr_at = reference_rule, lr_at

    def poisoned(self) -> np.ndarray:
        """Which clients train on poisoned batches (a mask over every client; none without a data attack)."""
        return self.is_byzantine if self.data_attack is not None else np.zeros_like(self.is_byzantine)

    def attackers(self, cohort: Cohort) -> np.ndarray:
        """The Byzantine members of ``cohort`` (sorted ids); none when the model attack is undefined
        for the cohort (:meth:`fedring.attacks.ModelAttack.check`)."""
        attack = self.model_attack
        if attack is None or (cohort.byzantine and attack.check(cohort.size, cohort.byzantine, cohort.f) is not None):
            return self.byzantine[:0]
        return self.byzantine[cohort.member[self.byzantine]]

    def attack(
        self,
        rows: Vector,
        t: int,
        reference: np.ndarray | None,
        cohort: Cohort,
        probe: Probe | None = None,
        model: ModelAccess | None = None,
    ) -> Vector:
        """Round ``t``: ``rows`` (this rank's clients' uploads) with the rows of the cohort's attackers
        replaced; the attackers learn only the cohort's honest rows. An aggregator-aware attack runs the
        defence's rule with the round's ``reference`` and ``probe``; an attack that trains models gets
        rank 0's ``model``. Returns ``rows`` itself, rewritten in place (a rank holds one
        ``(clients, d)`` buffer of uploads).

        Device rows reach an attack that is ``on_device`` as tensors on their device, and any other
        attack as host copies; the crafted rows come back to the rows' device."""
        attack, attackers = self.model_attack, self.attackers(cohort)
        if attack is None or not len(attackers):
            return rows
        lay = self.net.layout
        local = [c - lay.lo for c in attackers if lay.lo <= c < lay.hi]
        on_device = not on_host(rows) and getattr(attack, "on_device", False)
        if attack.knowledge == "own":
            for k in local:
                rng = generator(self.seed, Stream.ATTACK, client=lay.lo + k, step=t)
                own = rows[k : k + 1] if on_device else host(rows[k : k + 1])
                rows[k] = like(attack(own, None, self.context(rng, t, None, cohort)), rows)[0]
            return rows
        crafted = None
        byz, honest = self.learn(rows, cohort.member, attack.knowledge == "omniscient", attack.blockwise, on_device)
        if byz is not None:
            rng = generator(self.seed, Stream.ATTACK, step=t)
            crafted = attack(byz, honest, self.context(rng, t, reference, cohort, probe, model))
            del byz, honest  # before the scatter and the server's own gather
        rows[local] = self.net.scatter_from_server(
            crafted, attackers, "adversary", tuple(rows.shape[1:]), host_dtype(rows), ref=rows
        )
        return rows

    def context(
        self,
        rng: np.random.Generator,
        t: int,
        reference: np.ndarray | None,
        cohort: Cohort,
        probe: Probe | None = None,
        model: ModelAccess | None = None,
    ) -> AttackContext:
        return AttackContext(
            rng=rng,
            n=cohort.size,
            f=cohort.f,
            lr=self.lr_at(t),
            round=t,
            aggregator=lambda X: self.reference_rule(X, reference, cohort, probe),
            aggregator_name=self.aggregator_name,
            model=model,
        )

    def learn(
        self, rows: Vector, member: np.ndarray, omniscient: bool, blockwise: bool, on_device: bool
    ) -> tuple[Vector | None, Vector | None]:
        """Over the side channel, on rank 0: the Byzantine members' rows and, for an omniscient attack,
        the honest members' rows in the clients' own dtype for a ``blockwise`` attack, else in float64,
        in client order, each row copied as its rank's block arrives, so rank 0 never holds all n rows
        besides; (None, None) elsewhere. Host arrays, or ``on_device``, arrays of the rows' kind on
        their device (each rank's block copied there once)."""
        byz_member, honest_member = member & self.is_byzantine, member & ~self.is_byzantine
        slot = np.where(byz_member, np.cumsum(byz_member), np.cumsum(honest_member)) - 1
        byz = honest = None
        if self.net.layout.rank == 0:
            shape = tuple(rows.shape[1:])
            if on_device:
                xp, where = array_namespace(rows), device(rows)
                byz = xp.empty((int(byz_member.sum()), *shape), dtype=rows.dtype, device=where)
                if omniscient:
                    dtype = rows.dtype if blockwise else xp.float64
                    honest = xp.empty((int(honest_member.sum()), *shape), dtype=dtype, device=where)
            else:
                byz = np.empty((int(byz_member.sum()), *shape), host_dtype(rows))
                if omniscient:
                    honest = np.empty((int(honest_member.sum()), *shape), host_dtype(rows) if blockwise else np.float64)
        for first, block in self.net.gather_blocks(rows, "adversary"):
            if on_device and on_host(block):  # another rank's block: to the device, one copy
                block = like(block, rows)
            elif not on_device:  # rank 0's own device rows: to the host, one copy (a numpy block: itself)
                block = host(block)
            for k, client in enumerate(range(first, first + len(block))):
                into = byz if byz_member[client] else honest if honest_member[client] else None
                if into is not None:
                    into[slot[client]] = block[k]
        return byz, honest
