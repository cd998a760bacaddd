"""Labelled image data sets for training, one module each (discovered on import).

A data set is a :class:`Dataset` registered in :data:`DATASETS` (``--dataset NAME``). Every
rank reads the training labels (small) to compute the partition, then only the images of the
clients it hosts (:class:`fedring.train.data.FederatedData`), so no rank holds the whole set.
A new data set is one new module here (``docs/contributing.md``).
"""

from __future__ import annotations

import numpy as np

from fedring.registry import Registry

DATASETS = Registry("dataset")


@DATASETS.base
class Dataset:
    """Base of the data sets: images as float32 in [0, 1], shape ``(k, *shape)``; labels int64.

    Parameters come from the run: ``data_dir`` (``--data-dir``; each data set has its own
    default location). ``model`` is the model that fits its images by default;
    ``train_samples`` is the size of its training set (a run has at most that many clients;
    None where it depends on how the files were made, as for LEAF's).

    A text data set's samples are sequences, not images: ``shape`` is ``(length,)`` and
    ``train_images``/``test_images`` return int64 token indices of shape ``(k, length)``
    (``shakespeare``).

    Optional: :meth:`train_users` and :meth:`test_users`, the user (writer, speaking role) of
    each sample, for data sets that record one (LEAF's); the others return None. A natural
    partition reads the users, not the labels, and then a rank's own rows through
    :meth:`train_rows` and :meth:`test_rows`.
    """

    name = ""
    train_samples: int | None = None
    shape: tuple[int, ...] = (1, 28, 28)
    classes = 10
    model = "cnn"

    def __init__(self, data_dir: str | None = None):
        self.data_dir = data_dir

    def train_labels(self) -> np.ndarray:
        raise NotImplementedError

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        """The training images of the sorted sample indices ``rows``."""
        raise NotImplementedError

    def test_labels(self) -> np.ndarray:
        raise NotImplementedError

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def train_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The training samples and labels of the sorted sample indices ``rows``, for a partition
        that needs no labels of other rows (``natural``). By default :meth:`train_images` and
        :meth:`train_labels` at ``rows``; a data set that can read some rows' labels without all of
        them overrides it (LEAF's)."""
        return self.train_images(rows), self.train_labels()[rows]

    def test_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The test samples and labels of the sorted sample indices ``rows``; as :meth:`train_rows`."""
        return self.test_images(rows), self.test_labels()[rows]

    def train_users(self) -> np.ndarray | None:
        """Optional: the user of each training sample as an int64 id, parallel to
        :meth:`train_labels` (the same id is the same user in :meth:`test_users`), for a natural
        partition that gives each client the samples of one user. None (the default): the data
        set records no users."""
        return None

    def test_users(self) -> np.ndarray | None:
        """Optional: the user of each test sample, parallel to :meth:`test_labels`; None by default."""
        return None


DATASETS.discover(__name__, __path__)
