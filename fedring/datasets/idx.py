"""IDX files (LeCun's MNIST format, gzipped or not), shared by the MNIST family of data sets.

:func:`read_idx` streams a file and keeps the rows asked for. :class:`IdxDataset` is the base of
MNIST and EMNIST: four files (training and test images and labels), each found as ``NAME`` or
``NAME.gz``, checked when the data set is opened (type, shape, and that images and labels have
as many rows) and when labels are read (their range); every fault is one
:class:`~fedring.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np

from fedring.errors import ConfigError

from . import Dataset

_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _idx_header(f) -> tuple[np.dtype, tuple[int, ...]]:
    magic = f.read(4)
    if len(magic) != 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise ValueError("not an IDX file (bad magic number)")
    ndim = magic[3]
    shape = tuple(int.from_bytes(f.read(4), "big") for _ in range(ndim))
    return np.dtype(_IDX_DTYPES[magic[2]]), shape


def _open(path: str | Path):
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def read_idx(path: str | Path, rows: np.ndarray | None = None, block: int = 4096) -> np.ndarray:
    """Read an IDX file (optionally gzipped), keeping only ``rows`` (sorted indices) if given.

    Streams the file block by block, so reading a few rows of a large file needs little memory.
    """
    with _open(path) as f:
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


#: what a damaged file raises while it is read: a bad magic number or a short file (ValueError),
#: a truncated gzip stream (EOFError), a bad gzip header or CRC (OSError, zlib.error)
READ_ERRORS = (ValueError, EOFError, OSError, zlib.error)


def idx_header(path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """The element type and shape that an IDX file's header declares; a bad header is a ConfigError."""
    try:
        with _open(path) as f:
            dtype, shape = _idx_header(f)
    except READ_ERRORS as e:
        raise ConfigError("data_dir", f"{path} is not an IDX file: {type(e).__name__}: {e}") from None
    if len(shape) == 0:
        raise ConfigError("data_dir", f"{path} is not an IDX file: its header declares no dimension")
    return dtype, shape


def read_idx_checked(path: Path, rows: np.ndarray | None = None) -> np.ndarray:
    """:func:`read_idx`, with a damaged file (short, bad gzip stream) as a ConfigError naming it."""
    try:
        return read_idx(path, rows)
    except READ_ERRORS as e:
        raise ConfigError("data_dir", f"{path} is damaged: {type(e).__name__}: {e}") from None


def find_idx(root: Path, name: str) -> Path | None:
    """``root/NAME`` or ``root/NAME.gz`` (the published files come gzipped; many tools unpack them)."""
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.is_file():
            return candidate
    return None


class IdxDataset(Dataset):
    """A data set of 28x28 grey images in four IDX files (``FILES``: the file names without
    ``.gz``), read from ``--data-dir``, else ``$ENV``, else ``DEFAULT_DIR``.

    ``TRANSPOSED``: the files store each image transposed (EMNIST), and reading turns it
    upright. ``LABEL_OFFSET`` is subtracted from the stored labels (EMNIST Letters stores
    1..26), which must then lie in ``[0, classes)``.
    """

    TITLE = ""
    ENV = ""
    DEFAULT_DIR = ""
    HOW_TO_GET = ""
    FILES: ClassVar[dict[str, str]] = {}
    TRANSPOSED = False
    LABEL_OFFSET = 0

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        self.root = Path(data_dir or os.environ.get(self.ENV) or self.DEFAULT_DIR)
        found = {role: find_idx(self.root, name) for role, name in self.FILES.items()}
        missing = [self.FILES[role] for role, path in found.items() if path is None]
        if missing:
            raise ConfigError(
                "data_dir",
                f"{self.TITLE} files {', '.join(missing)} (or .gz) not found in {self.root}: "
                f"{self.HOW_TO_GET}; pass their folder as --data-dir or set {self.ENV}",
            )
        self.paths: dict[str, Path] = {role: path for role, path in found.items() if path is not None}
        for part in ("train", "test"):
            self._check_pair(self.paths[f"{part}_images"], self.paths[f"{part}_labels"])

    def _check_pair(self, images: Path, labels: Path) -> None:
        """Images: uint8 (n, 28, 28); labels: uint8 (n,); the same n."""
        (xt, xs), (yt, ys) = idx_header(images), idx_header(labels)
        if xt != np.uint8 or len(xs) != 3 or xs[1:] != self.shape[1:]:
            raise ConfigError(
                "data_dir",
                f"{images} holds {xt.name} {xs}, not {self.TITLE} images: expected uint8 (n, 28, 28)",
            )
        if yt != np.uint8 or len(ys) != 1:
            raise ConfigError(
                "data_dir", f"{labels} holds {yt.name} {ys}, not {self.TITLE} labels: expected uint8 (n,)"
            )
        if xs[0] != ys[0]:
            raise ConfigError("data_dir", f"{images} has {xs[0]} images but {labels} has {ys[0]} labels")

    def _labels(self, role: str) -> np.ndarray:
        path = self.paths[role]
        y = read_idx_checked(path).astype(np.int64) - self.LABEL_OFFSET
        bad = np.flatnonzero((y < 0) | (y >= self.classes))
        if len(bad):
            lo, hi = self.LABEL_OFFSET, self.classes - 1 + self.LABEL_OFFSET
            raise ConfigError(
                "data_dir",
                f"{path} has label {int(y[bad[0]]) + self.LABEL_OFFSET} at row {int(bad[0])}: "
                f"{self.TITLE} labels are {lo}..{hi}",
            )
        return y

    def _images(self, role: str, rows: np.ndarray) -> np.ndarray:
        x = read_idx_checked(self.paths[role], np.asarray(rows))
        if self.TRANSPOSED:
            x = x.transpose(0, 2, 1)
        return (x.astype(np.float32) / np.float32(255.0))[:, None, :, :]

    def train_labels(self) -> np.ndarray:
        return self._labels("train_labels")

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("train_images", rows)

    def test_labels(self) -> np.ndarray:
        return self._labels("test_labels")

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._images("test_images", rows)
