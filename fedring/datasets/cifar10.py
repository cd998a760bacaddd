"""CIFAR-10 (Krizhevsky 2009) from the standard "python version" files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: ``(images (k, 3, 32, 32) uint8, labels (k,) int64)``."""
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(batch[b"labels"], dtype=np.int64)


def write_batch(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write a batch in the same format (tests make small data sets with it)."""
    with open(path, "wb") as f:
        pickle.dump({b"data": images.reshape(len(images), -1).astype(np.uint8), b"labels": list(map(int, labels))}, f)


@DATASETS.register
class CIFAR10(Dataset):
    """CIFAR-10: 50,000 training and 10,000 test 32x32 colour images of 10 classes, read from
    the folder ``cifar-10-batches-py`` of the "python version" archive (``data_batch_1`` ..
    ``data_batch_5``, ``test_batch``): ``--data-dir`` or ``$FEDRING_CIFAR10``. Pixels scaled
    to [0, 1]; a rank keeps only the rows it needs, reading one batch file at a time.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> for name in (*TRAIN_FILES, TEST_FILE):
    ...     write_batch(root / name, np.full((2, 3, 32, 32), 255, np.uint8), [3, 7])
    >>> c = CIFAR10(str(root))
    >>> c.train_labels().tolist(), c.train_images(np.array([1, 9])).shape, float(c.test_images(np.array([0])).max())
    ([3, 7, 3, 7, 3, 7, 3, 7, 3, 7], (2, 3, 32, 32), 1.0)
    """

    name = "cifar10"
    train_samples = 50_000
    shape = (3, 32, 32)
    model = "cnn_cifar"

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        self.root = Path(data_dir or os.environ.get("FEDRING_CIFAR10") or "cifar-10-batches-py")
        missing = [name for name in (*TRAIN_FILES, TEST_FILE) if not (self.root / name).is_file()]
        if missing:
            raise ConfigError("data_dir", f"CIFAR-10 files {', '.join(missing)} not found in {self.root}: pass the "
                                          "cifar-10-batches-py folder of the python version as --data-dir "
                                          "(or set FEDRING_CIFAR10)")

    def _rows(self, files, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        images, labels, start = [], [], 0
        for name in files:
            x, y = read_batch(self.root / name)
            keep = slice(None) if rows is None else rows[(rows >= start) & (rows < start + len(y))] - start
            images.append(x[keep])
            labels.append(y[keep])
            start += len(y)
        return np.concatenate(images), np.concatenate(labels)

    def train_labels(self) -> np.ndarray:
        return np.concatenate([read_batch(self.root / name)[1] for name in TRAIN_FILES])

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._rows(TRAIN_FILES, np.asarray(rows))[0].astype(np.float32) / np.float32(255.0)

    def test_labels(self) -> np.ndarray:
        return read_batch(self.root / TEST_FILE)[1]

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._rows((TEST_FILE,), np.asarray(rows))[0].astype(np.float32) / np.float32(255.0)
