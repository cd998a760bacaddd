"""Every random draw of every task comes from :func:`generator`: one key scheme, one stream table.

A draw is made by a client or by the run as a whole (the server, the adversary's collusion,
the data split), at a step (a training round, a conformal trial) and for a purpose (a
:class:`Stream`). Its generator is ``numpy.random.default_rng(key)`` with

* a client's draws: ``key = [seed, client, step, stream, *extra]``;
* the run's draws: ``key = [seed, stream, step, *extra]`` (``step`` left out for draws made
  once per run);
* a fixed stream's draws, the same in every run (:func:`fixed_generator`; one such stream,
  ``WHAT_IF``): ``key = [stream]``.

So a draw depends on the run's seed and on who draws what when, never on which rank hosts the
client or how many ranks there are: the same seed gives bit-identical results on any number of
ranks, and a resumed run needs no generator state. ``extra`` tells apart several draws of one
stream at one step (a target agent, a DP variant). The two key forms differ in length or in
their second entry (client ids are below 2**31 - 1; run-wide streams are large constants), and
every stream value is unique, so no two purposes share a generator.

>>> generator(0, Stream.BATCH, client=3, step=7).integers(100)  # client 3's batch draw in round 7
np.int64(92)
>>> generator(0, Stream.PARTITION).bit_generator.seed_seq.entropy.tolist()
[0, 39463]
"""

from __future__ import annotations

import functools
from enum import IntEnum

import numpy as np
import numpy.typing as npt
from numpy.random.bit_generator import ISpawnableSeedSequence


class Stream(IntEnum):
    """What a draw is for. Values are part of the results: never renumber one."""

    # training (fedring.train): per client and round, or per round
    BATCH = 1  # a client's mini-batch
    POISON = 2  # a data attack's changes to a Byzantine client's batch
    ATTACK = 3  # a model attack's draws (per attacker, or the colluding adversary's)
    AGGREGATOR = 4  # a randomised server rule (bucketing, H+ segments ...)
    # training, once per run
    BYZANTINE = 0xB12  # which clients are Byzantine
    SERVER_DATA = 0x5E4  # the server's clean samples (FLTrust, Zeno++, H+ clean mode)
    SYNTHETIC = 0x5E7  # the synthetic image set (seeded by its own constant, not the run's seed)
    PARTITION = 0x9A27  # the non-IID split of the training set
    VALIDATION = 0xFA1  # a client's validation samples (per client; step 0: drawn once)
    RELAY_FLIP = 0xF11B  # a Byzantine relay's sign flips in BRACE's Share-Only (per client and round)
    # training, per round (run-wide): who takes part (fedring.train.participation)
    AVAILABILITY = 0xA7A1  # which clients are available (availability < 1)
    COHORT = 0xC047  # the round's cohort among the available clients (participation < 1)
    # training, the same in every run and round (fixed_generator): kept from 0.2.0, whose results it fixes
    WHAT_IF = 0  # a server rule applied to what-if rows (an aggregator-aware attack's view of the server)
    # PRISM-FCP (fedring.conformal.prism): step = trial
    PRISM_ENVIRONMENT = 0x9F01  # w*, the Byzantine set (run-wide)
    PRISM_DATA = 0x9F02  # a client's data stream, calibration and test samples
    PRISM_MASK = 0x9F03  # a client's selection masks S_{k,n}
    PRISM_TRAIN_ATTACK = 0x9F04  # a Byzantine client's uplink noise (tau, delta)
    PRISM_PARTICIPANTS = 0x9F05  # the server's S_n (run-wide)
    PRISM_CALIB_ATTACK = 0x9F06  # a Byzantine client's calibration-score attack
    PRISM_STANDIN = 0x9F07  # the stand-in UCI file (run-wide, no step)
    # label-shift DP-FedCP (fedring.conformal.labelshift): step = trial
    LS_DATA = 0x1501  # an agent's calibration points
    LS_COUNT_NOISE = 0x1502  # an agent's discrete-Gaussian count noise
    LS_SUBSET = 0x1503  # an agent's subsample J_i
    LS_GRAD_NOISE = 0x1504  # an agent's DP gradient noise (extra: target, variant)
    LS_MULTINOMIAL = 0x1505  # the server's subsample sizes (run-wide)
    LS_PARTICIPATION = 0x1506  # the server's sampled agents (run-wide; extra: target, variant)
    LS_TEST = 0x1507  # the target's test points (run-wide; extra: target)
    LS_SPLIT = 0x1508  # the calibration/test split of a logits set (run-wide)
    # training, once per run (added after the others; a new value changes no other draw)
    NATURAL_USERS = 0x05E2  # which of a data set's users are the clients (partition natural)
    DP_NOISE = 0xD901  # the server's Gaussian noise on the round's mean (dp = central; per round)
    DP_LOCAL = 0xD902  # an honest client's Gaussian noise on its upload (dp = local; per client and round)


def generator(
    seed: int, stream: Stream, *, client: int | None = None, step: int | None = None, extra: tuple[int, ...] = ()
) -> np.random.Generator:
    """The generator of one purpose's draws (module docstring for the key layout)."""
    if client is None:
        key = [seed, int(stream), *([] if step is None else [step]), *extra]
    else:
        if step is None:
            raise ValueError("a client's draws are keyed by a step (round or trial)")
        key = [seed, client, step, int(stream), *extra]
    if one_word_each(key):
        # one uint32 word each: the words numpy makes of the list entry by entry, made at once (the
        # same generator, sooner: a round makes one per client, and the device waits for them)
        return np.random.default_rng(np.random.SeedSequence(np.array(key, np.uint32)))
    return np.random.default_rng(key)


def client_generators(
    seed: int,
    stream: Stream,
    clients: list[int],
    step: int,
    extra: tuple[int, ...] = (),
    *,
    together: bool | None = None,
) -> list[np.random.Generator]:
    """The generators of ``clients``' draws of one purpose at one step: ``generator(seed, stream,
    client=c, step=step, extra=extra)`` for each ``c``, in order, the same states. A round makes one
    per client before its first kernel, and a GPU waits for them. Made together (``together``;
    None: from :data:`TOGETHER_FROM` clients on, where that is faster), numpy's
    :class:`~numpy.random.SeedSequence` hash of the keys runs once over all of them
    (:func:`seed_states`), instead of in each client's ``SeedSequence`` and its ``generate_state``.

    >>> [g.integers(100) for g in client_generators(0, Stream.BATCH, [3, 4], 7, together=True)]
    [np.int64(92), np.int64(26)]
    >>> generator(0, Stream.BATCH, client=4, step=7).integers(100)
    np.int64(26)
    """
    if together is None:
        together = len(clients) >= TOGETHER_FROM
    entries = [seed, step, int(stream), *extra, *clients]
    if not together or not clients or not one_word_each(entries):
        return [generator(seed, stream, client=c, step=step, extra=extra) for c in clients]
    words = np.array([[seed, c, step, int(stream), *extra] for c in clients], np.uint32)
    # numpy's stubs name SeedSequence only; PCG64 takes any ISeedSequence
    return [np.random.Generator(np.random.PCG64(KeyedSeed(w, s))) for w, s in zip(words, seed_states(words))]  # type: ignore[arg-type]


def one_word_each(entries: list) -> bool:
    """Whether every entry of a key is an integer that fits one uint32 word: numpy's
    ``SeedSequence`` then takes the key's words as they are, in order."""
    return all(isinstance(k, (int, np.integer)) and 0 <= k <= 0xFFFFFFFF for k in entries)


#: the fewest clients whose generators :func:`client_generators` makes together: the hash over all
#: keys costs a fixed number of numpy operations, which a few clients' own ``SeedSequence`` beat
#: (``benchmarks/draws.py --few``, docs/figures.md)
TOGETHER_FROM = 10


# numpy's SeedSequence constants (O'Neill's seed_seq; numpy/random/bit_generator.pyx)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _POOL = np.uint32(0xCA01F9DD), np.uint32(0x4973F715), 4
_SHIFT = np.uint32(16)


@functools.cache
def _multipliers(init: int, mult: int, calls: int) -> npt.NDArray[np.uint32]:
    """The hash's running multiplier at each of its first ``calls`` + 1 calls: ``init * mult**j``
    modulo 2**32 (call j XORs the value with entry j and multiplies it by entry j + 1), as a column."""
    out = [init]
    for _ in range(calls):
        out.append(out[-1] * mult & 0xFFFFFFFF)
    return np.array(out, np.uint32)[:, None]


def seed_states(keys: np.ndarray) -> np.ndarray:
    """Row by row, ``SeedSequence(key).generate_state(4, np.uint64)`` (what
    :class:`~numpy.random.PCG64` asks of its seed) for ``keys``, an ``(m, k)`` uint32 array of
    keys of one length, computed for all rows at once. The hash's multipliers depend only on how
    many times it has run, not on the key, so each step runs over every key, and the hashes a step
    makes of one pool word for the others run as one ``(3, m)`` operation.

    >>> key = np.array([[1, 2, 3, 4, 5]], np.uint32)
    >>> bool((seed_states(key)[0] == np.random.SeedSequence(key[0]).generate_state(4, np.uint64)).all())
    True
    """
    keys = np.asarray(keys, np.uint32)
    m, k = keys.shape
    calls = _POOL + _POOL * (_POOL - 1) + _POOL * max(k - _POOL, 0)
    h = _multipliers(_INIT_A, _MULT_A, calls)
    at = 0

    def hashed(values: npt.NDArray[np.uint32], multipliers: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
        """Call j of the hash on ``values[j]``, with the running ``multipliers`` j and j + 1."""
        out = values ^ multipliers[:-1]
        out *= multipliers[1:]
        out ^= out >> _SHIFT
        return out

    def hashmix(values: npt.NDArray[np.uint32], count: int) -> npt.NDArray[np.uint32]:
        """The mixing hash's next ``count`` calls, call j on ``values[j]`` (rows of one value for all calls)."""
        nonlocal at
        at += count
        return hashed(values, h[at - count : at + 1])

    def mix(x: npt.NDArray[np.uint32], y: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
        out = _MIX_L * x
        out -= _MIX_R * y
        out ^= out >> _SHIFT
        return out

    words = np.zeros((_POOL, m), np.uint32)
    words[: min(k, _POOL)] = keys[:, :_POOL].T
    pool = hashmix(words, _POOL)
    for src in range(_POOL):  # the other words, in order, each mixed with a hash of this one
        others = [dst for dst in range(_POOL) if dst != src]
        pool[others] = mix(pool[others], hashmix(pool[src], _POOL - 1))
    for src in range(_POOL, k):  # the key's words beyond the pool, each into every pool word
        pool = mix(pool, hashmix(keys[:, src], _POOL))
    out = hashed(pool[[*range(_POOL)] * 2], _multipliers(_INIT_B, _MULT_B, 2 * _POOL))
    wide = out.astype(np.uint64)  # eight uint32 words a key: four uint64 words, the first of each pair the low half
    return np.ascontiguousarray((wide[0::2] | wide[1::2] << np.uint64(32)).T)


class KeyedSeed:
    """The seed of a generator of :func:`client_generators`: the state :func:`seed_states`
    computed for its ``key`` (uint32 words), given to :class:`~numpy.random.PCG64` as the key's
    ``SeedSequence`` would give it; anything else (other state sizes, ``spawn``, ``entropy``)
    comes from that ``SeedSequence``, made when first asked."""

    __slots__ = ("_sequence", "key", "state")
    _sequence: np.random.SeedSequence | None

    def __init__(self, key: np.ndarray, state: np.ndarray):
        self.key, self.state, self._sequence = key, state, None

    def sequence(self) -> np.random.SeedSequence:
        """The key's ``SeedSequence``, one per seed, as a generator of :func:`generator` has."""
        if self._sequence is None:
            self._sequence = np.random.SeedSequence(self.key)
        return self._sequence

    def generate_state(self, n_words: int, dtype: type = np.uint32) -> np.ndarray:
        if n_words == len(self.state) and np.dtype(dtype) == np.dtype(np.uint64):
            return self.state.copy()
        return self.sequence().generate_state(n_words, dtype)

    def spawn(self, n_children: int) -> list[np.random.SeedSequence]:
        return self.sequence().spawn(n_children)

    @property
    def entropy(self) -> np.ndarray:
        return np.asarray(self.sequence().entropy)


ISpawnableSeedSequence.register(KeyedSeed)


def fixed_generator(stream: Stream) -> np.random.Generator:
    """The generator of a fixed stream, the same in every run and round: ``default_rng([stream])``.

    ``WHAT_IF`` (0) gives ``default_rng([0])``, the generator 0.2.0 drew from as
    ``default_rng(0)`` (the same state), so results stay bit-identical.

    >>> fixed_generator(Stream.WHAT_IF).bit_generator.state == np.random.default_rng(0).bit_generator.state
    True
    """
    return np.random.default_rng([int(stream)])
