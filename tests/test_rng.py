"""fedring.rng: every draw's generator is ``numpy.random.default_rng(key)`` of its key (the module's
key layout), whichever way :func:`generator` builds it."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

from fedring.rng import TOGETHER_FROM, KeyedSeed, Stream, client_generators, generator, seed_states

#: entries at and around the bounds of one uint32 word (the fast path's), and beyond (numpy's own)
ENTRIES = [0, 1, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**64 + 3, np.int64(5), np.uint32(9)]


@pytest.mark.parametrize("stream", [Stream.BATCH, Stream.PARTITION, Stream.DP_LOCAL])
def test_generator_is_default_rng_of_its_key(stream):
    """The same state as ``default_rng`` of the documented key, for seeds, clients, steps and extras
    that fit one uint32 word each or do not."""
    for seed, step, extra in itertools.product(ENTRIES, ENTRIES, [(), (0,), (2**33,), (5, 6)]):
        for client in (None, 0, 2**31 - 2):
            if client is None:
                key = [seed, int(stream), step, *extra]
            else:
                key = [seed, client, step, int(stream), *extra]
            got = generator(seed, stream, client=client, step=step, extra=extra).bit_generator.state
            assert got == np.random.default_rng(key).bit_generator.state, key


def test_generator_refuses_what_default_rng_refuses():
    """A negative seed is numpy's error, not a wrapped word."""
    with pytest.raises(ValueError):
        generator(-1, Stream.BATCH, client=0, step=0)
    with pytest.raises(ValueError, match="keyed by a step"):
        generator(0, Stream.BATCH, client=0)


@pytest.mark.parametrize("length", range(1, 9))
def test_seed_states_are_numpys_seed_sequence_hash(length):
    """For keys shorter than numpy's pool of 4 words, as long, and longer (the hash's third loop),
    with words at the bounds of uint32: each row's ``SeedSequence(key).generate_state(4, uint64)``."""
    rng = np.random.default_rng(length)
    keys = rng.integers(0, 2**32, (64, length), dtype=np.uint32)
    keys[:4] = np.array([0, 1, 2**31, 2**32 - 1], np.uint32)[:, None]  # rows of one word at a bound, repeated
    want = np.stack([np.random.SeedSequence(key).generate_state(4, np.uint64) for key in keys])
    np.testing.assert_array_equal(seed_states(keys), want)


def test_seed_states_literal_vector():
    """numpy 2.4's ``SeedSequence([0, 3, 7, 1]).generate_state(4, np.uint64)``, client 3's batch
    seed in round 7 of seed 0, kept as printed."""
    got = seed_states(np.array([[0, 3, 7, 1]], np.uint32))
    assert got.tolist() == [[6980125789631452128, 6582575311255357897, 10156959349412000990, 3620941603759452987]]


@pytest.mark.parametrize("extra", [(), (0,), (5, 6), (2**33,)])
def test_client_generators_are_each_clients_generator(extra):
    """The same states as :func:`generator` per client, for seeds and steps that fit one word or
    do not (numpy's path then), and clients in any order."""
    clients = [7, 0, 3, 2**31 - 2, 5, *range(11, 18)]  # more than TOGETHER_FROM
    assert len(clients) > TOGETHER_FROM
    for seed, step, together in itertools.product(ENTRIES, ENTRIES, (True, None)):
        for few in (clients[:1], clients[: TOGETHER_FROM - 1], clients):
            got = client_generators(seed, Stream.BATCH, few, step, extra, together=together)
            for c, g in zip(few, got, strict=True):
                want = generator(seed, Stream.BATCH, client=c, step=step, extra=extra)
                assert g.bit_generator.state == want.bit_generator.state, (seed, c, step, extra)
    assert client_generators(0, Stream.BATCH, [], 0) == client_generators(0, Stream.BATCH, [], 0, together=True) == []


def test_client_generators_are_made_together_from_together_from_clients_on():
    """The hash over all keys where it is faster; a few clients' own generators below."""
    seeds = [type(g.bit_generator.seed_seq) for g in client_generators(0, Stream.BATCH, list(range(TOGETHER_FROM)), 1)]
    assert seeds == [KeyedSeed] * TOGETHER_FROM
    few = client_generators(0, Stream.BATCH, list(range(TOGETHER_FROM - 1)), 1)
    assert {type(g.bit_generator.seed_seq) for g in few} == {np.random.SeedSequence}


def test_a_client_generators_seed_answers_as_its_seed_sequence():
    """What else a generator's seed is asked (entropy, other state sizes, spawn, pickling) is the
    ``SeedSequence`` of its key's, as :func:`generator`'s."""
    (g,) = client_generators(2, Stream.BATCH, [9], 4, together=True)
    want = generator(2, Stream.BATCH, client=9, step=4)
    seed, ref = g.bit_generator.seed_seq, want.bit_generator.seed_seq
    assert isinstance(seed, KeyedSeed)
    assert seed.entropy.tolist() == ref.entropy.tolist() == [2, 9, 4, 1]
    np.testing.assert_array_equal(seed.generate_state(3), ref.generate_state(3))
    np.testing.assert_array_equal(seed.generate_state(4, np.uint64), ref.generate_state(4, np.uint64))
    for a, b in zip(g.spawn(2) + g.spawn(1), want.spawn(2) + want.spawn(1), strict=True):
        assert a.bit_generator.state == b.bit_generator.state
    copy = pickle.loads(pickle.dumps(g))
    assert copy.integers(2**62, size=4).tolist() == g.integers(2**62, size=4).tolist()
