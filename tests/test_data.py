"""Data sets (IDX and CIFAR-10 files), partitions, and the missing-data messages."""

import gzip

import numpy as np
import pytest

from fedring.datasets.fashion_mnist import FILES as FMNIST_FILES
from fedring.datasets.fashion_mnist import fmnist_dir, read_idx
from fedring.errors import ConfigError
from fedring.train.data import FederatedData, _checked, partition, partition_fang


def write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def tiny_fmnist(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (300, 28, 28))
    test = rng.integers(0, 256, (50, 28, 28))
    write_idx(tmp_path / FMNIST_FILES["train_images"], train)
    write_idx(tmp_path / FMNIST_FILES["train_labels"], np.arange(300) % 10)
    write_idx(tmp_path / FMNIST_FILES["test_images"], test)
    write_idx(tmp_path / FMNIST_FILES["test_labels"], np.arange(50) % 10)
    return tmp_path, train, test


def test_read_idx_rows_streamed(tiny_fmnist):
    root, train, _ = tiny_fmnist
    rows = np.array([0, 5, 299])
    got = read_idx(root / FMNIST_FILES["train_images"], rows, block=7)
    np.testing.assert_array_equal(got, train[rows])
    np.testing.assert_array_equal(read_idx(root / FMNIST_FILES["train_images"]), train)


def test_clients_get_their_partition_only(tiny_fmnist):
    root, train, _ = tiny_fmnist
    labels = np.arange(300) % 10
    parts = partition(labels, 6, "fang", 0.5, seed=1)
    data = FederatedData("fashion-mnist", str(root), 6, range(2, 4), "fang", 0.5, seed=1)
    for k, c in enumerate(range(2, 4)):
        np.testing.assert_array_equal(data.shards[k].y, labels[parts[c]])
        np.testing.assert_allclose(data.shards[k].x[:, 0], train[parts[c]] / 255.0, rtol=1e-6)
    # 50 test samples over 6 clients: slices of 9, 9, 8, 8, 8, 8; clients 2 and 3 get [18, 34)
    np.testing.assert_array_equal(data.test.y, (np.arange(50) % 10)[18:34])


@pytest.mark.parametrize("kind,x", [("iid", 0), ("fang", 0.5), ("fang", 0.1), ("dirichlet", 0.5)])
def test_partition_assigns_every_sample_once(kind, x):
    labels = np.random.default_rng(3).integers(0, 10, 6000)
    parts = partition(labels, 20, kind, x, seed=2)
    allidx = np.concatenate(parts)
    assert len(parts) == 20 and sorted(allidx.tolist()) == list(range(6000))
    again = partition(labels, 20, kind, x, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_fang_own_label_fraction_is_q():
    """Fang et al.'s partition: with q = 0.5 and balanced labels a group's own-label share is about q.

    60k samples: the share is a binomial mean with sd about 0.002 per group; the bound 0.02
    is over 9 sd (false-alarm rate far below 1e-9).
    """
    labels = np.repeat(np.arange(10), 6000)
    n, q = 100, 0.5
    rng = np.random.default_rng([0, 0x9A27])
    parts = partition_fang(labels, n, q, rng)
    # undo the final client permutation to recover groups: draw it again the same way
    rng = np.random.default_rng([0, 0x9A27])
    rng.random(len(labels)), rng.random(len(labels))
    perm = rng.permutation(n)
    group_of = np.empty(n, int)
    group_of[np.arange(n)] = perm // 10  # parts[i] is original client perm[i], in group perm[i] // 10
    for g in range(10):
        idx = np.concatenate([parts[i] for i in range(n) if group_of[i] == g])
        assert abs(np.mean(labels[idx] == g) - q) < 0.02


def test_missing_data_says_how_to_get_it(tmp_path):
    with pytest.raises(ConfigError) as e:
        fmnist_dir(str(tmp_path))
    assert "apt-get install -y dataset-fashion-mnist" in str(e.value) and e.value.key == "data_dir"


def test_empty_client_is_a_config_error():
    with pytest.raises(ConfigError, match=r"client\(s\) \[1\] received no training samples"):
        _checked([np.arange(3), np.array([], int)])


def test_cifar10_from_its_python_batches_and_its_default_model(tmp_path):
    """Small files in the standard format: labels, rows, scaling, and the model check."""
    from fedring.datasets.cifar10 import CIFAR10, TEST_FILE, TRAIN_FILES, write_batch
    from fedring.train.models import make_model

    rng = np.random.default_rng(0)
    for k, name in enumerate((*TRAIN_FILES, TEST_FILE)):
        write_batch(tmp_path / name, rng.integers(0, 256, (4, 3, 32, 32)), [k, k + 1, k + 2, 3])
    c = CIFAR10(str(tmp_path))
    assert c.train_labels().tolist() == [0, 1, 2, 3, 1, 2, 3, 3, 2, 3, 4, 3, 3, 4, 5, 3, 4, 5, 6, 3]
    images = c.train_images(np.array([1, 18]))
    assert images.shape == (2, 3, 32, 32) and images.dtype == np.float32 and 0 <= images.min() <= images.max() <= 1
    assert c.test_labels().tolist() == [5, 6, 7, 3]
    data = FederatedData("cifar10", str(tmp_path), 4, range(0, 2), "iid", 0.5, seed=0)
    assert [len(s.y) for s in data.shards] == [5, 5] and data.test.x.shape == (2, 3, 32, 32)
    assert sum(p.numel() for p in make_model("cnn_cifar", 0, c.shape).parameters()) == 545_098
    with pytest.raises(
        ConfigError, match=r"model: cnn takes 1x28x28 images, the data set has 3x32x32: set model = cnn_cifar"
    ):
        make_model("cnn", 0, c.shape)
    with pytest.raises(ConfigError, match="data_dir: CIFAR-10 files data_batch_1"):
        CIFAR10(str(tmp_path / "none"))


def test_cifar10_batch_files_are_data_a_crafted_pickle_runs_nothing(tmp_path):
    """A batch whose pickle calls os.system (REDUCE) is refused before the call; real batches load."""
    import os
    import pickle

    from fedring.datasets.cifar10 import CIFAR10, TEST_FILE, TRAIN_FILES, write_batch

    images = np.arange(2 * 3 * 32 * 32).reshape(2, 3, 32, 32) % 256
    for name in (*TRAIN_FILES, TEST_FILE):
        write_batch(tmp_path / name, images, [3, 7])
    for protocol in (2, 4, 5):  # 2: how the published (Python 2) files were written
        with open(tmp_path / TRAIN_FILES[1], "wb") as f:
            pickle.dump(
                {
                    b"data": images.reshape(2, -1).astype(np.uint8),
                    b"labels": [3, 7],
                    b"batch_label": b"b",
                    b"filenames": [b"a.png", "b.png"],
                },
                f,
                protocol=protocol,
            )
        np.testing.assert_array_equal(
            CIFAR10(str(tmp_path)).train_images(np.array([2, 3])), images.astype(np.float32) / np.float32(255)
        )
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    with open(tmp_path / TEST_FILE, "wb") as f:
        pickle.dump({b"data": Payload(), b"labels": [3, 7]}, f, protocol=2)
    with pytest.raises(
        ConfigError,
        match=rf"^data_dir: {tmp_path / TEST_FILE} is not a CIFAR-10 batch file, refused: "
        r"UnpicklingError: the pickle names posix.system; a data file holds only "
        r"dicts, lists, bytes, str, numbers and numpy arrays$",
    ):
        CIFAR10(str(tmp_path)).test_labels()
    assert not marker.exists()
    (tmp_path / TEST_FILE).write_bytes(b"\x80\x02}q\x00")  # cut short
    with pytest.raises(ConfigError, match=r"is not a CIFAR-10 batch file, refused: EOFError: Ran out of input$"):
        CIFAR10(str(tmp_path)).test_labels()
