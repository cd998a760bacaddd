"""A small synthetic image set for tests and quick runs (no files)."""

from __future__ import annotations

import numpy as np

from fedring.rng import Stream, generator

from . import DATASETS, Dataset


@DATASETS.register
class Synthetic(Dataset):
    """10 classes of 28x28 images: a fixed random binary pattern per class plus uniform noise.

    ``x = 0.6 * pattern[y] + 0.4 * U(0, 1)``; 4,000 training and 1,000 test images, generated in
    full from a constant seed (not the run's), so every run and every rank sees the same set;
    small enough (16 MB) to build on every rank.

    >>> s = Synthetic()
    >>> s.train_labels()[:5].tolist(), s.test_images(np.arange(2)).shape
    ([7, 7, 5, 8, 2], (2, 1, 28, 28))
    """

    name = "synthetic"
    train_samples = 4000

    def __init__(self, data_dir: str | None = None, n_train: int = train_samples, n_test: int = 1000):
        super().__init__(data_dir)
        rng = generator(2024, Stream.SYNTHETIC)
        patterns = (rng.random((self.classes, *self.shape)) < 0.5).astype(np.float32)

        def draw(n):
            y = rng.integers(0, self.classes, n)
            x = 0.6 * patterns[y] + 0.4 * rng.random((n, *self.shape), dtype=np.float32)
            return x.astype(np.float32), y.astype(np.int64)

        (self._x, self._y), (self._tx, self._ty) = draw(n_train), draw(n_test)

    def train_labels(self) -> np.ndarray:
        return self._y

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._x[rows]

    def test_labels(self) -> np.ndarray:
        return self._ty

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._tx[rows]
