"""CIFAR-100 (Krizhevsky 2009) from the "python version" files, with its fine or coarse labels."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset
from .cifar10 import DataUnpickler

FOLDER = "cifar-100-python"
FILES = ("train", "test", "meta")


def _get(d: dict, key: str):
    """``d[key]`` under its Python 2 name (bytes: the published files, read with encoding="bytes")
    or its Python 3 one (a file pickled again from Python 3)."""
    if key.encode() in d:
        return d[key.encode()]
    return d[key]


def read_pickle(path: Path) -> dict:
    """A CIFAR-100 file as a dict, through :class:`~fedring.datasets.cifar10.DataUnpickler` (a pickle
    naming anything but numpy arrays is refused before it runs); any fault is a ConfigError."""
    try:
        with open(path, "rb") as f:
            data = DataUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ConfigError("data_dir", f"{path} is not a CIFAR-100 file, refused: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("data_dir", f"{path} is not a CIFAR-100 file: it holds a {type(data).__name__}, not a dict")
    return data


class CIFAR100(Dataset):
    """CIFAR-100: 50,000 training and 10,000 test 32x32 colour images, with a fine label (100
    classes) and a coarse one (20 superclasses), read from the folder ``cifar-100-python`` of the
    "python version" archive (``train``, ``test``, ``meta``): ``--data-dir`` (that folder or the
    one holding it), else ``$FEDRING_CIFAR100``, else ``./cifar-100-python``. ``LABELS`` picks
    the labels (``fine_labels`` or ``coarse_labels``). Pixels scaled to [0, 1]."""

    train_samples = 50_000
    shape = (3, 32, 32)
    # a ResNet, as the robustness papers that train CIFAR-100 use (docs/models.md)
    model = "resnet18_gn"
    LABELS = ""
    NAMES = ""  # the key of meta's class names

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        root = Path(data_dir or os.environ.get("FEDRING_CIFAR100") or FOLDER)
        if not (root / "train").is_file() and (root / FOLDER).is_dir():
            root = root / FOLDER
        self.root = root
        missing = [name for name in FILES if not (root / name).is_file()]
        if missing:
            raise ConfigError(
                "data_dir",
                f"CIFAR-100 files {', '.join(missing)} not found in {root}: download cifar-100-python.tar.gz "
                "(https://www.cs.toronto.edu/~kriz/cifar.html), unpack it and pass its folder cifar-100-python "
                "as --data-dir (or set FEDRING_CIFAR100)",
            )
        meta = read_pickle(root / "meta")
        try:
            names = _get(meta, self.NAMES)
        except KeyError:
            raise ConfigError("data_dir", f"{root / 'meta'} has no {self.NAMES}: not CIFAR-100's meta file") from None
        if not isinstance(names, list) or len(names) != self.classes:
            count = len(names) if isinstance(names, list) else type(names).__name__
            raise ConfigError("data_dir", f"{root / 'meta'} lists {count} {self.NAMES}, CIFAR-100 has {self.classes}")
        self.class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    def _read(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(images (k, 3072) uint8, labels (k,) int64)`` of file ``name``, checked."""
        path = self.root / name
        batch = read_pickle(path)
        try:
            data, labels = _get(batch, "data"), _get(batch, self.LABELS)
        except KeyError as e:
            raise ConfigError("data_dir", f"{path} has no {e}: not a CIFAR-100 train or test file") from None
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
            raise ConfigError("data_dir", f"{path}: data is {what}, expected uint8 (n, 3072)")
        try:
            y = np.asarray(labels, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            y = np.empty(0, np.int64)
        if y.shape != (len(data),):
            raise ConfigError("data_dir", f"{path}: {self.LABELS} is not a list of {len(data)} integers, one per image")
        bad = np.flatnonzero((y < 0) | (y >= self.classes))
        if len(bad):
            raise ConfigError(
                "data_dir",
                f"{path} has {self.LABELS} {int(y[bad[0]])} at row {int(bad[0])}: they are 0..{self.classes - 1}",
            )
        return data, y

    def _images(self, name: str, rows: np.ndarray) -> np.ndarray:
        data = self._read(name)[0][np.asarray(rows)]
        return data.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255.0)

    def train_labels(self) -> np.ndarray:
        return self._read("train")[1]

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("train", rows)

    def test_labels(self) -> np.ndarray:
        return self._read("test")[1]

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("test", rows)


@DATASETS.register
class CIFAR100Fine(CIFAR100):
    """CIFAR-100 with its 100 fine classes (``fine_labels``)."""

    name = "cifar100"
    classes = 100
    LABELS = "fine_labels"
    NAMES = "fine_label_names"


@DATASETS.register
class CIFAR100Coarse(CIFAR100):
    """CIFAR-100 with its 20 superclasses (``coarse_labels``)."""

    name = "cifar100-coarse"
    classes = 20
    LABELS = "coarse_labels"
    NAMES = "coarse_label_names"
