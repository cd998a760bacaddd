"""Fashion-MNIST (Xiao, Rasul, Vollgraf 2017) from its IDX files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset
from .idx import read_idx

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


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
