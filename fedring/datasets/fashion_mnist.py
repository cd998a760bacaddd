"""Fashion-MNIST (Xiao, Rasul, Vollgraf 2017) from its IDX files."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


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
            hi = int(np.searchsorted(rows, stop))
            if hi > done:
                part = np.frombuffer(buf, dtype=dtype).reshape(stop - start, *row_shape)
                out[done:hi] = part[rows[done:hi] - start]
                done = hi
            if done == len(rows):
                break
        return out


def fmnist_dir(data_dir: str | None) -> Path:
    """Where the Fashion-MNIST IDX files are: ``--data-dir``, ``$FEDRING_DATA``, or Debian's path."""
    path = Path(data_dir or os.environ.get("FEDRING_DATA") or DEFAULT_DIR)
    missing = [name for name in FILES.values() if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            "data_dir",
            f"Fashion-MNIST files {', '.join(missing)} not found in {path}. On Debian: "
            f"`apt-get install -y dataset-fashion-mnist` (installs them in {DEFAULT_DIR}); "
            "elsewhere put the four IDX .gz files in a folder and pass --data-dir or set FEDRING_DATA",
        )
    return path


def _to_float(images: np.ndarray) -> np.ndarray:
    return (images.astype(np.float32) / 255.0)[:, None, :, :]


@DATASETS.register
class FashionMNIST(Dataset):
    """Fashion-MNIST: 60,000 training and 10,000 test 28x28 grey images of 10 clothing classes,
    read from the four IDX ``.gz`` files (``--data-dir``, ``$FEDRING_DATA``, or Debian's
    ``dataset-fashion-mnist`` package). Pixels scaled to [0, 1]."""

    name = "fashion-mnist"
    train_samples = 60_000

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        self.root = fmnist_dir(data_dir)

    def train_labels(self) -> np.ndarray:
        return read_idx(self.root / FILES["train_labels"]).astype(np.int64)

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return _to_float(read_idx(self.root / FILES["train_images"], rows))

    def test_labels(self) -> np.ndarray:
        return read_idx(self.root / FILES["test_labels"]).astype(np.int64)

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return _to_float(read_idx(self.root / FILES["test_images"], rows))
