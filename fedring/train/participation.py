"""Client sampling and availability: which clients take part in a round (``docs/training.md``).

Each round ``t`` the cohort is drawn from the run's seed and the round only
(:mod:`fedring.rng`), never from a rank's state, so the same seed gives the same cohorts on any
number of ranks and a resumed run draws what the uninterrupted run drew:

1. the available clients: every client (default); each client independently with probability
   ``availability`` (client ``c`` is available when entry ``c`` of
   ``generator(seed, AVAILABILITY, step=t).random(n)`` is below it); or row ``t`` of
   ``availability_file``;
2. the cohort: ``participation`` of them, drawn uniformly without replacement
   (``generator(seed, COHORT, step=t).choice``) from the available ones, or every available
   client when fewer are available. ``participation`` is a fraction of all clients in (0, 1]
   (``max(1, round(participation * clients))`` clients) or a whole count above 1.

The defence is told ``f`` for the cohort by ``cohort_f``: ``scaled`` (default)
``ceil(f * m / n)`` for a cohort of ``m`` of the ``n`` clients, ``f`` the run's declared count
(the declared fraction times the cohort size, rounded up); ``declared``: ``f`` itself.

This module imports no torch.

>>> p = Participation(n_clients=10, seed=0, participation=0.3)
>>> p.cohort(0).tolist(), p.cohort(1).tolist()
([3, 4, 7], [0, 6, 9])
>>> p.cohort_f(3, declared_f=2), Participation(10, 0, 0.3, cohort_f="declared").cohort_f(3, declared_f=2)
(1, 2)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fedring import validate
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

COHORT_F = ("scaled", "declared")


def cohort_size(participation: float, n_clients: int) -> int:
    """Clients drawn per round: a fraction of ``n_clients`` (at least one) or a count.

    >>> cohort_size(0.1, 100), cohort_size(0.01, 10), cohort_size(7, 100), cohort_size(1.0, 5)
    (10, 1, 7, 5)
    """
    return max(1, round(participation * n_clients)) if participation <= 1 else int(participation)


def cohort_f(policy: str, declared_f: int, m: int, n_clients: int) -> int:
    """The ``f`` a rule is told for a cohort of ``m`` clients: ``ceil(declared_f * m / n_clients)``
    (``scaled``), or ``declared_f`` (``declared``).

    >>> cohort_f("scaled", 2, 3, 10), cohort_f("scaled", 2, 5, 10), cohort_f("declared", 2, 3, 10)
    (1, 1, 2)
    """
    return declared_f if policy == "declared" else -(-declared_f * m // n_clients)


def from_config(cfg) -> Participation:
    """The run's :class:`Participation` (its availability table read from ``availability_file``)."""
    table = (
        None if cfg.availability_file is None else read_availability(cfg.availability_file, cfg.rounds, cfg.n_clients)
    )
    return Participation(cfg.n_clients, cfg.seed, cfg.participation, cfg.availability, table, cfg.cohort_f)


def read_availability(path: str, rounds: int, n_clients: int) -> np.ndarray:
    """The ``(rounds, clients)`` 0/1 table of ``availability_file`` (``.npy``, or ``.csv``: one line per
    round, one 0 or 1 per client, comma-separated); at least ``rounds`` rows (later ones are unused)."""
    key = "availability_file"
    if not os.path.isfile(path):
        raise ConfigError(key, f"file {path} does not exist")
    try:
        if path.endswith(".npy"):
            table = np.load(path, allow_pickle=False)
        elif path.endswith(".csv"):
            table = np.loadtxt(path, delimiter=",", ndmin=2)
        else:
            raise ConfigError(key, f"{path}: must be a .npy or .csv file of rounds x clients 0/1 values")
    except (ValueError, OSError) as e:
        raise ConfigError(key, f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if table.ndim != 2 or table.shape[0] < rounds or table.shape[1] != n_clients:
        raise ConfigError(
            key,
            f"{path} has shape {table.shape}: needs at least {rounds} rows (rounds) of {n_clients} columns (clients)",
        )
    if table.dtype.kind not in "biuf" or not np.isin(table, (0, 1)).all():
        raise ConfigError(key, f"{path}: every entry must be 0 (unavailable) or 1 (available)")
    return table[:rounds].astype(bool)


def validate_settings(participation, availability, availability_file, cohort_f, rounds: int, n_clients: int) -> None:
    """Validate the participation settings before any work (one-line :class:`ConfigError` naming the key)."""
    validate.real("participation", participation, lo=0, lo_open=True)
    if participation > 1 and (not float(participation).is_integer() or participation > n_clients):
        raise ConfigError(
            "participation",
            f"a fraction in (0, 1] or a whole count of clients in [2, {n_clients}], got {validate.shown(participation)}",
        )
    validate.real("availability", availability, lo=0, hi=1, lo_open=True)
    validate.choice("cohort_f", cohort_f, COHORT_F)
    if availability_file is not None:
        if availability != 1:
            raise ConfigError("availability_file", "give availability (a probability) or availability_file, not both")
        read_availability(availability_file, rounds, n_clients)


@dataclass(frozen=True)
class Cohort:
    """Round ``t``'s cohort: the sorted client ids ``clients``, ``member`` as a ``(n_clients,)`` bool
    mask, the Byzantine clients among them (``byzantine``, a count), the ``f`` the defence is told,
    and the members that must download the model first (``stale``: :meth:`Participation.stale`)."""

    t: int
    clients: np.ndarray
    member: np.ndarray
    byzantine: int
    f: int
    stale: np.ndarray

    @property
    def size(self) -> int:
        return len(self.clients)


class Participation:
    """The cohorts of a run (module docstring); :attr:`everyone` when every client takes every round."""

    def __init__(
        self,
        n_clients: int,
        seed: int,
        participation: float = 1.0,
        availability: float = 1.0,
        table: np.ndarray | None = None,
        cohort_f: str = "scaled",
    ):
        self.n_clients, self.seed, self.participation = n_clients, seed, participation
        self.availability, self.table, self.cohort_f_policy = availability, table, cohort_f
        self.size = cohort_size(participation, n_clients)

    @property
    def everyone(self) -> bool:
        """Full participation: the run takes the code path without cohorts (bit-identical to before)."""
        return self.size == self.n_clients and self.availability == 1 and self.table is None

    def available(self, t: int) -> np.ndarray:
        """Round ``t``'s available clients, as a ``(clients,)`` bool mask."""
        if self.table is not None:
            return self.table[t]
        if self.availability < 1:
            return generator(self.seed, Stream.AVAILABILITY, step=t).random(self.n_clients) < self.availability
        return np.ones(self.n_clients, bool)

    def cohort(self, t: int) -> np.ndarray:
        """Round ``t``'s cohort: sorted client ids (maybe empty when nobody is available)."""
        ids = np.flatnonzero(self.available(t))
        if len(ids) <= self.size:
            return ids
        return np.sort(generator(self.seed, Stream.COHORT, step=t).choice(ids, self.size, replace=False))

    def cohort_f(self, m: int, declared_f: int) -> int:
        """The Byzantine count the defence is told for a cohort of ``m`` clients (``cohort_f``)."""
        return cohort_f(self.cohort_f_policy, declared_f, m, self.n_clients)

    def draw(self, t: int, is_byzantine: np.ndarray, declared_f: int) -> Cohort:
        """Round ``t``'s :class:`Cohort`, given which clients are Byzantine and the run's declared ``f``."""
        clients = self.cohort(t)
        member = np.zeros(self.n_clients, bool)
        member[clients] = True
        byzantine, f = int(is_byzantine[clients].sum()), self.cohort_f(len(clients), declared_f)
        return Cohort(t, clients, member, byzantine, f, self.stale(t, clients))

    def stale(self, t: int, clients: np.ndarray) -> np.ndarray:
        """Which of round ``t``'s members ``clients`` do not hold the current model: those that were not
        in the last non-empty cohort before it (every client holds the initial model: none before it)."""
        for s in range(t - 1, -1, -1):
            before = self.cohort(s)
            if len(before):
                return np.setdiff1d(clients, before, assume_unique=True)
        return clients[:0]
