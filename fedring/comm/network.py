"""Point-to-point messages between logical clients, with every payload byte counted.

Each MPI rank hosts a contiguous block of the ``n`` logical clients. A message between two
clients on the same rank is a memory copy; between ranks it is an MPI message moved with
mpi4py's buffer methods (no pickling). Either way the sending client's payload bytes go
into the :class:`Ledger`, so communication costs are measured, not computed from formulas.

Rows may be host arrays (numpy) or device arrays (torch tensors, docs/arrays.md): a hop between
clients of one rank is an operation on the rows' own device; a chunk or row that crosses ranks is
copied into a reused host buffer segment by segment, each segment sent as soon as it is there, and
copied from the receiver's host buffer to its device segment by segment as it arrives; or, where
MPI moves device memory itself (:func:`device_mpi`), sent from and received into device memory.
The ledger counts the same bytes either way.

This module imports no torch.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from fedring.arrays import array_namespace, device, host, host_into, like, on_host, strided
from fedring.errors import ConfigError
from fedring.validate import fills_ranks

#: Ledger phases that are not part of the protocol under study (the adversary's side
#: channel): counted, but never added into ``bytes_sent``.
SIDE_CHANNELS = frozenset({"adversary"})

#: How a rank waits for its point-to-point messages (environment ``FEDRING_WAIT``): ``spin``
#: (the default) lets MPI poll; ``sleep`` tests them and sleeps between tests (10 us, doubling up
#: to :data:`MAX_PAUSE`), leaving the core to the ranks that share it while the kernel moves the
#: bytes. docs/figures.md measures both.
WAIT_POLICIES = ("spin", "sleep")
MAX_PAUSE = 2e-4
#: Point-to-point messages travel in segments of this many bytes (environment
#: ``FEDRING_SEGMENT_BYTES``; 0: whole), so that a ring's segment is reduced while the next ones
#: are on the wire, and MPI has a segment to move at every test of a sleeping wait.
SEGMENT_BYTES = 1 << 20
#: Whether device arrays go to MPI as they are (environment ``FEDRING_DEVICE_MPI``): ``auto`` (the
#: default: where mpi4py reports a CUDA-aware MPI), ``on`` or ``off`` (through host buffers).
DEVICE_MPI = ("auto", "on", "off")
#: The largest padded copy of the rows, in bytes (about twice the rows with balanced chunks), that
#: :meth:`Network.reduce_owned` makes so that each of the ring's steps is one addition
#: (:func:`padded_sums`). On the host (numpy or CPU tensors): up to where the copy costs more than
#: the steps' calls it saves (docs/figures.md, the ring on one rank). On a device, where a step's
#: launch costs about what copying a megabyte does: more (a bound reasoned from launch time and
#: memory bandwidth, not yet measured on a GPU).
PADDED_BYTES = {"host": 8 << 20, "device": 512 << 20}


def wait_policy(value: str | None = None) -> str:
    """The wait policy: ``value``, else ``FEDRING_WAIT``, else ``spin``."""
    value = value or os.environ.get("FEDRING_WAIT") or WAIT_POLICIES[0]
    if value not in WAIT_POLICIES:
        raise ConfigError("FEDRING_WAIT", f"must be one of {', '.join(WAIT_POLICIES)}, got {value!r}")
    return value


def segment_bytes(value: int | None = None) -> int:
    """Bytes per ring segment: ``value``, else ``FEDRING_SEGMENT_BYTES``, else :data:`SEGMENT_BYTES`."""
    if value is None:
        text = os.environ.get("FEDRING_SEGMENT_BYTES", str(SEGMENT_BYTES))
        value = int(text) if text.isdigit() else -1
    if value < 0:
        raise ConfigError("FEDRING_SEGMENT_BYTES", "must be a number of bytes >= 0 (0: whole chunks)")
    return value


def device_mpi(value: str | None = None) -> bool:
    """Whether MPI sends from and receives into device memory: ``value``, else
    ``FEDRING_DEVICE_MPI``, else ``auto``, which is on where mpi4py reports a CUDA-aware MPI
    (``MPI.Query_cuda_support()``, which mpi4py offers only where its MPI library has the query).

    >>> device_mpi("off")
    False
    """
    value = value or os.environ.get("FEDRING_DEVICE_MPI") or DEVICE_MPI[0]
    if value not in DEVICE_MPI:
        raise ConfigError("FEDRING_DEVICE_MPI", f"must be one of {', '.join(DEVICE_MPI)}, got {value!r}")
    if value == "auto":
        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query is not None and query())
    return value == "on"


def host_dtype(x) -> np.dtype:
    """The numpy dtype of the elements of ``x`` (either kind): a tensor's read through the array API's
    dtype queries (kind and bits), so that the checks and the host buffers of both kinds agree.

    >>> host_dtype(np.zeros(2, np.float32))
    dtype('float32')
    """
    if on_host(x):
        return x.dtype
    return _numpy_dtype(array_namespace(x), x.dtype)


@functools.lru_cache(maxsize=64)
def _numpy_dtype(xp, dtype) -> np.dtype:
    """:func:`host_dtype` of an array of namespace ``xp`` and ``dtype``, looked up once per dtype (a
    ring asks every step)."""
    if xp.isdtype(dtype, "bool"):
        return np.dtype(bool)
    for kind, code, info in (
        ("signed integer", "i", xp.iinfo),
        ("unsigned integer", "u", xp.iinfo),
        ("real floating", "f", xp.finfo),
    ):
        if xp.isdtype(dtype, kind):
            found = np.dtype(f"{code}{info(dtype).bits // 8}")
            # a float that numpy has no type for (bfloat16: float16's size, not its format) is refused
            if code == "f" and info(dtype).eps != np.finfo(found).eps:
                break
            return found
    return np.dtype(np.void)  # not a numpy number: refused by Network.check_rows


def nbytes(x) -> int:
    """The bytes of the elements of ``x`` (either kind).

    >>> nbytes(np.zeros((2, 3), np.float32))
    24
    """
    return math.prod(x.shape) * host_dtype(x).itemsize


def contiguous(x) -> bool:
    """Whether ``x`` (either kind) is C-contiguous."""
    return bool(x.flags.c_contiguous) if on_host(x) else bool(x.is_contiguous())


def device_array(x) -> bool:
    """Whether ``x`` is an array that is not a numpy array (a tensor), as opposed to a numpy array or
    anything ``numpy.asarray`` takes."""
    return not on_host(x) and hasattr(x, "__dlpack__")


def block_bounds(total: int, parts: int) -> np.ndarray:
    """Boundaries of ``parts`` contiguous blocks of ``total`` items, ``numpy.array_split`` order.

    The first ``total % parts`` blocks have one item more. Returns ``parts + 1`` offsets.

    >>> block_bounds(10, 4).tolist()
    [0, 3, 6, 8, 10]
    >>> block_bounds(2, 3).tolist()
    [0, 1, 2, 2]
    """
    q, r = divmod(total, parts)
    sizes = np.full(parts, q, dtype=np.int64)
    sizes[:r] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


@functools.lru_cache(maxsize=4096)
def hop_runs(
    n: int, lo: int, chunk_ids: bytes, bounds: bytes, d: int
) -> tuple[tuple[tuple[int, int, int, int], ...], np.ndarray]:
    """The hops of one ring step within a rank as runs, for :meth:`Network._local_hops`.

    Client ``lo + k`` sends chunk ``chunk_ids[k]`` (int64 bytes) of the ``bounds`` (int64 bytes) to
    client ``lo + k + 1 (mod n)``, both rows of one rank's ``(rows, d)`` buffer. A run is hops that
    move adjacent chunks of one size along consecutive rows: ``(hops, size, receiver's first
    element, sender's first element)``, offsets in elements of the buffer, each next hop ``d +
    size`` further. Also returns the hops' chunk sizes. Cached: a ring repeats the same steps
    every round.

    >>> hop_runs(3, 0, np.array([0, 1, 2]).tobytes(), block_bounds(6, 3).tobytes(), 6)[0]
    ((2, 2, 6, 0), (1, 2, 4, 16))
    """
    chunks, edges = np.frombuffer(chunk_ids, np.int64), np.frombuffer(bounds, np.int64)
    senders = np.arange(lo, lo + len(chunks))
    starts, sizes = edges[chunks], edges[chunks + 1] - edges[chunks]
    receivers = (senders + 1) % n - lo
    goes_on = (np.diff(starts) == sizes[:-1]) & (np.diff(sizes) == 0) & (np.diff(receivers) == 1)
    firsts = np.flatnonzero(np.concatenate([[True], ~goes_on])).tolist()
    runs = tuple(
        (b - a, int(sizes[a]), int(receivers[a]) * d + int(starts[a]), int(senders[a] - lo) * d + int(starts[a]))
        for a, b in zip(firsts, [*firsts[1:], len(senders)])
        if sizes[a]
    )
    sizes.flags.writeable = False
    return runs, sizes


@functools.lru_cache(maxsize=64)
def size_runs(bounds: bytes) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
    """The chunks of ``bounds`` (int64 bytes) as runs of adjacent chunks of one size, ``(first chunk,
    chunks, size, first element)``, and the longest chunk's size: the ``width`` of the padded layout
    of :func:`padded_sums`. Cached: a ring repeats the same steps every round.

    >>> size_runs(block_bounds(7, 3).tobytes())  # chunk sizes 3, 2, 2
    (3, ((0, 1, 3, 0), (1, 2, 2, 3)))
    """
    edges = np.frombuffer(bounds, np.int64)
    sizes, n = np.diff(edges), len(edges) - 1
    runs, c = [], 0
    while c < n:
        e = c + 1
        while e < n and sizes[e] == sizes[c]:
            e += 1
        runs.append((c, e - c, int(sizes[c]), int(edges[c])))
        c = e
    return int(sizes.max(initial=0)), tuple(runs)


@functools.lru_cache(maxsize=64)
def sum_plan(n: int, bounds: bytes, d: int) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """The reduce-scatter of ``n`` rows of one buffer as ``n`` steps of column-run additions, for
    :meth:`Network.reduce_owned`: step ``s`` adds row ``(c + s) mod n`` of every chunk ``c`` (of the
    ``bounds``, int64 bytes). Each step is pieces ``(chunks, size, first element of the sum,
    first element of the rows)``: adjacent chunks of one size whose rows do not wrap around, each
    next chunk ``size`` further in the sum and ``d + size`` further in the rows. Cached: a ring
    repeats the same steps every round.

    >>> sum_plan(3, block_bounds(7, 3).tobytes(), 7)[1]  # chunk sizes 3, 2, 2
    ((1, 3, 0, 7), (1, 2, 3, 17), (1, 2, 5, 5))
    """
    edges = np.frombuffer(bounds, np.int64)
    sizes = np.diff(edges)
    runs = [(c, c + m) for c, m, size, _ in size_runs(bounds)[1] if size]
    plan = []
    for s in range(n):
        pieces = []
        for a, b in runs:
            for lo, hi in ((a, min(b, n - s)), (max(a, n - s), b)):  # the rows before and after the wrap
                if lo < hi:
                    size = int(sizes[lo])
                    pieces.append((hi - lo, size, int(edges[lo]), ((lo + s) % n) * d + int(edges[lo])))
        plan.append(tuple(pieces))
    return tuple(plan)


def padded_sums(rows, width: int, runs: Iterable[tuple[int, int, int, int]]):
    """The ring sums of :meth:`Network.reduce_owned` in the padded layout (``width`` and ``runs``:
    :func:`size_runs`): row ``c`` of the ``(n, width)`` result holds chunk ``c`` summed over rows
    ``c, c + 1, ..., c - 1 (mod n)``, in that order, its padding zeros.

    The rows are copied twice into a ``(2n - 1, n, width)`` buffer, row ``n + i`` repeating row
    ``i``, so that the operands of step ``s`` (chunk ``c`` of row ``c + s`` for every ``c``) are one
    strided view with no wrap: each step is one addition, where the rows' own layout takes a few
    column runs a step (:func:`sum_plan`). The same additions of the same operands: the same bits."""
    n, d = rows.shape
    xp, at = array_namespace(rows), device(rows)
    pad = xp.empty((2 * n - 1, n, width), dtype=rows.dtype, device=at)
    for c, m, size, start in runs:
        into = (n, m, size), c * width, (n * width, width, 1)
        strided(pad, *into)[...] = strided(rows, (n, m, size), start, (d, size, 1))
        if size < width:
            strided(pad, (n, m, width - size), c * width + size, (n * width, width, 1))[...] = 0
    pad[n:] = pad[: n - 1]
    steps = strided(pad, (n, n, width), 0, (n * width, (n + 1) * width, 1))  # [s, c]: chunk c of row c + s
    sums = xp.empty((n, width), dtype=rows.dtype, device=at)
    sums[...] = steps[0]
    for operand in steps[1:]:  # the steps' views made at once (a tensor's iteration is one unbind)
        sums += operand
    return sums


def planned_sums(rows, plan: tuple[tuple[tuple[int, int, int, int], ...], ...]):
    """The ring sums of :meth:`Network.reduce_owned` in the rows' own layout, by the steps of
    :func:`sum_plan`: a d-vector holding each chunk's sum where the chunk is, no copy of the rows."""
    d = rows.shape[1]
    total = array_namespace(rows).empty(d, dtype=rows.dtype, device=device(rows))
    for s, pieces in enumerate(plan):
        for count, size, at, start in pieces:
            into, part = (
                strided(total, (count, size), at, (size, 1)),
                strided(rows, (count, size), start, (d + size, 1)),
            )
            if s:
                into += part
            else:
                into[...] = part
    return total


def first_problem(comm: MPI.Comm, problem: str | None, values=()) -> tuple[tuple[int, str] | None, np.ndarray]:
    """Collective, one small all-reduce: how the ranks agree on an error.

    Returns the lowest rank that found a ``problem`` with its message (None when no rank did;
    the message is then broadcast from that rank), and the minimum over the ranks of each
    integer in ``values`` (the same count on every rank), reduced in the same all-reduce.
    """
    agreed = np.array([comm.size if problem is None else comm.rank, *values], np.int64)
    comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MIN)
    failing = int(agreed[0])
    failed = None if failing == comm.size else (failing, comm.bcast(problem, root=failing))
    return failed, agreed[1:]


class Layout:
    """Which rank hosts which logical clients.

    Rank ``r`` hosts clients ``lo .. hi-1``, contiguous blocks in ``array_split`` order, so
    the first ranks host one client more when ``size`` does not divide ``n_clients``; or the
    blocks ``bounds`` (``size + 1`` offsets, each block non-empty: :meth:`Network.over`).
    """

    def __init__(self, n_clients: int, comm: MPI.Comm | None = None, bounds: np.ndarray | None = None):
        comm = MPI.COMM_WORLD if comm is None else comm
        if bounds is None:
            fills_ranks("clients", n_clients, comm.size)
            bounds = block_bounds(n_clients, comm.size)
        self.comm = comm
        self.n_clients = n_clients
        self.rank = comm.rank
        self.size = comm.size
        self.bounds = bounds
        self.lo = int(self.bounds[self.rank])
        self.hi = int(self.bounds[self.rank + 1])

    @property
    def n_local(self) -> int:
        return self.hi - self.lo

    @property
    def local_clients(self) -> range:
        return range(self.lo, self.hi)

    def owner(self, client):
        """Rank hosting ``client`` (an int, or an array of client ids -> an array of ranks)."""
        ranks = np.searchsorted(self.bounds, client, side="right") - 1
        return int(ranks) if np.ndim(ranks) == 0 else ranks


class Ledger:
    """Payload bytes sent, per logical client and per phase, plus the server's.

    Each rank records the sends of the clients it hosts; :meth:`Network.gather_ledger`
    combines the ranks' ledgers on rank 0.
    """

    def __init__(self, n_clients: int):
        self.n_clients = n_clients
        self.clients: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(n_clients, np.int64))
        self.server: dict[str, int] = defaultdict(int)

    def add(self, client: int, phase: str, nbytes: int) -> None:
        self.clients[phase][client] += nbytes

    def add_many(self, clients: np.ndarray, phase: str, nbytes: np.ndarray) -> None:
        """:meth:`add` for distinct ``clients`` at once, ``nbytes[k]`` for ``clients[k]``."""
        self.clients[phase][clients] += nbytes

    def add_server(self, phase: str, nbytes: int) -> None:
        self.server[phase] += nbytes

    def client_bytes(self, include_side_channels: bool = False) -> np.ndarray:
        """Bytes per client summed over phases (protocol phases only unless asked)."""
        total = np.zeros(self.n_clients, np.int64)
        for phase, counts in self.clients.items():
            if include_side_channels or phase not in SIDE_CHANNELS:
                total += counts
        return total

    def phase_bytes(self, phase: str) -> np.ndarray:
        """Bytes per client sent in one phase (zeros if nothing was)."""
        return self.clients[phase].copy() if phase in self.clients else np.zeros(self.n_clients, np.int64)

    def server_bytes(self) -> int:
        return int(sum(v for k, v in self.server.items() if k not in SIDE_CHANNELS))

    def reset(self) -> None:
        self.clients.clear()
        self.server.clear()


class SubLedger(Ledger):
    """The ledger of a network over some clients (:meth:`Network.over`): its client ``j`` is client
    ``ids[j]`` of the ledger ``parent``, which books every byte."""

    def __init__(self, parent: Ledger, ids: np.ndarray):
        super().__init__(len(ids))
        self.parent, self.ids = parent, ids

    def add(self, client: int, phase: str, nbytes: int) -> None:
        self.parent.add(int(self.ids[client]), phase, nbytes)

    def add_many(self, clients: np.ndarray, phase: str, nbytes: np.ndarray) -> None:
        self.parent.add_many(self.ids[clients], phase, nbytes)

    def add_server(self, phase: str, nbytes: int) -> None:
        self.parent.add_server(phase, nbytes)


def add(mine, incoming) -> None:
    """``mine += incoming`` (arrays of one kind): the ring's sum, a ``combine`` that
    :meth:`Network.ring_step` applies to all of a step's hops within a rank at once."""
    mine += incoming


def pageable(nbytes: int) -> np.ndarray:
    """A host buffer of ``nbytes`` bytes in ordinary (pageable) memory: numpy's."""
    return np.empty(nbytes, np.uint8)


class Transfers:
    """How device arrays cross ranks: a network's reused buffers and its device's hooks, shared with
    its sub-networks (:meth:`Network.over`), whose messages never overlap its own.

    Parameters
    ----------
    host_buffer : callable, optional
        ``nbytes -> uint8 numpy array``: allocates the host buffers that device chunks are sent from
        and received into (pinned memory on a GPU, :func:`fedring.train.device.pinned`); default
        :func:`pageable`. Host arrays never use it.
    synchronize : callable, optional
        Waits for the work queued on the device, before MPI reads or writes device memory (on the
        direct path only: the copies to and from host buffers wait by themselves); default: nothing
        to wait for.
    direct : bool, optional
        Whether MPI moves device memory itself; default :func:`device_mpi`.
    """

    def __init__(
        self,
        host_buffer: Callable[[int], np.ndarray] | None = None,
        synchronize: Callable[[], None] | None = None,
        direct: bool | None = None,
    ):
        self.host_buffer = pageable if host_buffer is None else host_buffer
        self.synchronize = synchronize
        self.direct = device_mpi() if direct is None else direct
        self._send = self._recv = np.empty(0, np.uint8)
        self._device: Any = None

    def _grown(self, kept: np.ndarray, nbytes: int) -> np.ndarray:
        """``kept``, or a new host buffer when it holds fewer than ``nbytes`` bytes."""
        return kept if kept.nbytes >= nbytes else self.host_buffer(nbytes)

    def send_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A host buffer of ``count`` elements of ``dtype`` to send from, valid until the next call."""
        self._send = self._grown(self._send, count * dtype.itemsize)
        return self._send[: count * dtype.itemsize].view(dtype)

    def recv_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A host buffer of ``count`` elements of ``dtype`` to receive into, valid until the next call."""
        self._recv = self._grown(self._recv, count * dtype.itemsize)
        return self._recv[: count * dtype.itemsize].view(dtype)

    def device_buffer(self, like_array, count: int):
        """A flat device array of ``count`` elements of the dtype of ``like_array``, on its device, to
        receive into on the direct path; valid until the next call."""
        kept = self._device
        if (
            kept is None
            or kept.dtype != like_array.dtype
            or device(kept) != device(like_array)
            or kept.shape[0] < count
        ):
            xp = array_namespace(like_array)
            kept = self._device = xp.empty((count,), dtype=like_array.dtype, device=device(like_array))
        return kept[:count]

    def ready(self) -> None:
        """Before MPI touches device memory: wait for the device's queued work."""
        if self.synchronize is not None:
            self.synchronize()


#: communicators over subsets of the ranks that a :class:`Network` keeps (:meth:`Network.over`)
MAX_SUBSETS = 32


def _timed(method):
    """Add the seconds spent in ``method`` to ``self.timer`` when it is a number (None: untimed)."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self.timer is None:
            return method(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.timer += time.perf_counter() - start

    return timed


class Network:
    """Moves rows between logical clients and records them in a :class:`Ledger`: numpy arrays, or
    device arrays whose chunks cross ranks through host buffers or, on the direct path, as they are
    (module docstring; ``transfers``: :class:`Transfers`, shared with the sub-networks of :meth:`over`).

    Uses a private duplicate of the layout's communicator, so fedring's messages can never
    match a user's. ``wait`` and ``segment`` set how it waits for messages and how it cuts ring
    chunks (:func:`wait_policy`, :func:`segment_bytes`); neither changes a result or a byte count.

    ``timer``: None (the default), or seconds to which every exchange (:meth:`ring_step`, the
    server's gather, broadcast and scatter) adds its wall time, whole: its messages, the waits
    for peers, its checks, and the arithmetic done while the messages travel (a ring's sums).
    """

    def __init__(
        self,
        layout: Layout,
        ledger: Ledger | None = None,
        wait: str | None = None,
        segment: int | None = None,
        comm: MPI.Comm | None = None,
        transfers: Transfers | None = None,
    ):
        self.layout = layout
        self.ledger = Ledger(layout.n_clients) if ledger is None else ledger
        self.wait, self.segment = wait_policy(wait), segment_bytes(segment)
        self.transfers = Transfers() if transfers is None else transfers
        self.comm = layout.comm.Dup() if comm is None else comm  # ``comm``: private already
        self.timer: float | None = None
        self._subsets: dict[tuple[int, ...], MPI.Comm] = {}

    def over(self, clients: np.ndarray) -> Network | None:
        """A network whose ``m`` clients are the sorted ids ``clients``: its client ``j`` is client
        ``clients[j]``, on the rank that hosts it, and its bytes are booked in this network's ledger.
        Ranks that host none of them get None and take no part in its messages; with every client
        it is this network.

        Collective over every rank the first time a set of hosting ranks comes up (an MPI
        ``Comm.Split`` of this network's communicator, kept for later rounds; the
        :data:`MAX_SUBSETS` most recent sets are kept); every rank must call it with the same ``clients``.
        """
        lay = self.layout
        if len(clients) == lay.n_clients:  # every client: this network itself (its ledger, timer, buffers)
            return self
        counts = np.diff(np.searchsorted(clients, lay.bounds))
        ranks = tuple(int(r) for r in np.flatnonzero(counts))
        if len(ranks) == lay.size:
            comm = self.comm
        elif ranks in self._subsets:
            comm = self._subsets[ranks]
        else:
            if len(self._subsets) == MAX_SUBSETS:  # the same on every rank: the oldest set goes
                oldest = self._subsets.pop(next(iter(self._subsets)))
                if oldest != MPI.COMM_NULL:
                    oldest.Free()
            comm = self.comm.Split(0 if counts[lay.rank] else MPI.UNDEFINED, lay.rank)
            self._subsets[ranks] = comm
        if not counts[lay.rank]:
            return None
        bounds = np.concatenate([[0], np.cumsum(counts[list(ranks)])])
        sub = Layout(len(clients), comm, bounds)
        return Network(sub, SubLedger(self.ledger, clients), self.wait, self.segment, comm, self.transfers)

    def complete(self, requests: list[MPI.Request]) -> None:
        """Wait for ``requests`` under the wait policy."""
        if self.wait == "spin":
            MPI.Request.Waitall(requests)
            return
        pause = 1e-5
        while not MPI.Request.Testall(requests):
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE)

    def _cuts(self, size: int, itemsize: int) -> list[slice]:
        """The segments of a buffer of ``size`` items (at least one, maybe empty): sender and
        receiver cut a message alike."""
        per = max(1, self.segment // itemsize) if self.segment else max(1, size)
        return [slice(s, s + per) for s in range(0, max(size, 1), per)]

    def _isend(self, buf, dest: int) -> list[MPI.Request]:
        """Post the sends of ``buf`` (a numpy array, or a device array on the direct path) in segments."""
        flat = buf.reshape(-1)
        return [self.comm.Isend(flat[c], dest=dest) for c in self._cuts(flat.shape[0], host_dtype(flat).itemsize)]

    def _irecv(self, buf, source: int) -> list[MPI.Request]:
        """Post the receives into ``buf`` (a numpy array, or a device array on the direct path) in segments."""
        flat = buf.reshape(-1)
        return [self.comm.Irecv(flat[c], source=source) for c in self._cuts(flat.shape[0], host_dtype(flat).itemsize)]

    def _send(self, x, dests: Iterable[int]) -> list[MPI.Request]:
        """Post the sends of ``x`` (either kind, C-contiguous) to each rank of ``dests``, in segments.

        A host array's segments go as they are, and so do a device array's on the direct path. Else
        each segment of a device array is copied into the reused host send buffer and its sends are
        posted at once, so that the copy of the next segment overlaps its transfer. The buffer stays
        valid until the next call: complete the requests before then."""
        dests = list(dests)
        if dests and device_array(x) and self.transfers.direct:
            self.transfers.ready()
        return self._post(x, dests)

    def _post(self, x, dests: list[int]) -> list[MPI.Request]:
        """:meth:`_send` once the device is ready."""
        if not (dests and device_array(x) and not self.transfers.direct):
            x = x if device_array(x) else np.ascontiguousarray(x)
            return [q for r in dests for q in self._isend(x, r)]
        flat = x.reshape(-1)
        count, dtype = flat.shape[0], host_dtype(x)
        out = self.transfers.send_buffer(dtype, count)
        requests: list[MPI.Request] = []
        for c in self._cuts(count, dtype.itemsize):
            host_into(flat[c], out[c])
            requests += [self.comm.Isend(out[c], dest=r) for r in dests]
            MPI.Request.Testall(requests)  # MPI moves this segment while the next one is copied
        return requests

    def _exchange(
        self,
        outgoing,
        incoming,
        arrived: Callable[[slice], None] | None = None,
        work: Iterable[Callable[[], None]] = (),
    ) -> None:
        """Send ``outgoing`` to the next rank while ``incoming`` comes from the previous one, in
        segments. While they travel: the pieces of ``work``, each followed by a test of the
        messages (MPI moves bytes only when called); then ``arrived(seg)`` on each received
        segment while later ones are still on the wire. Both sides cut a chunk alike: ranks
        exchange chunks of the same size.

        ``outgoing`` and ``incoming`` are flat: numpy arrays, a device array to send (:meth:`_send`),
        or both device arrays on the direct path."""
        lay = self.layout
        if self.transfers.direct and (device_array(incoming) or device_array(outgoing)):
            self.transfers.ready()  # before MPI writes device memory that queued work may still use
        cuts = self._cuts(math.prod(incoming.shape), host_dtype(incoming).itemsize)
        recvs = [self.comm.Irecv(incoming[c], source=(lay.rank - 1) % lay.size) for c in cuts]
        sends = self._post(outgoing, [(lay.rank + 1) % lay.size])
        for piece in work:
            piece()
            MPI.Request.Testall(recvs + sends)
        if arrived is None:
            self.complete(recvs + sends)
            return
        for cut, request in zip(cuts, recvs):
            self.complete([request])
            arrived(cut)
        self.complete(sends)

    @property
    def n_clients(self) -> int:
        return self.layout.n_clients

    def agree(self, problem: str | None, same: dict[str, int | None] | None = None) -> None:
        """Collective: raise ``ValueError`` on every rank if any rank found a ``problem``
        (the lowest such rank's message), or if a value in ``same`` differs between the ranks
        that have one (None: nothing to compare on this rank). One small all-reduce."""
        big = np.iinfo(np.int64).max
        same = same or {}
        values = [big if v is None else v for v in same.values()] + [big if v is None else -v for v in same.values()]
        failed, agreed = first_problem(self.comm, problem if problem else None, values)
        if failed is not None:
            raise ValueError(f"rank {failed[0]}: {failed[1]}")
        k = len(same)
        for name, lo, minus_hi in zip(same, agreed[:k], agreed[k:]):
            if lo != big and lo != -minus_hi:
                raise ValueError(
                    f"{name} differs between ranks ({lo} and {-minus_hi}): it must be the same on every rank"
                )

    def check_rows(self, rows, count: int | None = None, what: str = "rows") -> None:
        """Collective: every rank checks its client rows before the first message is sent.

        ``rows`` must be a C-contiguous numeric array (numpy, or a device array) with one row per
        client this rank sends for (``count``, default: the clients it hosts), of the same dtype and
        row size on every rank. A problem on any rank raises ``ValueError`` on every rank (naming the
        rank), instead of one rank raising while its peers wait for its message forever.
        """
        count = self.layout.n_local if count is None else count
        problem = None
        if not (on_host(rows) or device_array(rows)):
            problem = f"{what} must be a numpy array or a device array, got {type(rows).__name__}"
        elif rows.ndim < 1 or rows.shape[0] != count:
            got = "a scalar" if rows.ndim < 1 else f"{rows.shape[0]} rows"
            problem = f"{what} has {got}; it needs one row for each of the {count} clients this rank sends for"
        elif not contiguous(rows):
            strides = rows.strides if on_host(rows) else rows.stride()
            problem = f"{what} must be C-contiguous (numpy.ascontiguousarray), got strides {strides}"
        elif host_dtype(rows).kind not in "biuf":
            problem = f"{what} must be numeric, got dtype {rows.dtype}"
        ok = problem is None and count > 0
        dtype = host_dtype(rows) if ok else None
        self.agree(
            problem,
            {
                f"the dtype size of {what}": dtype.itemsize if dtype is not None else None,
                f"the dtype kind of {what}": ord(dtype.kind) if dtype is not None else None,
                f"the row size of {what}": math.prod(rows.shape[1:]) if ok else None,
            },
        )

    def _recv_buffer(self, kind, count: int) -> np.ndarray:
        """A host buffer of ``count`` elements of the dtype of the array ``kind`` (either kind), reused."""
        return self.transfers.recv_buffer(host_dtype(kind), count)

    @_timed
    def ring_step(
        self,
        rows,
        bounds: np.ndarray,
        chunk_of: Callable[[int], int],
        combine: Callable | None,
        phase: str,
        ahead: Callable[[int, int], Iterable[Callable[[], None]]] | None = None,
    ) -> None:
        """One synchronous step of a ring protocol over all clients.

        Every client ``i`` sends chunk ``chunk_of(i)`` of its row to client ``i + 1 (mod n)``,
        which either combines it into its own copy of that chunk (``combine(mine, incoming)``,
        in place) or, when ``combine`` is None, overwrites its copy.

        ``rows`` holds the rows of this rank's clients (numpy, or a device array: then the chunk
        that leaves the rank is copied into a host buffer segment by segment, the one that arrives
        is copied from one to the device before ``combine``; on the direct path both stay in device
        memory), ``bounds`` the chunk offsets. The chunk a client sends is
        never the chunk it receives in the same step, so hops can be applied one after the other in
        place, or all at once: with :func:`add` or None and no ``ahead``, the hops within this rank
        are a few strided array operations (:meth:`_local_hops`), for which ``chunk_of`` is called
        with an array of client ids (it maps them elementwise, as
        :func:`fedring.comm.ring.rotation` does). A protocol checks its rows once, with
        :meth:`check_rows`, before its first step.
        """
        lay, n = self.layout, self.n_clients
        if n == 1:
            return

        def chunk(row: int, c: int):
            return rows[row, bounds[c] : bounds[c + 1]]

        def deliver(dst, payload) -> None:
            if combine is None:
                dst[...] = payload
            else:
                combine(dst, payload)

        first, last = lay.lo, lay.hi - 1
        if lay.size > 1:
            outgoing = chunk(last - lay.lo, chunk_of(last))
            c_in = chunk_of((first - 1) % n)
            mine = chunk(0, c_in)
            work = ahead(0, c_in) if ahead else ()
            count = math.prod(mine.shape)
            if not (on_host(rows) or self.transfers.direct):  # host buffers, each segment to the device on arrival
                incoming = self._recv_buffer(rows, count)
                self._exchange(outgoing, incoming, lambda seg: deliver(mine[seg], like(incoming[seg], rows)), work)
            elif combine is None:  # straight into place: the chunk sent is never the one received
                self._exchange(outgoing, mine, work=work)
            else:
                incoming = (
                    self._recv_buffer(rows, count) if on_host(rows) else self.transfers.device_buffer(rows, count)
                )
                self._exchange(outgoing, incoming, lambda seg: combine(mine[seg], incoming[seg]), work)
            self.ledger.add(last, phase, nbytes(outgoing))
        if ahead is None and (combine is None or combine is add):
            self._local_hops(rows, bounds, chunk_of, combine is add, phase)
            return
        for i in range(first, last + (lay.size == 1)):
            j = (i + 1) % n
            for piece in ahead(j - first, chunk_of(i)) if ahead else ():
                piece()
            payload = chunk(i - first, chunk_of(i))
            deliver(chunk(j - first, chunk_of(i)), payload)
            self.ledger.add(i, phase, nbytes(payload))

    def _local_hops(self, rows, bounds: np.ndarray, chunk_of: Callable, summing: bool, phase: str) -> None:
        """The hops of :meth:`ring_step` between clients of this rank, one strided operation per run
        of hops that move adjacent chunks of one size along consecutive rows (:func:`hop_runs`: a
        handful for a rotation over ``array_split`` bounds) instead of one per hop, for speed. Each
        element gets the same operation on the same operands as in the loop: the same bits. The
        runs are views (:func:`fedring.arrays.strided`) of the buffer of ``rows`` (C-contiguous, as
        :meth:`check_rows` requires), on the rows' device."""
        lay, n = self.layout, self.n_clients
        senders = np.arange(lay.lo, lay.hi - (lay.size > 1))
        if not len(senders):
            return
        d = rows.shape[1]
        chunks = np.asarray(chunk_of(senders), np.int64)
        runs, sizes = hop_runs(n, lay.lo, chunks.tobytes(), np.asarray(bounds, np.int64).tobytes(), d)
        for count, size, to, start in runs:
            mine = strided(rows, (count, size), to, (d + size, 1))  # the next row's next chunk
            theirs = strided(rows, (count, size), start, (d + size, 1))
            if summing:
                mine += theirs
            else:
                mine[...] = theirs
        self.ledger.add_many(senders, phase, sizes * host_dtype(rows).itemsize)

    @_timed
    def reduce_owned(self, rows, bounds: np.ndarray, runs: Iterable[tuple[int, int, int]], phase: str) -> None:
        """The reduce-scatter of :mod:`fedring.comm.ring` on a rank that hosts every client, in place:
        afterwards client ``i`` holds the ring sum of chunk ``(i + 1) mod n`` (``runs``:
        :func:`fedring.comm.ring.owned_runs`).

        The ring's ``n - 1`` steps add each chunk row after row, starting at the row of its index:
        chunk ``c`` sums rows ``c, c + 1, ..., c - 1 (mod n)`` in that order. On one rank the same
        additions, in the same order on the same operands, run for every chunk at once: for rows
        whose padded copy takes up to :data:`PADDED_BYTES`, one addition a step over that copy
        (:func:`padded_sums`); for larger ones, into one d-vector, a few column runs a step
        (:func:`planned_sums`), with no copy. The sums are then copied to their owners: the same bits
        either way. The rows' other chunks are left as they were, not with the ring's partial sums
        (the ring's contract names only the owned chunks). The ledger books each client's bytes of
        the ``n - 1`` steps: every chunk but ``(i + 1) mod n``."""
        if not self._at_once("reduce_owned", "reduce_scatter"):
            return
        n, d = self.n_clients, rows.shape[1]
        key = np.asarray(bounds, np.int64).tobytes()
        width, chunk_runs = size_runs(key)
        copy_bytes = (2 * n - 1) * n * width * host_dtype(rows).itemsize
        padded = copy_bytes <= PADDED_BYTES["host" if str(device(rows)) == "cpu" else "device"]
        if padded:  # chunk c in row c of an (n, width) array
            sums = padded_sums(rows, width, chunk_runs)
        else:  # chunk c in place in a d-vector
            sums = planned_sums(rows, sum_plan(n, key, d))
        for k, c, m in runs:
            size, start = int(bounds[c + 1] - bounds[c]), int(bounds[c])
            at, step = (c * width, width) if padded else (start, size)
            strided(rows, (m, size), k * d + start, (d + size, 1))[...] = strided(sums, (m, size), at, (step, 1))
        self._book_steps(rows, bounds, phase, unsent=1)

    @_timed
    def spread_owned(self, rows, bounds: np.ndarray, runs: Iterable[tuple[int, int, int]], phase: str) -> None:
        """The all-gather of :mod:`fedring.comm.ring` on a rank that hosts every client, in place:
        client ``i`` owns chunk ``(i + 1) mod n`` (``runs``: :func:`fedring.comm.ring.owned_runs`), and
        afterwards every row holds every owner's chunk.

        The ring's ``n - 1`` steps would copy each chunk from row to row; on one rank the result is
        the same copies of the same values done at once: the owned chunks into row 0 (one strided
        copy per run), then row 0 into every other row. The ledger books each client's bytes of the
        ``n - 1`` steps: every chunk but ``(i + 2) mod n``."""
        if not self._at_once("spread_owned", "all_gather"):
            return
        d = rows.shape[1]
        for k, c, m in runs:
            if k == 0:  # row 0's own chunk is in place already
                k, c, m = 1, c + 1, m - 1
            if m:
                size, start = int(bounds[c + 1] - bounds[c]), int(bounds[c])
                strided(rows, (m, size), start, (size, 1))[...] = strided(rows, (m, size), k * d + start, (d + size, 1))
        rows[1:] = rows[0]
        self._book_steps(rows, bounds, phase, unsent=2)

    def _at_once(self, name: str, phase: str) -> bool:
        """Whether a ring phase done at once (``name``) has work: none with one client; a
        ``ValueError`` unless every client is on this rank (the phase's steps serve that case)."""
        if self.layout.size != 1:
            raise ValueError(f"{name} needs every client on this rank; the ring's {phase} steps otherwise")
        return self.n_clients > 1

    def _book_steps(self, rows, bounds: np.ndarray, phase: str, unsent: int) -> None:
        """The ledger of a ring phase's ``n - 1`` steps done at once: client ``i`` sent every chunk of
        its row but chunk ``(i + unsent) mod n``."""
        sizes = np.diff(bounds)
        nbytes = (rows.shape[1] - np.roll(sizes, -unsent)) * host_dtype(rows).itemsize
        self.ledger.add_many(np.arange(self.n_clients), phase, nbytes)

    @_timed
    def gather_to_server(self, local, phase: str, clients: np.ndarray | None = None):
        """Every client, or each client in the sorted ids ``clients``, sends its row to the server
        (rank 0): ``local`` holds this rank's rows of those clients, in client order. Returns
        ``(m, ...)`` on rank 0 in client order, None elsewhere.

        ``local`` may be a device array: the other ranks send it through host buffers (or as it is, on
        the direct path), and rank 0 stacks the rows on its device (its own rows themselves when no
        other rank sends), each segment as it arrives."""
        lay = self.layout
        local = np.ascontiguousarray(local) if not device_array(local) else local
        if clients is None:
            mine, counts = np.arange(lay.lo, lay.hi), np.diff(lay.bounds)
        else:
            seg = np.searchsorted(clients, lay.bounds)
            mine, counts = clients[seg[lay.rank] : seg[lay.rank + 1]], np.diff(seg)
        self.check_rows(local, count=len(mine))
        row_bytes = math.prod(local.shape[1:]) * host_dtype(local).itemsize
        for client in mine:
            self.ledger.add(int(client), phase, row_bytes)
        if lay.rank != 0:
            if len(mine):
                self.complete(self._send(local, [0]))
            return None
        offsets = np.concatenate([[0], np.cumsum(counts)])
        if on_host(local):
            out = np.empty((int(offsets[-1]), *local.shape[1:]), local.dtype)
            out[: len(mine)] = local
            self.complete(
                [q for r in range(1, lay.size) if counts[r] for q in self._irecv(out[offsets[r] : offsets[r + 1]], r)]
            )
            return out
        if offsets[-1] == len(mine):  # nothing to receive: the server's own rows, where they are
            return local
        # the stacked rows on the device, once; each rank's block straight into place on the direct
        # path, else through the reused host receive buffer, each segment to the device as it arrives
        xp = array_namespace(local)
        stacked = xp.empty((int(offsets[-1]), *local.shape[1:]), dtype=local.dtype, device=device(local))
        stacked[: len(mine), ...] = local
        flat, row = stacked.reshape(-1), math.prod(local.shape[1:])
        for r in range(1, lay.size):
            if counts[r]:
                self._receive_into(flat[int(offsets[r]) * row : int(offsets[r + 1]) * row], r)
        return stacked

    def _receive_into(self, dst, source: int) -> None:
        """Receive the flat device array ``dst`` from ``source``, in segments: straight into it on the
        direct path, else through the reused host receive buffer, each segment copied to the device as
        it arrives while the next ones travel."""
        if self.transfers.direct:
            self.transfers.ready()
            self.complete(self._irecv(dst, source))
            return
        block = self._recv_buffer(dst, dst.shape[0])
        cuts = self._cuts(block.size, block.itemsize)
        for cut, request in zip(cuts, [self.comm.Irecv(block[c], source=source) for c in cuts]):
            self.complete([request])
            dst[cut] = like(block[cut], dst)

    def gather_blocks(self, local, phase: str) -> Iterator[tuple[int, Any]]:
        """Every client sends its row to the server (rank 0), one rank's rows at a time: rank 0
        yields ``(first client id, that rank's rows)`` in rank order, receiving every block
        into one buffer (the caller copies what it keeps, e.g. cast to float64, and never holds
        the whole ``(n, ...)`` array besides); every rank must run the loop to its end, the
        others yield nothing. With device rows ``local``, rank 0's own block is ``local`` itself and
        the others' are host buffers (the other ranks send host copies)."""
        lay = self.layout
        local = np.ascontiguousarray(local) if not device_array(local) else local
        self.check_rows(local, count=lay.hi - lay.lo)
        row_bytes = math.prod(local.shape[1:]) * host_dtype(local).itemsize
        for k in range(len(local)):
            self.ledger.add(lay.lo + k, phase, row_bytes)
        if lay.rank != 0:
            if len(local):
                self.complete(self._send(local, [0]))
            return
        yield lay.lo, local
        counts = np.diff(lay.bounds)
        buffer = np.empty((int(counts[1:].max(initial=0)), *local.shape[1:]), host_dtype(local))
        for r in range(1, lay.size):
            block = buffer[: counts[r]]
            self.complete(self._irecv(block, r))
            yield int(lay.bounds[r]), block

    @_timed
    def broadcast_from_server(self, vec: Any, phase: str, shape, dtype, receivers: int | None = None, ref=None):
        """The server (rank 0) sends ``vec`` to every client; returns it on every rank.

        Counted as ``n`` messages from the server, one per logical client (or ``receivers``
        messages, one per client of a round's cohort); physically one message per rank carries it.

        ``vec``: anything ``numpy.asarray`` takes, or a device array (its host copy travels). The result
        is a numpy array, or with ``ref`` an array of the kind and device of ``ref`` (rank 0's ``vec``
        itself when it is one already, of ``dtype``). A C-contiguous device ``vec`` of ``dtype`` with a
        device ``ref`` crosses ranks as the server's gather does (:meth:`_send`, :meth:`_receive_into`).
        """
        lay = self.layout
        problem = None
        if lay.rank == 0:
            size = "no" if vec is None else math.prod(vec.shape) if device_array(vec) else np.size(vec)
            if size != np.prod(shape, dtype=np.int64):
                problem = f"the server's vector has {size} values, the clients expect shape {tuple(shape)}"
        self.agree(problem)
        messages = self.n_clients if receivers is None else receivers
        if lay.rank == 0:
            kept = ref is not None and device_array(vec) and host_dtype(vec) == np.dtype(dtype)
            if kept and (lay.size == 1 or contiguous(vec)):  # from its device; with one rank nothing to send
                self.ledger.add_server(phase, nbytes(vec) * messages)
                self.complete(self._send(vec, range(1, lay.size)))
                return array_namespace(vec).reshape(vec, tuple(shape))
            out = np.ascontiguousarray(host(vec) if device_array(vec) else vec, dtype=dtype).reshape(shape)
            self.ledger.add_server(phase, out.nbytes * messages)
            self.complete([q for r in range(1, lay.size) for q in self._isend(out, r)])
            if kept:
                return array_namespace(vec).reshape(vec, tuple(shape))
            return out if ref is None else like(out, ref)
        if ref is not None and device_array(ref):
            xp = array_namespace(ref)
            received = xp.empty(tuple(shape), dtype=getattr(xp, np.dtype(dtype).name), device=device(ref))
            self._receive_into(received.reshape(-1), 0)
            return received
        out = np.empty(shape, dtype)
        self.complete(self._irecv(out, 0))
        return out if ref is None else like(out, ref)

    @_timed
    def scatter_from_server(self, rows, clients: np.ndarray, phase: str, shape, dtype, ref=None):
        """The server sends row ``j`` of ``rows`` to client ``clients[j]`` (sorted ids).

        Returns, on every rank, the rows addressed to the clients it hosts, in client order: numpy
        arrays, or with ``ref`` arrays of the kind and device of ``ref``. ``rows`` may be a device
        array: its host copy travels (a few rows: the adversary's side channel).
        """
        lay = self.layout
        owners = lay.owner(clients)
        mine = np.flatnonzero(owners == lay.rank)
        problem = None
        got = None if rows is None else tuple(rows.shape) if device_array(rows) else np.shape(rows)
        if lay.rank == 0 and got != (len(clients), *shape):
            problem = f"the server has rows of shape {got} for {len(clients)} clients of shape {tuple(shape)}"
        self.agree(problem)
        if lay.rank == 0:
            rows = np.ascontiguousarray(host(rows) if device_array(rows) else rows, dtype=dtype)
            self.ledger.add_server(phase, rows.nbytes)
            requests = []
            for r in range(1, lay.size):
                theirs = np.flatnonzero(owners == r)
                if len(theirs):
                    requests += self._isend(np.ascontiguousarray(rows[theirs]), r)
            self.complete(requests)
            return rows[mine] if ref is None else like(rows[mine], ref)
        out = np.empty((len(mine), *shape), dtype)
        if len(mine):
            self.complete(self._irecv(out, 0))
        return out if ref is None else like(out, ref)

    def sum_to_server(self, values: np.ndarray) -> np.ndarray | None:
        """A measurement, not a message: the sum over ranks of ``values`` on rank 0 (None elsewhere).

        With per-client arrays in which each rank fills its own clients' entries and leaves
        zeros elsewhere, the sum is exact: every entry comes from one rank. Never counted in
        the ledger."""
        values = np.ascontiguousarray(values)
        total = np.zeros_like(values) if self.layout.rank == 0 else None
        self.comm.Reduce(values, total, op=MPI.SUM, root=0)
        return total

    def gather_ledger(self) -> tuple[np.ndarray | None, int]:
        """Per-client protocol bytes of all clients and the server's bytes, on rank 0 (None elsewhere)."""
        return self.sum_to_server(self.ledger.client_bytes()), self.ledger.server_bytes()
