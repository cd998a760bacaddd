"""Data sets and their partition over clients.

Every rank computes the same partition from the labels alone (small), then loads only the
images of the clients it hosts, so no rank ever holds the whole training set.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedring.comm import block_bounds
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

DEFAULT_FMNIST_DIR = "/usr/share/datasets/fashion-mnist"
FMNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
NUM_CLASSES = 10
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass
class Shard:
    """Samples of one client (or one evaluation slice): float32 images in [0, 1] and int64 labels."""

    x: np.ndarray
    y: np.ndarray


def _idx_header(f) -> tuple[np.dtype, tuple[int, ...]]:
    magic = f.read(4)
    if len(magic) != 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise ValueError("not an IDX file (bad magic number)")
    ndim = magic[3]
    shape = tuple(int.from_bytes(f.read(4), "big") for _ in range(ndim))
    return np.dtype(_IDX_DTYPES[magic[2]]), shape


def read_idx(path: str | Path, rows: np.ndarray | None = None, block: int = 4096) -> np.ndarray:
    """Read an IDX file (optionally gzipped), keeping only ``rows`` (sorted indices) if given.

    Streams the file block by block, so reading a few rows of a large file needs little memory.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        dtype, shape = _idx_header(f)
        row_shape, row_bytes = shape[1:], int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if rows is None:
            data = np.frombuffer(f.read(shape[0] * row_bytes), dtype=dtype)
            return data.reshape(shape).astype(dtype.newbyteorder("="))
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), *row_shape), dtype.newbyteorder("="))
        done = 0
        for start in range(0, shape[0], block):
            stop = min(start + block, shape[0])
            buf = f.read((stop - start) * row_bytes)
            hi = np.searchsorted(rows, stop)
            if hi > done:
                part = np.frombuffer(buf, dtype=dtype).reshape(stop - start, *row_shape)
                out[done:hi] = part[rows[done:hi] - start]
                done = hi
            if done == len(rows):
                break
        return out


def fmnist_dir(data_dir: str | None) -> Path:
    """Where the Fashion-MNIST IDX files are: ``--data-dir``, ``$FEDRING_DATA``, or Debian's path."""
    path = Path(data_dir or os.environ.get("FEDRING_DATA") or DEFAULT_FMNIST_DIR)
    missing = [name for name in FMNIST_FILES.values() if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            "data_dir",
            f"Fashion-MNIST files {', '.join(missing)} not found in {path}. On Debian: "
            f"`apt-get install -y dataset-fashion-mnist` (installs them in {DEFAULT_FMNIST_DIR}); "
            "elsewhere put the four IDX .gz files in a folder and pass --data-dir or set FEDRING_DATA",
        )
    return path


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


# ---------------------------------------------------------------------------------------
# Data sets


def synthetic_set(seed: int, n_train: int = 4000, n_test: int = 1000) -> tuple[Shard, Shard]:
    """A small 10-class set of 28x28 images: a fixed random binary pattern per class plus noise.

    Generated in full from a seed that does not depend on the run's seed, so every run and
    every rank sees the same data set; it is small enough (16 MB) to build on every rank.
    """
    rng = generator(2024, Stream.SYNTHETIC)
    protos = (rng.random((NUM_CLASSES, 1, 28, 28)) < 0.5).astype(np.float32)

    def draw(n):
        y = rng.integers(0, NUM_CLASSES, n)
        x = 0.6 * protos[y] + 0.4 * rng.random((n, 1, 28, 28), dtype=np.float32)
        return Shard(x.astype(np.float32), y.astype(np.int64))

    return draw(n_train), draw(n_test)


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

        def server_rows(n_train: int) -> np.ndarray:
            return np.sort(generator(seed, Stream.SERVER_DATA).permutation(n_train)[:server_samples])

        if dataset == "synthetic":
            train, test = synthetic_set(seed)
            parts = _checked(partition(train.y, n_clients, kind, noniid, seed))
            self.shards = [Shard(train.x[parts[c]], train.y[parts[c]]) for c in clients]
            if server_samples:
                rows = server_rows(len(train.y))
                self.server = Shard(train.x[rows], train.y[rows])
            bounds = block_bounds(len(test.y), n_clients)
            lo, hi = bounds[clients.start], bounds[clients.stop]
            self.test_bounds = bounds[clients.start : clients.stop + 1] - lo
            self.test = Shard(test.x[lo:hi], test.y[lo:hi])
        elif dataset == "fashion-mnist":
            root = fmnist_dir(data_dir)
            labels = read_idx(root / FMNIST_FILES["train_labels"]).astype(np.int64)
            parts = _checked(partition(labels, n_clients, kind, noniid, seed))
            mine = np.sort(np.concatenate([parts[c] for c in clients]))
            images = read_idx(root / FMNIST_FILES["train_images"], mine)
            where = {int(s): k for k, s in enumerate(mine)}
            self.shards = []
            for c in clients:
                rows = np.fromiter((where[int(s)] for s in parts[c]), np.int64, len(parts[c]))
                self.shards.append(Shard(_to_float(images[rows]), labels[parts[c]]))
            if server_samples:
                rows = server_rows(len(labels))
                self.server = Shard(_to_float(read_idx(root / FMNIST_FILES["train_images"], rows)), labels[rows])
            test_labels = read_idx(root / FMNIST_FILES["test_labels"]).astype(np.int64)
            bounds = block_bounds(len(test_labels), n_clients)
            lo, hi = int(bounds[clients.start]), int(bounds[clients.stop])
            self.test_bounds = bounds[clients.start : clients.stop + 1] - lo
            self.test = Shard(
                _to_float(read_idx(root / FMNIST_FILES["test_images"], np.arange(lo, hi))), test_labels[lo:hi]
            )
        else:
            raise ConfigError("dataset", f"unknown data set {dataset!r}; allowed: fashion-mnist, synthetic")

    def test_slice(self, k: int) -> Shard:
        """Test samples evaluated for the k-th local client."""
        a, b = self.test_bounds[k], self.test_bounds[k + 1]
        return Shard(self.test.x[a:b], self.test.y[a:b])


def _to_float(images: np.ndarray) -> np.ndarray:
    return (images.astype(np.float32) / 255.0)[:, None, :, :]
