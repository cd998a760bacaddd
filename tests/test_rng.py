"""fedring.rng: every draw's generator is ``numpy.random.default_rng(key)`` of its key (the module's
key layout), whichever way :func:`generator` builds it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedring.rng import Stream, generator

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
