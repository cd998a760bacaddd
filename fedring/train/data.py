"""Data sets and their partition over clients.

Every rank computes the same partition from the labels alone (small), then loads only the
images of the clients it hosts, so no rank ever holds the whole training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedring.comm import block_bounds
from fedring.datasets import DATASETS
from fedring.errors import ConfigError
from fedring.rng import Stream, generator


@dataclass
class Shard:
    """Samples of one client (or one evaluation slice): float32 images in [0, 1] and int64 labels."""

    x: np.ndarray
    y: np.ndarray


# ---------------------------------------------------------------------------------------
# Partitions: lists of sample indices per client, computed from the labels and the seed.


def partition_iid(n_samples: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(n_samples), n_clients)]


def partition_fang(labels: np.ndarray, n_clients: int, q: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Fang et al. (2020) non-IID partition of degree ``q``, the one the BRACE paper uses (q = 0.5).

    Clients form ``C`` label groups; a sample of label ``l`` goes to group ``l`` with
    probability ``q`` and to each other group with probability ``(1 - q)/(C - 1)``, then to a
    uniformly random client of that group; finally client ids are permuted. ``q = 1/C`` is
    IID. The group width is ``n/C`` as a float when ``C`` does not divide ``n``, as in the
    reference loop (FLDetector's ``train_mnist.py``), which this vectorises: the same
    distribution, drawn from ``rng`` in another order (docs/brace.md).
    """
    num_classes = int(labels.max()) + 1
    other = (1.0 - q) / (num_classes - 1)
    width = n_clients / num_classes
    rd = rng.random(len(labels))
    upper, lower = labels * other + q, labels * other
    group = np.where(
        rd > upper,
        np.floor((rd - upper) / other) + labels + 1,
        np.where(rd < lower, np.floor(rd / other), labels),
    )
    group = np.minimum(group, num_classes - 1)
    client = (group * width + np.floor(rng.random(len(labels)) * width)).astype(np.int64)
    client = np.minimum(client, n_clients - 1)
    perm = rng.permutation(n_clients)
    order = np.argsort(client, kind="stable")
    per_client = np.split(order, np.searchsorted(client[order], np.arange(1, n_clients)))
    return [per_client[p] for p in perm]


def partition_dirichlet(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dirichlet(alpha)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in range(int(labels.max()) + 1):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(idx)).astype(np.int64)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


def partition_shards(labels: np.ndarray, n_clients: int, per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. (2017), §3 ("pathological non-IID"): sort the samples by label, cut them into
    ``n_clients * per_client`` shards of equal size (sizes differ by at most one: ``array_split``),
    and give each client ``per_client`` shards drawn at random without replacement.

    >>> parts = partition_shards(np.array([1, 0, 1, 0, 2, 2, 1, 0]), 2, 2, np.random.default_rng(0))
    >>> # shards [1 3 | 7 0 | 2 6 | 4 5] (stable sort); the permutation gives client 0 shards 2, 0, client 1 shards 1, 3
    >>> [p.tolist() for p in parts]
    [[1, 2, 3, 6], [0, 4, 5, 7]]
    """
    count = n_clients * per_client
    if count > len(labels):
        raise ConfigError(
            "shards.per_client",
            f"{n_clients} clients x {per_client} shards = {count} shards of "
            f"{len(labels)} samples: fewer shards per client, or fewer clients",
        )
    shards = np.array_split(np.argsort(labels, kind="stable"), count)
    order = rng.permutation(count)
    return [
        np.sort(np.concatenate([shards[s] for s in order[c * per_client : (c + 1) * per_client]]))
        for c in range(n_clients)
    ]


def partition(
    labels: np.ndarray, n_clients: int, kind: str, noniid: float, seed: int, shards_per_client: int = 2
) -> list[np.ndarray]:
    """Sample indices per client; the same on every rank for the same seed."""
    rng = generator(seed, Stream.PARTITION)
    if kind == "iid":
        return partition_iid(len(labels), n_clients, rng)
    if kind == "fang":
        return partition_fang(labels, n_clients, noniid, rng)
    if kind == "dirichlet":
        return partition_dirichlet(labels, n_clients, noniid, rng)
    if kind == "shards":
        return partition_shards(labels, n_clients, shards_per_client, rng)
    raise ConfigError("partition", f"unknown partition {kind!r}; allowed: iid, fang, dirichlet, shards")


def hold_out(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every client's samples into (training, validation): ``floor(fraction * |part|)`` samples
    drawn from the client's own stream, so the split depends on the seed and the client only.

    >>> train, val = hold_out([np.arange(10), np.arange(10, 13)], 0.3, seed=0)
    >>> [len(v) for v in val], sorted(np.concatenate([train[0], val[0]]).tolist()) == list(range(10))
    ([3, 0], True)
    """
    train, val = [], []
    for c, part in enumerate(parts):
        held = generator(seed, Stream.VALIDATION, client=c, step=0).permutation(len(part))[: int(fraction * len(part))]
        mask = np.zeros(len(part), bool)
        mask[held] = True
        train.append(part[~mask])
        val.append(part[mask])
    if fraction and not sum(len(v) for v in val):
        raise ConfigError("validation", f"{fraction:g} of every client's samples holds out none: use a larger fraction")
    return train, val


def _checked(parts: list[np.ndarray]) -> list[np.ndarray]:
    # Checked on the whole partition, which every rank computes, so all ranks fail alike.
    empty = [c for c, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(
            "partition",
            f"client(s) {empty[:5]} received no training samples; use fewer clients, "
            "a larger --noniid (Dirichlet alpha) or another partition",
        )
    return parts


class FederatedData:
    """The shards of the clients hosted on one rank, and its slice of the test set.

    The test set is cut into ``n_clients`` contiguous slices; each rank evaluates the
    slices of its clients, so evaluation is split across ranks the same way whatever their
    number.
    """

    def __init__(
        self,
        dataset: str,
        data_dir: str | None,
        n_clients: int,
        clients: range,
        kind: str,
        noniid: float,
        seed: int,
        server_samples: int = 0,
        shards_per_client: int = 2,
        validation: float = 0.0,
    ):
        self.n_clients = n_clients
        self.clients = clients
        self.server = None  # the server's small clean set (FLTrust, Zeno++), when asked for

        data = DATASETS.build(dataset, {}, key="dataset", data_dir=data_dir)
        labels = data.train_labels()
        parts, held = hold_out(
            _checked(partition(labels, n_clients, kind, noniid, seed, shards_per_client)), validation, seed
        )
        mine = np.sort(np.concatenate([parts[c] for c in clients] + [held[c] for c in clients]))
        images = data.train_images(mine)
        where = {int(s): k for k, s in enumerate(mine)}

        def shard(indices: np.ndarray) -> Shard:
            rows = np.fromiter((where[int(s)] for s in indices), np.int64, len(indices))
            return Shard(images[rows], labels[indices])

        self.shards = [shard(parts[c]) for c in clients]
        self.validation = [shard(held[c]) for c in clients]  # empty without a validation split
        if server_samples:
            rows = np.sort(generator(seed, Stream.SERVER_DATA).permutation(len(labels))[:server_samples])
            self.server = Shard(data.train_images(rows), labels[rows])
        test_labels = data.test_labels()
        bounds = block_bounds(len(test_labels), n_clients)
        lo, hi = int(bounds[clients.start]), int(bounds[clients.stop])
        self.test_bounds = bounds[clients.start : clients.stop + 1] - lo
        self.test = Shard(data.test_images(np.arange(lo, hi)), test_labels[lo:hi])
        self.shape = data.shape

    def test_slice(self, k: int) -> Shard:
        """Test samples evaluated for the k-th local client."""
        a, b = self.test_bounds[k], self.test_bounds[k + 1]
        return Shard(self.test.x[a:b], self.test.y[a:b])
