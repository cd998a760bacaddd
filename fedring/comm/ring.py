"""Ring-all-reduce from point-to-point messages: reduce-scatter, then all-gather.

The ``n`` logical clients form a ring; client ``i`` sends only to ``i + 1`` and receives
only from ``i - 1`` (mod ``n``). A ``d``-vector is cut into ``n`` contiguous chunks in
``numpy.array_split`` order (the first ``d mod n`` chunks one element longer), as
baidu-allreduce does; the BRACE paper only asks for "roughly equal-sized" chunks.

- Reduce-scatter (the BRACE paper's *Share-Reduce*), steps ``s = 0 .. n-2``: client ``i``
  sends its partial sum of chunk ``(i - s) mod n``; the receiver adds it to its own. After
  it, client ``i`` holds the complete sum of chunk ``(i + 1) mod n``.
- All-gather (*Share-Only*), steps ``s = 0 .. n-2``: client ``i`` sends the complete chunk
  ``(i + 1 - s) mod n``; the receiver overwrites its copy.

Client ``i`` sends ``d - |C_{i+1}|`` elements in reduce-scatter and ``d - |C_{i+2}|`` in
all-gather, ``2 (n-1)/n d`` in all when ``n`` divides ``d`` (the BRACE paper's RAR cost,
Table 1). The order of the additions of every chunk is fixed by the ring,
not by how clients are spread over ranks, so results are bit-identical on any number of
ranks.

The rows may be numpy arrays or device arrays (docs/arrays.md, "Rows and the ring on the
device"): hops between clients of one rank are operations on the device, chunks that cross
ranks go through host buffers, and every chunk gets the same additions in the same order, so
the same values give the same bits either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedring.arrays import full
from fedring.registry import Registry

from .network import Layout, Network, add, block_bounds

#: the rules that aggregate over the ring (``--topology ring --aggregator NAME``)
# CRFL's ring rule lives with its server rule (fedring.aggregators.crfl), imported on the first read
RING_RULES = Registry("ring rule", modules=("fedring.aggregators.crfl",))


def rotation(shift: int, n: int) -> Callable[[int], int]:
    """``chunk_of`` for :meth:`Network.ring_step`: client ``i`` sends chunk ``(i + shift) mod n``
    (elementwise for an array of clients).

    >>> [rotation(-1, 4)(i) for i in range(4)]
    [3, 0, 1, 2]
    """
    return lambda i: (i + shift) % n


def reduce_scatter(
    net: Network, rows, bounds: np.ndarray, phase: str = "reduce_scatter", check: bool = True, ahead=None
) -> None:
    """In place: afterwards client ``i``'s row holds the ring sum of chunk ``(i + 1) mod n`` (``rows``:
    numpy or a device array, docs/arrays.md); what its other chunks hold is unspecified.

    ``check=False`` skips :meth:`Network.check_rows` for rows the caller made itself;
    ``ahead`` prepares a chunk while the partial sum into it travels (:meth:`Network.ring_step`).
    """
    if check:
        net.check_rows(rows)
    if ahead is None and net.layout.size == 1:  # the same additions at once (:meth:`Network.reduce_owned`)
        net.reduce_owned(rows, bounds, owned_runs(net.layout, bounds), phase)
        return
    n = net.n_clients
    for s in range(n - 1):
        net.ring_step(rows, bounds, rotation(-s, n), add, phase, ahead)


def all_gather(
    net: Network, rows, bounds: np.ndarray, phase: str = "all_gather", check: bool = True, ahead=None
) -> None:
    """In place: client ``i`` starts owning chunk ``(i + 1) mod n``; afterwards every row holds all chunks.

    ``ahead``: work done while a chunk travels (:meth:`Network.ring_step`)."""
    if check:
        net.check_rows(rows)
    if ahead is None and net.layout.size == 1:  # the same copies at once (:meth:`Network.spread_owned`)
        net.spread_owned(rows, bounds, owned_runs(net.layout, bounds), phase)
        return
    n = net.n_clients
    for s in range(n - 1):
        net.ring_step(rows, bounds, rotation(1 - s, n), None, phase, ahead)


def owned_chunk(client: int, n: int) -> int:
    """The chunk a client holds complete after reduce-scatter."""
    return (client + 1) % n


def owned_runs(layout: Layout, bounds: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """The chunks this rank's clients own after Share-Reduce, as runs ``(row, chunk, rows)``: local rows
    ``row .. row + rows - 1`` own the consecutive chunks ``chunk ..``, all of one nonzero size, so that
    each run is one strided view of the rows (:func:`fedring.arrays.strided`). Listed once per
    layout and bounds: a ring asks every round.

    >>> from mpi4py import MPI
    >>> owned_runs(Layout(4, MPI.COMM_SELF), block_bounds(10, 4))  # chunk sizes 3, 3, 2, 2
    ((0, 1, 1), (1, 2, 2), (3, 0, 1))
    """
    return _owned_runs(layout.lo, layout.hi, np.asarray(bounds, np.int64).tobytes())


@functools.lru_cache(maxsize=64)
def _owned_runs(lo: int, hi: int, bounds: bytes) -> tuple[tuple[int, int, int], ...]:
    edges = np.frombuffer(bounds, np.int64)
    n, sizes = len(edges) - 1, np.diff(edges)
    runs: list[list[int]] = []
    for k, i in enumerate(range(lo, hi)):
        c = owned_chunk(i, n)
        if runs and c == runs[-1][1] + runs[-1][2] and sizes[c] == sizes[runs[-1][1]]:
            runs[-1][2] += 1
        else:
            runs.append([k, c, 1])
    return tuple((k, c, m) for k, c, m in runs if sizes[c])


def ring_allreduce(net: Network, rows):
    """Sum the rows of all clients; in place, every row ends as the total.

    Parameters
    ----------
    net : Network
    rows : ndarray or device array, shape (n_local, d)
        One row per client hosted on this rank, any numeric dtype; every rank's of one kind.

    Examples
    --------
    The BRACE paper's Fig. 1 (n = d = 3): clients hold [5, 2, -10], [8, -4, 7] and
    [9, 3, 8]; every client ends with [22, 1, 5].
    """
    net.check_rows(rows)
    bounds = block_bounds(rows.shape[1], net.n_clients)
    reduce_scatter(net, rows, bounds, check=False)
    all_gather(net, rows, bounds, check=False)
    return rows


@dataclass(frozen=True)
class Aggregation:
    """What a round's aggregation produced, on either topology (a ring rule's :meth:`RingRule.aggregate`,
    and :mod:`fedring.train.topology`): the ``(d,)`` ``update`` every replica applies; the ring
    rule's scalar ``figures`` and per-client ``rows`` (written under ``/ring`` of the results file;
    empty on the server); the server rule's weight per client (``selected``, on rank 0; None on
    the ring and for rules that report none); ``updated``: False when the round has no update (an
    empty cohort, or one too small for the rule), so the model stays. The ``update`` is of the kind
    of the rows it came from (a device array on the device path); the figures and rows are numpy.
    """

    update: Any
    figures: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    selected: np.ndarray | None = None
    updated: bool = True


@RING_RULES.base
class RingRule:
    """Base of the ring rules: ``rule.aggregate(net, grads, t)`` runs round ``t`` and returns its
    :class:`Aggregation`; ``rule(net, grads, t)`` returns just the update.

    ``grads`` holds the ``(n_local, d)`` rows of this rank's clients (their gradients after
    any attack); rules that draw per round key their draws by ``t``. ``centralized`` computes
    the same update from all ``(n, d)`` rows at once (what aggregator-aware attacks optimise
    against).

    ``on_device``: whether :meth:`aggregate` and :meth:`centralized` take device arrays (returning
    an update on the rows' device); the others take numpy rows only, and the training topology
    hands them a host copy (:mod:`fedring.train.topology`).
    """

    name = ""
    params: tuple[str, ...] = ()
    on_device = False

    @classmethod
    def cohort_params(cls, params: dict, m: int, n: int) -> dict:
        """The settings ``params`` of a run of ``n`` clients, read relative to a round's cohort of ``m``
        of them (client sampling, ``docs/training.md``): the rule is built from these for ``m`` clients.
        Rules without a count threshold take them as they are."""
        return params

    def set_byzantine(self, clients) -> None:
        """The Byzantine clients, for rules whose relays can misbehave."""

    def aggregate(self, net: Network, grads: np.ndarray, t: int = 0) -> Aggregation:
        raise NotImplementedError

    def idle(self, d: int) -> Aggregation:
        """What a round without clients (an empty cohort) reports: no update; the rule's figures as
        NaN (integers as 0) and its per-client rows as zeros, so that every ``/ring`` dataset keeps
        one row per round."""
        return Aggregation(np.zeros(d, np.float32), updated=False)

    def __call__(self, net: Network, grads: np.ndarray, t: int = 0) -> np.ndarray:
        return self.aggregate(net, grads, t).update

    def centralized(self, G: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@RING_RULES.register
class RingAllReduce(RingRule):
    """Plain ring-all-reduce (RAR): the mean of the clients' rows, no defence.

    >>> from mpi4py import MPI
    >>> from fedring.comm import Layout
    >>> rows = np.array([[5, 2, -10], [8, -4, 7], [9, 3, 8]], np.float32)
    >>> RingAllReduce(3)(Network(Layout(3, MPI.COMM_SELF)), rows.copy())
    array([7.3333335 , 0.33333334, 1.6666666 ], dtype=float32)
    """

    name = "mean"
    on_device = True

    def __init__(self, n_clients: int):
        self.n_clients = n_clients

    def aggregate(self, net: Network, grads, t: int = 0) -> Aggregation:
        """The ring sum of ``grads`` (numpy or device rows, in place) divided by ``n``: by a 0-d array of
        the rows' kind, an elementwise division on either (a device's kernel may turn a Python scalar
        divisor into a multiplication by its reciprocal, which rounds differently), filled where the
        rows are (a copy from host memory would wait for the device's queued work)."""
        ring_allreduce(net, grads)
        return Aggregation(grads[0] / full((), self.n_clients, grads, np.float32))

    def centralized(self, G: np.ndarray) -> np.ndarray:
        return G.mean(axis=0)
