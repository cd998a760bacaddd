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


#: the only globals a batch file's pickle may name: numpy's array reconstruction (under numpy 1's
#: and numpy 2's module names), and ``_codecs.encode``, with which protocol 2 stores bytes
ALLOWED_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }
)


class DataUnpickler(pickle.Unpickler):
    r"""Reads pickled data and nothing else: dicts, lists, bytes, str, numbers and numpy arrays.

    A pickle may name any importable callable and call it on load (``os.system`` ...); this one
    resolves only :data:`ALLOWED_GLOBALS`, so a crafted file is refused before anything runs.

    >>> import io
    >>> DataUnpickler(io.BytesIO(b"cos\nsystem\n(S'echo pwned'\ntR.")).load()
    Traceback (most recent call last):
    _pickle.UnpicklingError: the pickle names os.system; a data file holds only dicts, lists, bytes, str, numbers and numpy arrays
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"the pickle names {module}.{name}; a data file holds only dicts, lists, "
                "bytes, str, numbers and numpy arrays"
            )
        return super().find_class(module, name)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: ``(images (k, 3, 32, 32) uint8, labels (k,) int64)``; a file that is not a
    batch, or names anything but numpy arrays (:class:`DataUnpickler`), is a ConfigError."""
    try:
        with open(path, "rb") as f:
            batch = DataUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return data, np.asarray(batch[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ConfigError(
            "data_dir", f"{path} is not a CIFAR-10 batch file, refused: {type(e).__name__}: {e}"
        ) from None


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
            raise ConfigError(
                "data_dir",
                f"CIFAR-10 files {', '.join(missing)} not found in {self.root}: pass the "
                "cifar-10-batches-py folder of the python version as --data-dir "
                "(or set FEDRING_CIFAR10)",
            )

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
