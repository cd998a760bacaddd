"""BRACE: Byzantine-robust ring-all-reduce, and the sign-voting family over the same ring.

Fang, Liu, Zhao, Liu, *Byzantine-Robust Federated Learning over Ring-All-Reduce
Distributed Computing*, WWW Companion '25, doi:10.1145/3701716.3715491; docs/brace.md maps the
paper onto this module. Every round the ``n`` clients of the logical ring run four phases (paper §3):

I.   Quantization (local): ``q_i = sign(g_i)``, element-wise, in {-1, 0, +1}.
II.  Share-Reduce: the ring reduce-scatter of :mod:`fedring.comm.ring` on the ``q_i``; client ``i``
     ends holding chunk ``(i + 1) mod n`` of ``S = sum_i q_i``.
III. Consensus (local): the owner of each chunk maps its counts to the aggregate, eq. (1)-(3)
     ``GAR[k] = +1 if S[k] > lambda else -1`` (``= 2 I_t[k, k] - 1``).
IV.  Share-Only: the ring all-gather of the consensus values.

Every client then applies eq. (4), ``w <- w - eta * GAR``: no ``1/n`` factor, every
coordinate moves by exactly ``eta``.

signSGD with majority vote (Bernstein et al. 2019) and sign-aggregated RLR (Ozdayi et al.
2021) run the same phases I, II and IV; only the consensus map of phase III differs. The paper
(§5.2) says both adapt to the ring at BRACE's cost; the sign-aggregated forms used here are the
ones that fit it. :class:`SignRule` implements the phases once; :class:`Brace`,
:class:`SignSGD` and :class:`RLR` are its consensus maps.

Wire encodings (cheaper than the paper's accounting, which charges ``m = 32`` bits per count
and 1 bit per consensus value, ``d (n - 1)(m + 1) / n`` bits per client):

- Share-Reduce sends the partial counts in the narrowest signed integer type holding
  ``+-n``: int8 up to ``n = 127``, int16 up to 32767.
- Share-Only sends the consensus packed per chunk (``np.packbits``, each chunk starting on a
  byte boundary): 1 bit per coordinate for BRACE's two-valued rule; two bit planes (nonzero,
  positive) for the three-valued maps (``brace.rule=symmetric``, signSGD, RLR).

So with BRACE for ``n <= 127`` client ``i`` sends ``d - |C_{i+1}|`` bytes plus
``sum_{c != i+2} ceil(|C_c| / 8)`` bytes per round, at most ``d (n-1)/n * 9/8`` plus ``n - 1``
bytes of chunk rounding: 7.1x fewer than the float32 ring, 3.7x fewer than the paper's formula
(m = 32). The three-valued maps send two planes: ``d (n-1)/n * 10/8`` plus ``2 (n - 1)``.

Beyond the paper (its threat model has every client run the protocol faithfully, §3), two
relay attacks and a check, all off by default:

- ``relay_attack=bias``: a Byzantine relay adds ``relay_bias`` to every partial count it
  forwards in Share-Reduce (several relays on a chunk's path each add it).
- ``relay_attack=flip``: a Byzantine relay flips the consensus signs it forwards in
  Share-Only, each with probability ``relay_flip_prob``. The relays collude so that flips do
  not cancel: only the first Byzantine relay on a chunk's path (its owner included) flips,
  later ones forward what they got. Honest clients downstream of it then hold a different
  update than the rest: the ring no longer keeps the replicas identical. The vector returned
  (and so the one model the run trains and evaluates) is the view of the honest client with
  the lowest id.
- ``check=on``: the integrity check on Share-Reduce. A partial count that ``k`` clients have
  contributed to lies in ``[-k, k]``, and when ``sign_zero`` is +-1 (no client abstains) it
  has the parity of ``k``. The receiver tests every incoming count; a count out of range or of
  the wrong parity convicts the hop it came over (the sender ``j - 1``), is counted in
  ``ring/detections`` and is replaced by the valid value nearest to 0 (0, or ``sign_zero``
  when ``k`` is odd): the tampered coordinate loses the votes of its upstream clients
  instead of carrying the bias.

  Only honest receivers check (a Byzantine receiver passes tampering on; the next honest
  receiver then convicts the Byzantine hop before it). An honest sender is never convicted:
  adding one vote to a valid count gives a valid count. What the check cannot catch: a
  tamper that keeps the count valid, i.e. within ``[-k, k]`` and, when parity is checked,
  an even change (with ``sign_zero = 0`` parity is not checked, so every in-range change
  passes). The change an honest receiver sees is the sum of the biases of the consecutive
  Byzantine relays before it, so two adjacent relays adding 1 each pass the parity test.
  Nor a tamper into a Byzantine chunk owner, nor any flip in Share-Only, whose one- or
  two-bit values carry no redundancy.

The check works the same for signSGD and RLR (same Share-Reduce). With the check or the bias
attack on, Share-Reduce runs hop by hop in Python (per step, per local client) instead of
through :func:`fedring.comm.ring.reduce_scatter`; the bytes are the same.

Saturation: the wire type stays narrow under attack. A relay's tampered count and every
honest addition after it are clipped to ``[-M, M]`` (``M`` = 127 for int8), as a fixed-width
wire format must (rather than widening the type, which would change the bytes measured);
honest traffic never reaches the clip since ``|S| <= n <= M``.

Where it runs: the rows may be numpy arrays or device arrays (torch tensors, docs/arrays.md).
Every phase runs on the rows' device, written once through their namespace where the array API
has the operations; the bit packing, which torch lacks, is numpy's ``packbits`` on the host and
:mod:`fedring.comm._brace_torch` (imported on the first tensor) on a device, the same bytes. On
numpy rows phase I is computed chunk by chunk while the partial counts into each chunk travel,
and row 0 decodes each chunk of phase IV while the next travels; on a device each is a few
passes over all rows. The bytes, the ledger and the update are the same bits either way: sign
voting is integer arithmetic.

sign(0), which the paper never defines: ``sign_zero`` (0 by default, as ``np.sign``) is the vote
of a coordinate that is exactly 0 (or not finite: NaN or an infinity). With 0 such a client
abstains; with +-1 every client votes, which is what makes the parity check possible.

The paper's Fig. 1 worked through: :class:`Brace`'s example.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from fedring.arrays import array_namespace, device, full, host, like, on_host, strided
from fedring.errors import ConfigError
from fedring.rng import Stream, generator
from fedring.validate import choice, integer, known_keys, real

from .network import Network, block_bounds, host_dtype
from .ring import (
    RING_RULES,
    Aggregation,
    RingRule,
    all_gather,
    owned_runs,
    reduce_scatter,
    rotation,
)

SIGN_RULES = ("brace", "signsgd", "rlr")
BRACE_RULES = ("paper", "symmetric")
RELAY_ATTACKS = ("none", "bias", "flip")
SHARE_REDUCE, SHARE_ONLY = "share_reduce", "share_only"
#: the keys of every sign rule's section (each rule adds its own)
COMMON_KEYS = ("sign_zero", "check", "relay_attack", "relay_bias", "relay_flip_prob", "relay_clients")


def paper_bytes(n: int, d: int, m: int = 32) -> float:
    """The paper's per-client BRACE cost (Table 1), ``d (n - 1)(m + 1) / n`` bits, in bytes.

    >>> paper_bytes(100, 139960)  # 4,572,493.2 bits
    571561.65
    """
    return d * (n - 1) * (m + 1) / n / 8


def count_dtype(n: int) -> np.dtype:
    """Narrowest signed integer type holding every count in ``[-n, n]``.

    >>> count_dtype(127), count_dtype(128)
    (dtype('int8'), dtype('int16'))
    """
    for dt in (np.int8, np.int16, np.int32, np.int64):
        if np.iinfo(dt).max >= n:
            return np.dtype(dt)
    raise ValueError(f"{n} clients do not fit an int64 count")


BLOCK = 1 << 16  # elements per pass: keeps the temporaries in cache
#: elements per pass on a device: bounds the temporaries, in a few kernel launches per row
DEVICE_BLOCK = 1 << 24


def xp_dtype(xp, dtype: DTypeLike):
    """The numpy dtype ``dtype`` (int8, uint8, float32, ...) in the namespace ``xp``."""
    return getattr(xp, np.dtype(dtype).name)


def quantize(grads, sign_zero: int, dtype: DTypeLike, out=None):
    """Phase I: element-wise sign in ``dtype``, with ``sign(0) = sign_zero``.

    A non-finite coordinate (NaN, +-inf: only a Byzantine client sends one) votes
    ``sign_zero`` too, so it weighs no more than an honest zero. ``grads`` may be a device
    array: the votes are then computed there, in ``dtype`` (:func:`xp_dtype`).

    >>> quantize(np.array([2.0, 0.0, -1.0, np.nan, np.inf, -np.inf]), 0, np.int8)
    array([ 1,  0, -1,  0,  0,  0], dtype=int8)
    """
    if not on_host(grads):
        return _quantize_device(grads, sign_zero, dtype, out)
    flat = np.ascontiguousarray(grads).reshape(-1)
    q = np.empty(flat.size, dtype) if out is None else out.reshape(-1)
    finite = np.empty(min(flat.size, BLOCK), bool)
    # int8 votes: the first comparison writes straight into the votes' bytes (a bool is the byte 0
    # or 1), and the rest is done in place there: no temporaries, a quarter less time
    other = np.empty(min(flat.size, BLOCK), bool) if q.dtype == np.int8 else None
    for s in range(0, flat.size, BLOCK):
        x, out = flat[s : s + BLOCK], q[s : s + BLOCK]
        if other is not None:
            if sign_zero == 0:
                np.greater(x, 0, out=out.view(bool))
                np.subtract(out, np.less(x, 0, out=other[: x.size]), out=out)
            elif sign_zero == 1:
                np.less(x, 0, out=out.view(bool))
                out *= -2
                out += 1
            else:
                np.greater(x, 0, out=out.view(bool))
                out *= 2
                out -= 1
        elif sign_zero == 0:
            np.subtract(x > 0, x < 0, dtype=dtype, out=out)
        elif sign_zero == 1:
            np.subtract(1, np.multiply(x < 0, 2, dtype=dtype), out=out)
        else:
            np.subtract(np.multiply(x > 0, 2, dtype=dtype), 1, out=out)
        ok = np.isfinite(x, out=finite[: x.size])  # half the time of a float sum; rarely false
        if not ok.all():
            out[~ok] = sign_zero
    return q.reshape(grads.shape)


def _quantize_device(grads, sign_zero: int, dtype: DTypeLike, out=None):
    """:func:`quantize` of a device array, through its namespace, :data:`DEVICE_BLOCK` elements a pass."""
    xp = array_namespace(grads)
    dt = xp_dtype(xp, dtype)
    q = xp.empty(tuple(grads.shape), dtype=dt, device=device(grads)) if out is None else out
    flat, votes = xp.reshape(grads, (-1,)), xp.reshape(q, (-1,))  # ``q`` is contiguous: a view
    abstain = full((), sign_zero, grads, dtype)  # a fill: a copy from host memory would wait for the device
    for s in range(0, flat.shape[0], DEVICE_BLOCK):
        x, v = flat[s : s + DEVICE_BLOCK], votes[s : s + DEVICE_BLOCK]
        if sign_zero == 0:
            v[...] = xp.astype(x > 0, dt) - xp.astype(x < 0, dt)
        elif sign_zero == 1:
            v[...] = 1 - 2 * xp.astype(x < 0, dt)
        else:
            v[...] = 2 * xp.astype(x > 0, dt) - 1
        v[...] = xp.where(xp.isfinite(x), v, abstain)  # no test: it would wait for the device
    return q


def packbits(bits):
    """``numpy.packbits(bits, axis=-1)`` on either kind: bools ``(..., s)`` -> uint8 ``(..., ceil(s / 8))``,
    most significant bit first, each row's last byte padded with zero bits.

    >>> packbits(np.array([True, False, True])).tolist()
    [160]
    """
    if on_host(bits):
        return np.packbits(bits, axis=-1)
    from . import _brace_torch

    return _brace_torch.packbits(bits)


def unpackbits(packed, count: int):
    """The inverse of :func:`packbits` on either kind: uint8 ``(..., b)`` -> the first ``count`` bools of each row.

    >>> unpackbits(np.array([160], np.uint8), 3).tolist()
    [True, False, True]
    """
    if on_host(packed):
        return np.unpackbits(packed, axis=-1, count=count).view(bool)
    from . import _brace_torch

    return _brace_torch.unpackbits(packed, count)


def count_true(mask) -> int:
    """The number of True entries of the bool array ``mask`` (either kind)."""
    if on_host(mask):
        return int(np.count_nonzero(mask))
    return int(array_namespace(mask).count_nonzero(mask))


class Packing:
    """Share-Only wire format: each chunk's consensus values packed on its own bytes.

    ``planes = 1`` encodes {-1, +1} as one bit per coordinate (1 = +1). ``planes = 2`` encodes
    {-1, 0, +1} as two bit planes per chunk, a "nonzero" plane then a "positive" plane.
    A chunk of ``s`` coordinates takes ``planes * ceil(s / 8)`` bytes; ``byte_bounds`` are
    the chunks' offsets in a packed row. Packed rows may be numpy arrays or device arrays (the
    same bytes: :func:`packbits`).
    """

    def __init__(self, bounds: np.ndarray, planes: int):
        self.bounds, self.planes = bounds, planes
        self.plane_bytes = -(-np.diff(bounds) // 8)
        self.byte_bounds = np.concatenate([[0], np.cumsum(planes * self.plane_bytes)])

    def encode(self, positive, nonzero):
        """The bytes of chunks of one size: bit planes ``(..., s)`` (either kind) -> ``(..., planes * ceil(s / 8))``."""
        if self.planes == 1:
            return packbits(positive)
        assert nonzero is not None, "two planes encode the zeros too"
        return array_namespace(positive).concat([packbits(nonzero), packbits(positive)], axis=-1)

    def signs(self, seg, c: int):
        """The "positive" plane of chunk ``c``'s bytes ``seg`` (a view: flipping it flips signs)."""
        return seg[int((self.planes - 1) * self.plane_bytes[c]) :]

    def nonzero(self, seg, c: int):
        """The "nonzero" plane of chunk ``c``'s bytes ``seg`` as bools, of the kind of ``seg``."""
        size = int(self.bounds[c + 1] - self.bounds[c])
        if self.planes == 1:
            xp = array_namespace(seg)
            return xp.ones(size, dtype=xp.bool, device=device(seg))
        return unpackbits(seg[: int(self.plane_bytes[c])], size)

    def counts(self, row: np.ndarray) -> tuple[int, int]:
        """The +1 and -1 entries of a packed host row's decoding, counted on its bits (a popcount of
        d/8 or d/4 bytes, where counting the decoded floats reads 4d): a sign bit counts where its
        chunk's "nonzero" bit is set (a flip relay may set it where the value is 0).

        >>> p = Packing(np.array([0, 3, 5]), 2)  # chunk 0: (+1, 0, -1); chunk 1: (0, +1), sign bit set under the 0
        >>> p.counts(np.array([0b10100000, 0b11000000, 0b01000000, 0b11000000], np.uint8))
        (2, 1)
        """
        b, pb, h = self.bounds, self.byte_bounds, self.plane_bytes
        if self.planes == 1:
            plus = int(np.bitwise_count(row).sum(dtype=np.int64))
            return plus, int(b[-1]) - plus
        nonzero = plus = 0
        for c in range(len(b) - 1):
            seg = row[pb[c] : pb[c + 1]]
            nz = seg[: h[c]]
            nonzero += int(np.bitwise_count(nz).sum(dtype=np.int64))
            plus += int(np.bitwise_count(nz & seg[h[c] :]).sum(dtype=np.int64))
        return plus, nonzero - plus

    def decode(self, row, out=None):
        """A packed row -> the consensus vector (float32, or into ``out``), on the row's device."""
        if not on_host(row):
            return self._decode_device(row, out)
        out = np.empty(int(self.bounds[-1]), np.float32) if out is None else out
        for c in range(len(self.bounds) - 1):
            for piece in self.pieces(row, out, c):
                piece()
        return out

    def _decode_device(self, row, out=None):
        """:meth:`decode` of a device row: the chunks of one size (``array_split`` bounds have at most two
        sizes) as one ``(chunks, planes, bytes)`` block each, a few kernel launches in all."""
        xp, where = array_namespace(row), device(row)
        b, pb = self.bounds, self.byte_bounds
        out = xp.empty(int(b[-1]), dtype=xp.float32, device=where) if out is None else out
        sizes = np.diff(b)
        edges = [0, *(np.flatnonzero(np.diff(sizes)) + 1).tolist(), len(sizes)]
        for lo, hi in itertools.pairwise(edges):
            size, width = int(sizes[lo]), int(self.plane_bytes[lo])
            if size == 0:
                continue
            bits = unpackbits(xp.reshape(row[int(pb[lo]) : int(pb[hi])], (hi - lo, self.planes, width)), size)
            values = 2 * xp.astype(bits[:, -1, :], xp.int8) - 1
            if self.planes == 2:
                values = values * xp.astype(bits[:, 0, :], xp.int8)  # in int8, as on the host: 0, never -0.0
            out[int(b[lo]) : int(b[hi])] = xp.reshape(xp.astype(values, xp.float32), (-1,))
        return out

    def pieces(self, row: np.ndarray, out: np.ndarray, c: int) -> list:
        """The decoding of chunk ``c`` of a packed row into ``out``, as callables of one block each."""
        b, pb, h = self.bounds, self.byte_bounds, self.plane_bytes
        seg, size = row[pb[c] : pb[c + 1]], int(b[c + 1] - b[c])
        signs = self.signs(seg, c)

        def block(s: int) -> None:  # BLOCK is a multiple of 8: s // 8 is a byte offset
            n = min(BLOCK, size - s)
            values = np.unpackbits(signs[s // 8 :], count=n).view(np.int8)
            values *= 2
            values -= 1
            if self.planes == 2:
                values *= np.unpackbits(seg[s // 8 : h[c]], count=n).view(np.int8)
            out[b[c] + s : b[c] + s + n] = values

        return [lambda s=s: block(s) for s in range(0, size, BLOCK)]


@dataclass
class RelayCounts:
    """What the integrity check and the relay attacks counted in one round (summed over ranks)."""

    detections: np.ndarray  # (n,): hops convicted, per accused sender
    flagged: int = 0  # partial counts the check replaced
    tampered_hops: int = 0  # hops a Byzantine relay tampered with (bias or flip)
    flipped_signs: int = 0  # consensus signs the flip relays flipped

    def summed(self, comm: MPI.Comm) -> RelayCounts:
        """Collective: the totals over every rank (each rank counts for its own clients)."""
        flat = np.concatenate([self.detections, [self.flagged, self.tampered_hops, self.flipped_signs]])
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        n = len(self.detections)
        return RelayCounts(flat[:n], *(int(v) for v in flat[n:]))


class SignRule(RingRule):
    """Sign voting over the logical ring: the base of BRACE, signSGD and RLR.

    Every sign rule runs phases I (quantize), II (Share-Reduce), IV (Share-Only) here, with
    the integrity check and the relay attacks; a subclass sets ``name`` and its own keys
    (``params``), reads them in :meth:`configure` and maps vote counts to the aggregate in
    :meth:`planes` (phase III).

    Parameters
    ----------
    n_clients : int
    seed : int
        Seeds the flip draws: relay ``i`` in round ``t`` (``aggregate``'s ``t``) draws
        from :func:`fedring.rng.generator` (stream ``RELAY_FLIP``, client ``i``, step ``t``).
    **params
        The config section named after the rule (keys are reported as ``<rule>.<key>``),
        the rule's own keys and these, common to every sign rule:

        - ``sign_zero``: the value of sign(0): 0 (default: the client abstains), 1 or -1.
        - ``check``: ``"off"`` (default) or ``"on"`` (also true/false): the Share-Reduce
          integrity check.
        - ``relay_attack``: ``"none"`` (default), ``"bias"`` or ``"flip"``.
        - ``relay_bias``: nonzero integer added by a Byzantine relay in Share-Reduce (default 1).
        - ``relay_flip_prob``: probability in [0, 1] that a Byzantine relay flips each sign it
          forwards in Share-Only (default 1).
        - ``relay_clients``: the Byzantine relays (list of client ids), until
          :meth:`set_byzantine` sets them.

    Notes
    -----
    The returned vector is applied as ``w <- w - lr * vector`` (eq. 4). Counts and bytes are
    exact; results are bit-identical on any number of MPI ranks.

    Examples
    --------
    Four clients, ``S = [2, 2, 0]``:

    >>> from mpi4py import MPI
    >>> from fedring.comm import Layout, Network
    >>> G = np.array([[1, -2, 3], [2, 2, -1], [-4, 1, 0], [3, 5, 0]], np.float32)
    >>> def vote(name, params={}):
    ...     return SignVote(name, 4, params)(Network(Layout(4, MPI.COMM_SELF)), G.copy()).tolist()
    >>> vote("brace", {"lambda": 1}), vote("brace", {"lambda": 1, "rule": "symmetric"})
    ([1.0, 1.0, -1.0], [1.0, 1.0, 0.0])
    >>> vote("signsgd"), vote("rlr", {"theta": 2}), vote("rlr", {"theta": 3})
    ([1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [-1.0, -1.0, 0.0])
    """

    #: the rule's own keys (its section also takes :data:`COMMON_KEYS`)
    own_keys: tuple[str, ...] = ()
    #: the four phases run on device rows too (docs/arrays.md)
    on_device = True
    #: whether phase III has three values (two bit planes in Share-Only)
    three_valued = True
    #: settings the Python API takes and a training run refuses, with why
    run_refuses: ClassVar[dict[str, str]] = {
        "relay_clients": "in a run the Byzantine clients are the relays: choose them with --byzantine and byzantine_select"
    }

    def __init__(self, n_clients: int, *, seed: int = 0, **params):
        rule = self.name
        known_keys(rule, f"ring rule {rule}", params, self.own_keys + COMMON_KEYS)
        self.n_clients, self.seed = integer("clients", n_clients, lo=1), seed

        def get(key, default):
            return params.get(key, default), f"{rule}.{key}"

        self.configure(get)
        value, key = get("sign_zero", 0)
        self.sign_zero = choice(key, integer(key, value), (0, 1, -1))
        value, key = get("check", "off")
        value = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
        self.check = choice(key, value, ("off", "on")) == "on"
        value, key = get("relay_attack", "none")
        self.relay_attack = choice(key, value, RELAY_ATTACKS)
        value, key = get("relay_bias", 1)
        self.relay_bias = integer(key, value)
        if self.relay_bias == 0:
            raise ConfigError(key, "must be a nonzero integer")
        value, key = get("relay_flip_prob", 1.0)
        self.flip_prob = real(key, value)
        if not 0.0 <= self.flip_prob <= 1.0:
            raise ConfigError(key, f"must be a probability in [0, 1], got {value!r}")
        self.set_byzantine(params.get("relay_clients", []))
        self.dtype = count_dtype(n_clients)
        self._buffers: dict[str, Any] = {}

    def configure(self, get) -> None:
        """Read the rule's own keys: ``get(key, default)`` gives ``(value, "<rule>.<key>")``."""

    # ---------------------------------------------------------------- configuration

    def set_byzantine(self, clients) -> None:
        """The Byzantine clients (ids) that act as malicious relays under ``relay_attack``."""
        key = f"{self.name}.relay_clients"
        try:
            ids = np.asarray(clients, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            raise ConfigError(key, f"must be a list of client ids, got {clients!r}") from None
        if np.any((ids < 0) | (ids >= self.n_clients)) or len(np.unique(ids)) != len(ids):
            raise ConfigError(key, f"client ids must be distinct and in 0..{self.n_clients - 1}")
        self.is_byzantine = np.zeros(self.n_clients, bool)
        self.is_byzantine[ids] = True
        # gap[i]: how far back the previous Byzantine client is (n when i is the only one).
        byz = np.sort(ids)
        self.gap = np.zeros(self.n_clients, np.int64)
        if len(byz):
            self.gap[byz] = (byz - np.roll(byz, 1)) % self.n_clients
            self.gap[byz[self.gap[byz] == 0]] = self.n_clients

    @property
    def bits(self) -> int:
        """Bits per coordinate in Share-Only."""
        return 2 if self.three_valued else 1

    # ---------------------------------------------------------------- phase III

    @staticmethod
    def clip(S, v: int) -> int:
        """``v`` clipped into the count type of ``S`` (thresholds are compared as integers, exactly,
        in the type of ``S`` on either kind of array)."""
        top = int(array_namespace(S).iinfo(S.dtype).max)
        return min(max(v, -top - 1), top)

    def planes(self, S) -> tuple[Any, Any | None]:
        """Phase III on (chunks of) vote counts ``S`` (either kind, any shape): the "positive" and
        "nonzero" bit planes, bool arrays of the kind of ``S``.

        The aggregate is ``+1`` where positive, ``-1`` where not (and nonzero), 0 where not
        nonzero; a two-valued rule has no zero plane (None).
        """
        raise NotImplementedError

    def consensus(self, S):
        """Phase III as int8 values in {-1, 0, +1}, of the kind of ``S``."""
        xp = array_namespace(S)
        positive, nonzero = self.planes(S)
        values = 2 * xp.astype(positive, xp.int8) - 1
        return values if nonzero is None else values * xp.astype(nonzero, xp.int8)

    def centralized(self, G):
        """The same aggregate from all ``(n, d)`` inputs at once (either kind), for checks and
        aggregator-aware attacks."""
        xp = array_namespace(G)
        S = xp.sum(quantize(G, self.sign_zero, np.int8), axis=0, dtype=xp.int64)
        return xp.astype(self.consensus(xp.astype(S, xp_dtype(xp, count_dtype(G.shape[0])))), xp.float32)

    # ---------------------------------------------------------------- the round

    def aggregate(self, net: Network, grads, t: int = 0) -> Aggregation:
        """One round over the ring: the ``(d,)`` aggregate, identical on every rank, and its figures.

        ``grads`` holds the ``(n_local, d)`` float32 rows of this rank's clients: numpy, or a device
        array (every phase then runs on its device, and the update is a device array). The update is
        written into ``grads[0]`` (a view: copy it to keep it once ``grads`` is reused); other rows
        are left unchanged.
        """
        lay, n = net.layout, net.n_clients
        if n != self.n_clients:
            raise ValueError(f"{self.name} built for {self.n_clients} clients, network has {n}")
        net.check_rows(grads, what="grads")
        n_local, d = grads.shape
        counted = RelayCounts(np.zeros(n, np.int64))
        bounds = block_bounds(d, n)
        packing = Packing(bounds, self.bits)
        local_byz = [i for i in lay.local_clients if self.is_byzantine[i]]
        numpy_rows = on_host(grads)

        counts = self._scratch("counts", (n_local, d), self.dtype, grads)
        if self.check or (self.relay_attack == "bias" and self.is_byzantine.any()):
            quantize(grads, self.sign_zero, self.dtype, out=counts)  # phase I
            self._share_reduce_guarded(net, counts, bounds, local_byz, counted)  # phase II
        elif not numpy_rows:  # phase I in a few passes over all rows; phase II's local hops are strided
            quantize(grads, self.sign_zero, self.dtype, out=counts)
            reduce_scatter(net, counts, bounds, SHARE_REDUCE, check=False)
        else:  # phase I chunk by chunk, each while the partial counts into it travel (phase II)

            def pieces(k: int, c: int) -> list:
                g, q = grads[k, bounds[c] : bounds[c + 1]], counts[k, bounds[c] : bounds[c + 1]]
                return [
                    lambda s=s: quantize(g[s : s + BLOCK], self.sign_zero, self.dtype, out=q[s : s + BLOCK])
                    for s in range(0, g.size, BLOCK)
                ]

            for k, i in enumerate(lay.local_clients):  # the chunk each client sends first
                for piece in pieces(k, i):
                    piece()
            reduce_scatter(net, counts, bounds, SHARE_REDUCE, check=False, ahead=pieces)

        pb = packing.byte_bounds
        row_bytes = int(pb[-1])
        packed = self._scratch("packed", (n_local, row_bytes), np.uint8, grads)
        for k, c, m in owned_runs(lay, bounds):  # phase III on the chunks the clients own, a run at a time
            size, width = int(bounds[c + 1] - bounds[c]), int(pb[c + 1] - pb[c])
            S = strided(counts, (m, size), k * d + int(bounds[c]), (d + size, 1))
            wire = strided(packed, (m, width), k * row_bytes + int(pb[c]), (row_bytes + width, 1))
            wire[...] = packing.encode(*self.planes(S))

        # Into grads[0] (consumed by now): a fresh d-vector would cost a page fault per 4 KiB.
        writable = not numpy_rows or (grads[0].flags.c_contiguous and grads.flags.writeable)
        update = grads[0] if host_dtype(grads) == np.float32 and writable else like(np.empty(d, np.float32), grads)
        if self.relay_attack == "flip" and self.is_byzantine.any():
            self._share_only_flipping(net, packed, packing, local_byz, counted, t)  # phase IV
            honest = np.flatnonzero(~self.is_byzantine)
            observer = int(honest[0]) if len(honest) else 0
            root = lay.owner(observer)
            row = host(packed[observer - lay.lo]) if lay.rank == root else np.empty(row_bytes, np.uint8)
            net.comm.Bcast(row, root=root)  # simulation only: which replica the run follows
            packing.decode(like(row, packed), update)
            signs = packing.counts(row)
        elif not numpy_rows:  # phase IV in strided local hops, then one decoding of the whole row
            all_gather(net, packed, pb, SHARE_ONLY, check=False)
            packing.decode(packed[0], update)
            signs = count_true(update > 0), count_true(update < 0)
        else:  # phase IV; row 0 decodes the chunk it got last while the next one travels

            def decoding(k: int, c: int) -> list:
                return packing.pieces(packed[0], update, (c + 1) % n) if k == 0 else []

            all_gather(net, packed, pb, SHARE_ONLY, check=False, ahead=decoding)
            for piece in packing.pieces(packed[0], update, (lay.lo + 2) % n):  # the last chunk it got
                piece()
            signs = packing.counts(packed[0])
        if self.check or self.relay_attack != "none":
            counted = counted.summed(net.comm)
        return Aggregation(update, self.figures(d, *signs, counted), self.per_client(counted))

    def idle(self, d: int) -> Aggregation:
        counted = RelayCounts(np.zeros(self.n_clients, np.int64))
        update = np.zeros(d, np.float32)
        figures = {k: np.nan if isinstance(v, float) else 0 for k, v in self.figures(d, 0, 0, counted).items()}
        return Aggregation(update, figures, self.per_client(counted), updated=False)

    def _scratch(self, name: str, shape: tuple, dtype: DTypeLike, ref):
        """A work buffer kept across rounds (never handed out), of the kind and device of ``ref``."""
        buf = self._buffers.get(name)
        same_kind = buf is not None and on_host(buf) == on_host(ref) and device(buf) == device(ref)
        if buf is None or not same_kind or tuple(buf.shape) != tuple(shape) or host_dtype(buf) != dtype:
            if on_host(ref):
                buf = np.empty(shape, dtype)
            else:
                xp = array_namespace(ref)
                buf = xp.empty(shape, dtype=xp_dtype(xp, dtype), device=device(ref))
            self._buffers[name] = buf
        return buf

    def _share_reduce_guarded(self, net: Network, counts, bounds: np.ndarray, local_byz, counted: RelayCounts) -> None:
        """Phase II step by step, with the relays' bias, the receivers' check and saturation (either kind of rows).

        The check's tallies stay arrays of the rows' kind until the last hop, so that on a device
        no hop waits for it: one transfer after the loop, not one per hop and receiver.
        """
        lay, n = net.layout, net.n_clients
        xp, where = array_namespace(counts), device(counts)
        own = self._scratch("own", tuple(counts.shape), self.dtype, counts)
        own[...] = counts
        top = int(xp.iinfo(counts.dtype).max)
        n_local = len(lay.local_clients)
        flagged_by = xp.zeros(n_local, dtype=xp.int64, device=where)  # counts each receiver replaced
        hops_by = xp.zeros(n_local, dtype=xp.int64, device=where)  # hops on which it replaced any

        def saturated(wide):  # an int64 sum, clipped into the count type
            return xp.astype(xp.clip(wide, min=-top, max=top), counts.dtype)

        tampering = self.relay_attack == "bias"
        for s in range(n - 1):
            if tampering:
                for i in local_byz:  # the partial it forwards now is dead for i afterwards
                    c = (i - s) % n
                    part = counts[i - lay.lo, bounds[c] : bounds[c + 1]]
                    part[...] = saturated(xp.astype(part, xp.int64) + self.relay_bias)
                    counted.tampered_hops += bool(bounds[c + 1] > bounds[c])
            net.ring_step(counts, bounds, rotation(-s, n), None, SHARE_REDUCE)
            k = s + 1  # contributors to every count received in step s
            for j in lay.local_clients:
                c = (j - 1 - s) % n
                got = counts[j - lay.lo, bounds[c] : bounds[c + 1]]
                if self.check and not self.is_byzantine[j]:
                    bad = (got > k) | (got < -k)
                    if self.sign_zero:
                        bad |= ((got ^ k) & 1) != 0
                    flagged = xp.count_nonzero(bad)  # a 0-d tensor on a device: no wait
                    flagged_by[j - lay.lo] += flagged
                    hops_by[j - lay.lo] += flagged > 0
                    fill = (k % 2) * self.sign_zero
                    if on_host(got):
                        if flagged:  # rare: the masked store only then
                            got[bad] = fill
                    else:  # a masked store would wait for the mask's count
                        got[...] = xp.where(bad, xp.asarray(fill, dtype=got.dtype, device=where), got)
                mine = own[j - lay.lo, bounds[c] : bounds[c + 1]]
                got[...] = saturated(xp.astype(got, xp.int64) + xp.astype(mine, xp.int64))
        if self.check:  # the receiver j accuses its sender j - 1
            counted.detections[(np.asarray(lay.local_clients) - 1) % n] += host(hops_by)
            counted.flagged += int(host(flagged_by).sum())

    def _share_only_flipping(
        self, net: Network, packed, packing: Packing, local_byz, counted: RelayCounts, t: int
    ) -> None:
        """Phase IV of round ``t`` with Byzantine relays flipping the signs they forward (the first on
        each path). The flips are the round's numpy draws on either kind of rows, all drawn before the
        first hop (each relay's generator in hop order, as hop by hop) and, on a device, moved there
        in one transfer; the flipped signs are counted there and read once, after the last hop."""
        lay, n = net.layout, net.n_clients
        b, pb = packing.bounds, packing.byte_bounds
        rngs = {i: generator(self.seed, Stream.RELAY_FLIP, client=i, step=t) for i in local_byz}
        steps: list[list] = [[] for _ in range(n - 1)]  # per step: (relay, chunk, flips)
        for s in range(n - 1):
            for i in local_byz:
                # i forwards chunk c, owned by i - s; it is the first Byzantine relay on the
                # chunk's path iff none of the s clients before it is Byzantine.
                c = (i + 1 - s) % n
                size = int(b[c + 1] - b[c])
                if self.gap[i] <= s or size == 0:
                    continue
                flips = np.ones(size, bool) if self.flip_prob == 1.0 else rngs[i].random(size) < self.flip_prob
                steps[s].append((i, c, flips))
        draws = [f for step in steps for _, _, f in step]
        counted.tampered_hops += len(draws)

        def moved(arrays: list, dtype) -> list:  # host arrays to the rows' kind in one transfer, as views
            whole = like(np.concatenate([np.empty(0, dtype), *arrays]), packed)
            at = np.cumsum([0, *(a.size for a in arrays)])
            return [whole[int(at[k]) : int(at[k + 1])] for k in range(len(arrays))]

        masks = moved([np.packbits(f) for f in draws], np.uint8)
        if packing.planes == 1:  # every sign is nonzero: each flip flips one
            flipped = sum(int(np.count_nonzero(f)) for f in draws)
        else:
            there = moved(draws, bool)
            flipped = 0  # on a device, a 0-d tensor until the end
        h = 0
        for s in range(n - 1):
            for i, c, _ in steps[s]:
                seg = packed[i - lay.lo, pb[c] : pb[c + 1]]
                if packing.planes == 2:
                    flipped = flipped + array_namespace(seg).count_nonzero(packing.nonzero(seg, c) & there[h])
                packing.signs(seg, c)[...] ^= masks[h]
                h += 1
            net.ring_step(packed, pb, rotation(1 - s, n), None, SHARE_ONLY)
        counted.flipped_signs += int(flipped)

    # ---------------------------------------------------------------- reporting

    def figures(self, d: int, plus: int, minus: int, counted: RelayCounts) -> dict[str, float | int]:
        """Scalars of a round: the paper's cost formula, the drift diagnostic (from the update's
        ``plus`` +1 and ``minus`` -1 entries), detections, tampering."""
        n = self.n_clients
        out: dict[str, float | int] = {
            "paper_formula_bytes": paper_bytes(n, d),
            "rar_formula_bytes": 2 * 32 * d * (n - 1) / n / 8,
            # the drift diagnostic: eq. (1) sends every weakly agreed coordinate to -1
            "plus_fraction": plus / max(d, 1),
            "minus_fraction": minus / max(d, 1),
            "zero_fraction": (d - plus - minus) / max(d, 1),
        }
        if self.check:
            out["integrity_detections"] = int(counted.detections.sum())
            out["integrity_flagged_counts"] = counted.flagged
        if self.relay_attack != "none":
            out["relay_tampered_hops"] = counted.tampered_hops
        if self.relay_attack == "flip":
            out["relay_flipped_signs"] = counted.flipped_signs
        return out

    def per_client(self, counted: RelayCounts) -> dict[str, np.ndarray]:
        """Per-client rows of a round: detections per accused sender (with the check on)."""
        return {"detections": counted.detections} if self.check else {}


@RING_RULES.register
class Brace(SignRule):
    """BRACE, eq. (1)-(4): ``+1 if S > lambda else -1`` (``rule=paper``, the default).

    ``rule=symmetric``: ``+1 if S > lambda``, ``-1 if S < -lambda``, else 0. Not in the paper;
    an ablation in which weak agreement moves nothing instead of drifting by ``+eta``. Needs
    ``lambda >= 0``. Keys: ``lambda`` (the threshold, any finite number; default 5, the
    paper's value for n = 100), ``rule``, and those of every sign rule (:class:`SignRule`).

    Examples
    --------
    The paper's Fig. 1 gradients with lambda = 2 (the threshold of its Fig. 2): ``S = [3, 1, 1]``.

    >>> from mpi4py import MPI
    >>> from fedring.comm import Layout, Network
    >>> G = np.array([[5, 2, -10], [8, -4, 7], [9, 3, 8]], np.float32)
    >>> Brace(3, **{"lambda": 2})(Network(Layout(3, MPI.COMM_SELF)), G.copy())
    array([ 1., -1., -1.], dtype=float32)
    >>> Brace(3, **{"lambda": 0})(Network(Layout(3, MPI.COMM_SELF)), G.copy())
    array([1., 1., 1.], dtype=float32)
    """

    name = "brace"
    own_keys = ("lambda", "rule")
    params = own_keys + COMMON_KEYS

    @property
    def summary(self) -> str:
        """What the run's banner adds to the rule's name: its consensus map."""
        return f"{self.brace_rule} rule"

    @classmethod
    def cohort_params(cls, params: dict, m: int, n: int) -> dict:
        """Relative to a cohort of ``m`` of the ``n`` clients, the threshold of eq. (1)-(3) is
        ``lambda * m / n``: the same fraction of the largest count (docs/brace.md, client sampling).

        >>> Brace.cohort_params({"lambda": 5}, 20, 100)
        {'lambda': 1.0}
        """
        lam = real(f"{cls.name}.lambda", params.get("lambda", 5))
        return {**params, "lambda": lam * m / n}

    def configure(self, get) -> None:
        value, key = get("lambda", 5)
        self.lam = real(key, value)
        value, key = get("rule", "paper")
        self.brace_rule = choice(key, value, BRACE_RULES)
        if self.brace_rule == "symmetric" and self.lam < 0:
            raise ConfigError(f"{self.name}.lambda", f"the symmetric rule needs lambda >= 0, got {self.lam:g}")
        self.three_valued = self.brace_rule == "symmetric"

    def planes(self, S) -> tuple[Any, Any | None]:
        """``S > lambda`` iff ``S > floor(lambda)`` for integer ``S``, clipped into the count type
        (so lambda >= n gives all -1 and lambda < -n all +1)."""
        floor = math.floor(self.lam)
        up = S > self.clip(S, floor)  # eq. (1)-(3): GAR = 2 I_t[k, k] - 1, I_t[k, k] = 1(S[k] > lambda)
        if self.brace_rule == "paper":
            return up, None
        return up, up | (S <= self.clip(S, -floor - 1))  # symmetric: -1 only where S < -lambda


@RING_RULES.register
class SignSGD(SignRule):
    """signSGD with majority vote over the ring: ``sign(S)``, 0 on ties (as the RLR authors' ``agg_sign``)."""

    name = "signsgd"
    params = COMMON_KEYS

    def planes(self, S) -> tuple[Any, Any | None]:
        return S > 0, S != 0


@RING_RULES.register
class RLR(SignRule):
    """Sign-aggregated robust learning rate over the ring: ``rho * sign(S)`` with
    ``rho = +1 if |S| >= theta else -1``: where too few clients agree the step is reversed.

    ``theta``: integer >= 0; default ``ceil(0.2 n)``, the ratio of the RLR authors' CIFAR-10
    setting (8 of 40 agents): 20 for the BRACE paper's 100 clients, for which it gives no theta.
    """

    name = "rlr"
    own_keys = ("theta",)
    params = own_keys + COMMON_KEYS

    @classmethod
    def cohort_params(cls, params: dict, m: int, n: int) -> dict:
        """Relative to a cohort of ``m`` of the ``n`` clients, a given ``theta`` becomes
        ``ceil(theta * m / n)`` (the default is already ``ceil(0.2 m)`` for ``m`` clients).

        >>> RLR.cohort_params({"theta": 20}, 15, 100), RLR.cohort_params({}, 15, 100)
        ({'theta': 3}, {})
        """
        if params.get("theta") is None:
            return params
        return {**params, "theta": -(-integer(f"{cls.name}.theta", params["theta"], lo=0) * m // n)}

    def configure(self, get) -> None:
        theta, key = get("theta", None)
        self.theta = math.ceil(0.2 * self.n_clients) if theta is None else integer(key, theta, lo=0)

    def planes(self, S) -> tuple[Any, Any | None]:
        agree = abs(S) > self.clip(S, self.theta - 1)  # |S| >= theta keeps sign(S), else it is reversed
        return (S > 0) == agree, S != 0


#: each sign rule's own keys (its section also takes :data:`COMMON_KEYS`)
RULE_KEYS = {rule.name: rule.own_keys for rule in (Brace, SignSGD, RLR)}


def SignVote(rule: str, n_clients: int, params: dict | None = None, *, seed: int = 0) -> SignRule:
    """The sign rule ``rule`` ("brace", "signsgd" or "rlr") with the settings ``params``.

    >>> SignVote("rlr", 100).theta
    20
    """
    choice("aggregator", rule, SIGN_RULES)
    return RING_RULES[rule](n_clients, seed=seed, **(params or {}))
