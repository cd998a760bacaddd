"""Tiny-ImageNet (Le and Yang 2015, Stanford CS231n): 200 ImageNet classes at 64x64, from the
folder of ``tiny-imagenet-200.zip``. Decoding its JPEGs needs Pillow."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset

FOLDER = "tiny-imagenet-200"
IMAGE_SUFFIXES = (".jpeg", ".jpg")


def decode(paths: list[Path]) -> np.ndarray:
    """The 64x64 images ``paths`` as uint8 ``(k, 3, 64, 64)``; a grey image (Tiny-ImageNet has
    some) gets three equal channels. A file that is not a 64x64 image is a ConfigError."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "dataset", "tiny-imagenet decodes JPEG with Pillow: pip install pillow (or fedring[datasets])"
        ) from None
    out = np.empty((len(paths), 3, 64, 64), np.uint8)
    for k, path in enumerate(paths):
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise ConfigError("data_dir", f"{path} is not an image: {type(e).__name__}: {e}") from None
        if rgb.size != (64, 64):
            raise ConfigError("data_dir", f"{path} is {rgb.size[0]}x{rgb.size[1]}, Tiny-ImageNet's images are 64x64")
        out[k] = np.asarray(rgb).transpose(2, 0, 1)
    return out


@DATASETS.register
class TinyImageNet(Dataset):
    """Tiny-ImageNet: 100,000 training images (500 per class) and 10,000 validation images of 200
    classes, 64x64 colour, read from the folder ``tiny-imagenet-200``: ``--data-dir`` (that
    folder or the one holding it), else ``$FEDRING_TINY_IMAGENET``, else ``./tiny-imagenet-200``.

    The classes are the wnids of ``wnids.txt`` in sorted order (class k is the k-th smallest
    wnid, as torchvision's ``ImageFolder`` numbers the folders ``train/<wnid>``). Training
    samples: ``train/<wnid>/images/*.JPEG``, class by class, files in sorted order. The test set
    is the labelled validation set, ``val/images/*.JPEG`` in the order of
    ``val/val_annotations.txt`` (file, wnid, box); the ``test/`` images have no labels and are not
    read. Pixels scaled to [0, 1]; only the rows asked for are decoded.
    """

    name = "tiny-imagenet"
    train_samples = 100_000
    shape = (3, 64, 64)
    classes = 200
    model = "resnet18_gn_64"

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        root = Path(data_dir or os.environ.get("FEDRING_TINY_IMAGENET") or FOLDER)
        if not (root / "wnids.txt").is_file() and (root / FOLDER).is_dir():
            root = root / FOLDER
        self.root = root
        needed = ("wnids.txt", "train", "val/images", "val/val_annotations.txt")
        missing = [name for name in needed if not (root / name).exists()]
        if missing:
            raise ConfigError(
                "data_dir",
                f"Tiny-ImageNet's {', '.join(missing)} not found in {root}: download tiny-imagenet-200.zip "
                "(http://cs231n.stanford.edu/tiny-imagenet-200.zip), unpack it and pass its folder "
                "tiny-imagenet-200 as --data-dir (or set FEDRING_TINY_IMAGENET)",
            )
        wnids = (root / "wnids.txt").read_text().split()
        if len(wnids) != self.classes or len(set(wnids)) != len(wnids):
            raise ConfigError(
                "data_dir",
                f"{root / 'wnids.txt'} lists {len(wnids)} wnids ({len(set(wnids))} distinct): Tiny-ImageNet has "
                f"{self.classes}",
            )
        self.wnids = sorted(wnids)
        self._train: tuple[list[Path], np.ndarray] | None = None
        self._test: tuple[list[Path], np.ndarray] | None = None

    def _train_files(self) -> tuple[list[Path], np.ndarray]:
        if self._train is None:
            files: list[Path] = []
            labels: list[int] = []
            for k, wnid in enumerate(self.wnids):
                folder = self.root / "train" / wnid / "images"
                if not folder.is_dir():
                    raise ConfigError(
                        "data_dir", f"{folder} not found: wnids.txt lists {wnid}, train/ has no images of it"
                    )
                names = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
                files += [folder / name for name in names]
                labels += [k] * len(names)
            self._train = files, np.array(labels, np.int64)
        return self._train

    def _test_files(self) -> tuple[list[Path], np.ndarray]:
        if self._test is None:
            path = self.root / "val" / "val_annotations.txt"
            index = {wnid: k for k, wnid in enumerate(self.wnids)}
            files: list[Path] = []
            labels: list[int] = []
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                fields = line.split()
                if not fields:
                    continue
                if len(fields) < 2 or fields[1] not in index:
                    raise ConfigError(
                        "data_dir",
                        f"{path} line {line_no}: expected 'FILE WNID ...' with a wnid of wnids.txt, got {line[:80]!r}",
                    )
                files.append(self.root / "val" / "images" / fields[0])
                labels.append(index[fields[1]])
            self._test = files, np.array(labels, np.int64)
        return self._test

    def train_labels(self) -> np.ndarray:
        return self._train_files()[1]

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        files = self._train_files()[0]
        return decode([files[int(r)] for r in np.asarray(rows)]).astype(np.float32) / np.float32(255.0)

    def test_labels(self) -> np.ndarray:
        return self._test_files()[1]

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        files = self._test_files()[0]
        return decode([files[int(r)] for r in np.asarray(rows)]).astype(np.float32) / np.float32(255.0)
