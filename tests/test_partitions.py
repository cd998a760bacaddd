"""The partitions of the peers (fedring/train/data.py) against the peers' own code on the same draws,
and the natural partition (one user per client) on LEAF files.

The peers draw from other generators (flwr-datasets: a numpy Generator of its own seed; FedLab:
numpy's legacy global RandomState; ByzFL: Python's ``random``), so each partition is split into
its draws and a pure assignment, and the expected index lists below are what the peers' code
printed when its random calls returned the same draws. They come from the peers' files, run
unmodified outside this repository (the imports they make but these functions do not use
stubbed; ``self._rng.dirichlet`` / ``np.random.lognormal`` / ``np.random.permutation`` returning
the draws below; ``random.shuffle`` the identity):

- flwr-datasets ``DirichletPartitioner._determine_partition_id_to_indices_if_needed``
  (adap/flower, ``datasets/flwr_datasets/partitioner/dirichlet_partitioner.py`` at fdef7af),
  ``self_balancing=False``, ``shuffle=False``;
- FedLab ``lognormal_unbalance_split`` and ``homo_partition`` (SMILELab-FL/FedLab,
  ``fedlab/utils/dataset/functional.py`` at 92552a7);
- ByzFL ``DataDistributor.gamma_niid_idx`` and ``extreme_niid_idx`` (LPD-EPFL/byzfl,
  ``byzfl/fed_framework/data_distributor.py`` at 69bd1ac), given the indices in the permuted
  order as a ``Subset``'s.

Each client's list is sorted (fedring keeps a client's indices in order; the peers keep them in
the order they assigned them).
"""

from __future__ import annotations

import numpy as np
import pytest

from fedring.errors import ConfigError
from fedring.rng import Stream, generator
from fedring.train.data import (
    DIRICHLET_DRAWS,
    FederatedData,
    _checked,
    dirichlet_assign,
    extreme_assign,
    gamma_assign,
    lognormal_assign,
    partition,
    partition_dirichlet,
    partition_settings,
)

LABELS = np.array([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2, 0, 0, 1, 2, 1, 0, 2, 1])
PERM = np.array([13, 4, 17, 0, 9, 2, 19, 7, 11, 5, 15, 1, 8, 18, 3, 12, 6, 16, 10, 14])
#: a class's proportions over 4 clients, per class (D1); BAD leaves client 2 one sample
D1 = [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
BAD = [[0.9, 0.1, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.4]]
FLOWER_D1 = [[0, 2, 5, 6, 10], [1, 3, 4, 8, 14], [7, 9, 11, 16], [12, 13, 15, 17, 18, 19]]


def lists(parts) -> list[list[int]]:
    return [sorted(np.asarray(p).tolist()) for p in parts]


class Queued:
    """A generator whose ``dirichlet`` returns queued proportions and whose ``permutation`` keeps
    the order it is given (flwr-datasets cuts a class's samples in index order)."""

    def __init__(self, draws):
        self.draws, self.calls = [np.array(d) for d in draws], 0

    def dirichlet(self, alpha):
        self.calls += 1
        return self.draws.pop(0)

    def permutation(self, x):
        return np.asarray(x)


# ---------------------------------------------------------------------------------------------
# Dirichlet


def old_dirichlet(labels, n_clients, alpha, rng):
    """fedring's Dirichlet partition before the draw/assign split (0.4), for the default's bit-identity."""
    parts = [[] for _ in range(n_clients)]
    for c in range(int(labels.max()) + 1):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(idx)).astype(np.int64)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


@pytest.mark.parametrize("seed,alpha", [(0, 0.5), (3, 0.1), (7, 5.0)])
def test_dirichlet_default_is_the_one_draw_of_earlier_releases(seed, alpha):
    labels = np.random.default_rng(1).integers(0, 10, 3000)
    new = partition(labels, 20, "dirichlet", alpha, seed)
    old = old_dirichlet(labels, 20, alpha, generator(seed, Stream.PARTITION))
    assert len(new) == 20 and all(a.tobytes() == b.tobytes() for a, b in zip(new, old))


def test_dirichlet_assign_is_flowers_cut():
    orders = [np.flatnonzero(LABELS == c) for c in range(3)]
    assert lists(dirichlet_assign(orders, np.array(D1))) == FLOWER_D1
    # flwr-datasets with min_partition_size 0 takes the first draw: the same lists
    assert lists(partition_dirichlet(LABELS, 4, 0.5, Queued(D1))) == FLOWER_D1


def test_dirichlet_min_size_draws_again_as_flower():
    """flwr-datasets with min_partition_size=3: BAD gives client 2 one sample, so it draws again
    (6 Dirichlet draws, 3 classes twice) and keeps D1; twelve BADs: it gives up after 11 tries (33 draws)."""
    rng = Queued(BAD + D1)
    assert lists(partition_dirichlet(LABELS, 4, 0.5, rng, min_size=3)) == FLOWER_D1 and rng.calls == 6
    rng = Queued(BAD * 12)
    with pytest.raises(ConfigError, match=r"^dirichlet.min_size: 11 Dirichlet draws \(alpha 0.5\) each left a client"):
        partition_dirichlet(LABELS, 4, 0.5, rng, min_size=3)
    assert rng.calls == 33 == DIRICHLET_DRAWS * 3
    with pytest.raises(ConfigError, match=r"^dirichlet.min_size: 4 clients x 6 samples is more than the 20"):
        partition_dirichlet(LABELS, 4, 0.5, Queued([]), min_size=6)


def test_dirichlet_min_size_on_the_seed_keeps_the_first_draw_that_fits():
    """alpha 0.1 over 30 clients leaves a client empty at seed 3; with min_size 5 the partition is the
    first draw of the seed's partition stream in which every client has 5 samples: the second."""
    labels = np.random.default_rng(2).integers(0, 10, 2000)
    with pytest.raises(ConfigError, match=r"received no training samples"):  # the default's single draw
        _checked(partition(labels, 30, "dirichlet", 0.1, 3))
    parts = partition(labels, 30, "dirichlet", 0.1, 3, settings={"min_size": 5})
    rng, tries = generator(3, Stream.PARTITION), 0
    while True:
        tries += 1
        replay = old_dirichlet(labels, 30, 0.1, rng)
        if min(len(p) for p in replay) >= 5:
            break
    assert tries == 2 and lists(parts) == lists(replay) and min(len(p) for p in parts) >= 5


# ---------------------------------------------------------------------------------------------
# FedLab's quantity skew, ByzFL's gamma-similarity and extreme partitions


def test_lognormal_is_fedlabs_split_on_the_same_draws():
    # FedLab: sizes 20 x [0.5, 2, 1.2, 0.3] / 4 floored = [2, 10, 6, 1], the one left over to client 0
    assert lists(lognormal_assign(np.array([0.5, 2.0, 1.2, 0.3]), PERM, 4)) == [
        [4, 13, 17],
        [0, 1, 2, 5, 7, 8, 9, 11, 15, 19],
        [3, 6, 10, 12, 16, 18],
        [14],
    ]
    # sigma = 0: FedLab's balance_split, 6 each, PERM's last 2 samples (10, 14) to nobody
    assert lists(lognormal_assign(None, PERM, 3)) == [
        [0, 2, 4, 9, 13, 17],
        [1, 5, 7, 11, 15, 19],
        [3, 6, 8, 12, 16, 18],
    ]


def test_lognormal_draws_fedlabs_sizes_from_the_partition_stream():
    """The draw: log-normal of mean log(floor(n / K)) (FedLab's: log 5 for 20 samples over 4 clients,
    1.6094379124341003 as FedLab printed it), then the permutation; on the seed's partition stream."""
    rng = generator(9, Stream.PARTITION)
    raw = rng.lognormal(1.6094379124341003, 0.7, 4)
    expected = lognormal_assign(raw, rng.permutation(20), 4)
    got = partition(LABELS, 4, "lognormal", 0.5, 9, settings={"sigma": 0.7})
    assert lists(got) == lists(expected) and sum(map(len, got)) == 20
    assert np.log(20 // 4) == 1.6094379124341003


@pytest.mark.parametrize(
    "gamma,expected",
    [
        (0.4, [[1, 3, 4, 5, 12, 13, 17], [0, 2, 6, 9, 10, 14, 16], [7, 8, 11, 15, 18, 19]]),
        (0.0, [[1, 3, 7, 9, 12, 13, 17], [2, 5, 6, 10, 14, 16, 19], [0, 4, 8, 11, 15, 18]]),  # extreme_niid's
        (1.0, [[0, 2, 4, 9, 13, 17, 19], [1, 5, 7, 8, 11, 15, 18], [3, 6, 10, 12, 14, 16]]),  # PERM cut in 3
    ],
)
def test_gamma_similarity_is_byzfls_on_the_same_permutation(gamma, expected):
    assert lists(gamma_assign(LABELS, PERM, gamma, 3)) == expected


def test_extreme_niid_is_byzfls():
    expected = [[1, 3, 7, 9, 12, 13, 17], [2, 5, 6, 10, 14, 16, 19], [0, 4, 8, 11, 15, 18]]
    assert lists(extreme_assign(LABELS, np.arange(20), 3)) == expected
    assert lists(partition(LABELS, 3, "extreme_niid", 0.5, 0)) == expected  # no draw: any seed


def test_the_runs_draws_come_from_the_partition_stream():
    rng = generator(5, Stream.PARTITION)
    assert lists(partition(LABELS, 3, "gamma_similarity_niid", 0.5, 5, settings={"gamma": 0.4})) == lists(
        gamma_assign(LABELS, rng.permutation(20), 0.4, 3)
    )


@pytest.mark.parametrize(
    "kind,settings",
    [
        ("lognormal", {"sigma": 1.0}),
        ("gamma_similarity_niid", {"gamma": 0.3}),
        ("extreme_niid", {}),
        ("dirichlet", {"min_size": 20}),
    ],
)
def test_every_sample_goes_to_one_client(kind, settings):
    labels = np.random.default_rng(3).integers(0, 10, 6000)
    parts = partition(labels, 20, kind, 0.5, 2, settings=settings)
    assert len(parts) == 20 and sorted(np.concatenate(parts).tolist()) == list(range(6000))
    assert all(np.all(np.diff(p) > 0) for p in parts)


def test_partition_settings_are_checked():
    assert partition_settings("lognormal", {}) == {"sigma": 0.3}
    assert partition_settings("dirichlet", {}) == {"min_size": None}
    for kind, section, message in [
        ("lognormal", {"sigma": -1}, r"^lognormal.sigma: must be >= 0, got -1.0"),
        ("gamma_similarity_niid", {"gamma": 1.5}, r"^gamma_similarity_niid.gamma: must be in \[0, 1\], got 1.5"),
        ("dirichlet", {"min_size": 0}, r"^dirichlet.min_size: must be >= 1, got 0"),
        ("dirichlet", {"min": 3}, r"^dirichlet.min: unknown parameter of partition dirichlet"),
        ("natural", {"x": 1}, r"^natural.x: unknown parameter of partition natural"),
    ]:
        with pytest.raises(ConfigError, match=message):
            partition_settings(kind, section)


# ---------------------------------------------------------------------------------------------
# natural: one user per client


@pytest.fixture
def writers(tmp_path):
    """5 FEMNIST writers over two files; writer w has w + 1 training images (label w) and, but for
    writer 3, one test image (label 10 + w)."""
    from test_datasets_formats import _pixels, write_leaf

    def users(part, first, last):
        out = {}
        for w in range(first, last):
            n = w + 1 if part == "train" else int(w != 3)
            out[f"f{w:04d}"] = (_pixels(10 * w + (part == "test"), n), [w + 10 * (part == "test")] * n)
        return out

    write_leaf(
        tmp_path,
        {
            f"{part}/{k}.json": users(part, first, last)
            for part in ("train", "test")
            for k, (first, last) in enumerate(((0, 2), (2, 5)))
        },
    )
    return tmp_path


def test_natural_gives_each_client_one_user_and_its_test_samples(writers):
    data = FederatedData("femnist", str(writers), 5, range(0, 5), "natural", 0.5, seed=0)
    assert [s.y.tolist() for s in data.shards] == [[w] * (w + 1) for w in range(5)]  # every writer, in id order
    assert [data.test_slice(k).y.tolist() for k in range(5)] == [[10], [11], [12], [], [14]]
    # a rank of clients 2..3 holds their images only, the same as the whole's
    part = FederatedData("femnist", str(writers), 5, range(2, 4), "natural", 0.5, seed=0)
    for k in range(2):
        np.testing.assert_array_equal(part.shards[k].x, data.shards[k + 2].x)
    assert part.test.y.tolist() == [12]


def test_natural_draws_which_users_with_more_users_than_clients(writers):
    """3 of the 5 writers, drawn from the seed's NATURAL_USERS stream, in id order."""
    chosen = np.sort(generator(4, Stream.NATURAL_USERS).choice(5, 3, replace=False))
    data = FederatedData("femnist", str(writers), 3, range(0, 3), "natural", 0.5, seed=4)
    assert [int(s.y[0]) for s in data.shards] == chosen.tolist()
    assert [data.test_slice(k).y.tolist() for k in range(3)] == [[] if w == 3 else [10 + w] for w in chosen]
    other = FederatedData("femnist", str(writers), 3, range(0, 3), "natural", 0.5, seed=5)
    assert [int(s.y[0]) for s in other.shards] == np.sort(
        generator(5, Stream.NATURAL_USERS).choice(5, 3, replace=False)
    ).tolist()


def test_natural_refuses_more_clients_than_users_and_a_data_set_without_users(writers, tmp_path):
    with pytest.raises(ConfigError, match=r"^clients: 6 clients but femnist has 5 users with training samples"):
        FederatedData("femnist", str(writers), 6, range(0, 6), "natural", 0.5, seed=0)
    with pytest.raises(
        ConfigError, match=r"^partition: natural gives each client one user, and synthetic records none"
    ):
        partition(LABELS, 2, "natural", 0.5, 0, users=None, dataset="synthetic")

    from fedring.config import Config
    from fedring.train.task import TrainTask

    with pytest.raises(ConfigError, match=r"^partition: natural gives each client one of the data set's users, and "):
        TrainTask(Config(dataset="synthetic", partition="natural", clients=2, out=str(tmp_path / "r.h5")), 1)
