"""EMNIST (Cohen, Afshar, Tapson, van Schaik 2017) from the IDX files of its six splits.

One data set per split, ``emnist-<split>``. The files are NIST's "binary format" download
(``gzip.zip``, whose folder ``gzip/`` holds ``emnist-<split>-train-images-idx3-ubyte.gz`` and
the like), read gzipped or unpacked. EMNIST stores each image transposed (the rows of the file
are the columns of the character); reading turns it upright, the orientation of MNIST.
"""

from __future__ import annotations

from . import DATASETS
from .idx import IdxDataset

#: split: (classes, training samples, test samples, what the labels are), from the EMNIST paper
#: (Table II) and the files' mapping tables
SPLITS = {
    "byclass": (62, 697_932, 116_323, "digits 0-9, upper-case A-Z, lower-case a-z"),
    "bymerge": (47, 697_932, 116_323, "digits, upper-case, and the 11 lower-case letters unlike their capital"),
    "balanced": (47, 112_800, 18_800, "the classes of bymerge, balanced"),
    "letters": (26, 124_800, 20_800, "letters A-Z, upper- and lower-case merged; stored 1-26, read as 0-25"),
    "digits": (10, 240_000, 40_000, "digits 0-9"),
    "mnist": (10, 60_000, 10_000, "digits 0-9, MNIST's sizes"),
}


class EMNIST(IdxDataset):
    """EMNIST split ``SPLIT``: 28x28 grey images of handwritten characters (:data:`SPLITS`),
    read from ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` (``.gz`` or not)
    in ``--data-dir``, else ``$FEDRING_EMNIST``, else ``./emnist``. Images are turned upright
    (the files store them transposed); pixels scaled to [0, 1]; labels 0..classes-1 (the
    letters split stores 1..26 and is read as 0..25)."""

    SPLIT = ""
    TITLE = "EMNIST"
    ENV = "FEDRING_EMNIST"
    DEFAULT_DIR = "emnist"
    HOW_TO_GET = (
        "download gzip.zip (the binary format) from https://www.nist.gov/itl/products-and-services/emnist-dataset "
        "and unpack it: its folder gzip/ holds the files"
    )
    TRANSPOSED = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.SPLIT:
            cls.name = f"emnist-{cls.SPLIT}"
            cls.classes, cls.train_samples = SPLITS[cls.SPLIT][:2]
            cls.TITLE = f"EMNIST {cls.SPLIT}"
            cls.LABEL_OFFSET = 1 if cls.SPLIT == "letters" else 0
            prefix = f"emnist-{cls.SPLIT}"
            cls.FILES = {
                "train_images": f"{prefix}-train-images-idx3-ubyte",
                "train_labels": f"{prefix}-train-labels-idx1-ubyte",
                "test_images": f"{prefix}-test-images-idx3-ubyte",
                "test_labels": f"{prefix}-test-labels-idx1-ubyte",
            }


@DATASETS.register
class EMNISTByClass(EMNIST):
    """EMNIST ByClass: 62 unbalanced classes (digits, upper- and lower-case letters)."""

    SPLIT = "byclass"


@DATASETS.register
class EMNISTByMerge(EMNIST):
    """EMNIST ByMerge: 47 unbalanced classes (the lower-case letters like their capital merged)."""

    SPLIT = "bymerge"


@DATASETS.register
class EMNISTBalanced(EMNIST):
    """EMNIST Balanced: the 47 classes of ByMerge, 2,400 training samples each."""

    SPLIT = "balanced"


@DATASETS.register
class EMNISTLetters(EMNIST):
    """EMNIST Letters: 26 balanced classes, A-Z (upper and lower case together)."""

    SPLIT = "letters"


@DATASETS.register
class EMNISTDigits(EMNIST):
    """EMNIST Digits: 10 balanced classes, 24,000 training samples each."""

    SPLIT = "digits"


@DATASETS.register
class EMNISTMnist(EMNIST):
    """EMNIST MNIST: 10 classes with MNIST's balance and sizes (60,000 / 10,000)."""

    SPLIT = "mnist"
