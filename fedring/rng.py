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

from enum import IntEnum

import numpy as np


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
    if all(isinstance(k, (int, np.integer)) and 0 <= k <= 0xFFFFFFFF for k in key):
        # one uint32 word each: the words numpy makes of the list entry by entry, made at once (the
        # same generator, sooner: a round makes one per client, and the device waits for them)
        return np.random.default_rng(np.random.SeedSequence(np.array(key, np.uint32)))
    return np.random.default_rng(key)


def fixed_generator(stream: Stream) -> np.random.Generator:
    """The generator of a fixed stream, the same in every run and round: ``default_rng([stream])``.

    ``WHAT_IF`` (0) gives ``default_rng([0])``, the generator 0.2.0 drew from as
    ``default_rng(0)`` (the same state), so results stay bit-identical.

    >>> fixed_generator(Stream.WHAT_IF).bit_generator.state == np.random.default_rng(0).bit_generator.state
    True
    """
    return np.random.default_rng([int(stream)])
