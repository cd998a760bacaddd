"""SVHN (Netzer et al. 2011), the cropped-digits format: ``train_32x32.mat`` and ``test_32x32.mat``."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset

FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}


def loadmat(path: Path, names: list[str]) -> dict:
    """The variables ``names`` of a MATLAB v5 file (scipy.io.loadmat); a fault is a ConfigError."""
    try:
        from scipy.io import loadmat as _loadmat
        from scipy.io.matlab import MatReadError
    except ImportError:
        raise ConfigError(
            "dataset", "svhn reads MATLAB files with scipy: pip install scipy (or fedring[datasets])"
        ) from None
    try:
        mat = _loadmat(path, variable_names=names)
    except (MatReadError, ValueError, TypeError, NotImplementedError, OSError, EOFError, zlib.error) as e:
        raise ConfigError("data_dir", f"{path} is not a MATLAB v5 file: {type(e).__name__}: {e}") from None
    missing = [n for n in names if n not in mat]
    if missing:
        raise ConfigError("data_dir", f"{path} has no variable {', '.join(missing)}: not an SVHN 32x32 file")
    return mat


@DATASETS.register
class SVHN(Dataset):
    """SVHN, cropped digits: 73,257 training and 26,032 test 32x32 colour images of house-number
    digits, read from ``train_32x32.mat`` and ``test_32x32.mat`` (MATLAB v5: ``X`` uint8
    (32, 32, 3, n), ``y`` (n, 1) with 1..10, 10 meaning the digit 0) in ``--data-dir``, else
    ``$FEDRING_SVHN``, else ``./svhn``. Labels are the digits 0-9; pixels scaled to [0, 1].
    ``extra_32x32.mat`` (531,131 easier samples) is not read. Needs scipy."""

    name = "svhn"
    train_samples = 73_257
    shape = (3, 32, 32)
    model = "cnn_cifar"

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        self.root = Path(data_dir or os.environ.get("FEDRING_SVHN") or "svhn")
        missing = [name for name in FILES.values() if not (self.root / name).is_file()]
        if missing:
            raise ConfigError(
                "data_dir",
                f"SVHN files {', '.join(missing)} not found in {self.root}: download them (format 2, cropped "
                "digits) from http://ufldl.stanford.edu/housenumbers/ and pass their folder as --data-dir "
                "(or set FEDRING_SVHN)",
            )

    def _labels(self, part: str) -> np.ndarray:
        path = self.root / FILES[part]
        y = np.asarray(loadmat(path, ["y"])["y"])
        if y.ndim not in (1, 2) or (y.ndim == 2 and 1 not in y.shape) or y.dtype.kind not in "uif":
            raise ConfigError("data_dir", f"{path}: y is {y.dtype} {y.shape}, expected (n, 1) labels 1..10")
        y = y.reshape(-1)
        bad = np.flatnonzero((y < 1) | (y > 10) | (y != np.round(y)))
        if len(bad):
            raise ConfigError("data_dir", f"{path} has label {y[bad[0]]} at row {int(bad[0])}: SVHN's labels are 1..10")
        return y.astype(np.int64) % 10

    def _images(self, part: str, rows: np.ndarray) -> np.ndarray:
        path = self.root / FILES[part]
        mat = loadmat(path, ["X", "y"])
        x, n = np.asarray(mat["X"]), np.size(mat["y"])
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
            raise ConfigError("data_dir", f"{path}: X is {x.dtype} {x.shape}, expected uint8 (32, 32, 3, n)")
        if x.shape[3] != n:
            raise ConfigError("data_dir", f"{path} has {x.shape[3]} images in X but {n} labels in y")
        return x[..., np.asarray(rows)].transpose(3, 2, 0, 1).astype(np.float32) / np.float32(255.0)

    def train_labels(self) -> np.ndarray:
        return self._labels("train")

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("train", rows)

    def test_labels(self) -> np.ndarray:
        return self._labels("test")

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("test", rows)
