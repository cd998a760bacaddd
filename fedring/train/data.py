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


def partition_dirichlet(
    labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dirichlet(alpha)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in range(int(labels.max()) + 1):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(idx)).astype(np.int64)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


def partition(labels: np.ndarray, n_clients: int, kind: str, noniid: float, seed: int) -> list[np.ndarray]:
    """Sample indices per client; the same on every rank for the same seed."""
    rng = generator(seed, Stream.PARTITION)
    if kind == "iid":
        return partition_iid(len(labels), n_clients, rng)
    if kind == "fang":
        return partition_fang(labels, n_clients, noniid, rng)
    if kind == "dirichlet":
        return partition_dirichlet(labels, n_clients, noniid, rng)
    raise ConfigError("partition", f"unknown partition {kind!r}; allowed: iid, fang, dirichlet")


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

    def __init__(self, dataset: str, data_dir: str | None, n_clients: int, clients: range,
                 kind: str, noniid: float, seed: int, server_samples: int = 0):
        self.n_clients = n_clients
        self.clients = clients
        self.server = None  # the server's small clean set (FLTrust, Zeno++), when asked for

        data = DATASETS.build(dataset, {}, key="dataset", data_dir=data_dir)
        labels = data.train_labels()
        parts = _checked(partition(labels, n_clients, kind, noniid, seed))
        mine = np.sort(np.concatenate([parts[c] for c in clients]))
        images = data.train_images(mine)
        where = {int(s): k for k, s in enumerate(mine)}
        self.shards = []
        for c in clients:
            rows = np.fromiter((where[int(s)] for s in parts[c]), np.int64, len(parts[c]))
            self.shards.append(Shard(images[rows], labels[parts[c]]))
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
