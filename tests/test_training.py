"""End-to-end runs under mpiexec: rank-count invariance, byte ledger, HDF5 layout.

One job per rank count (1, 2, 4) runs every configuration of the module one after the other
(:func:`conftest.fedring_many`); the tests read the files."""

import json

import h5py
import numpy as np
import pytest
from conftest import fedring_many

D_CNN = 139_960
SMALL = ["--dataset", "synthetic", "--clients", "8", "--rounds", "3", "--eval-every", "2", "--quiet"]
#: the mlp learns the synthetic classes in a fraction of the cnn's time (the tour shows the cnn learning)
LEARN = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--clients",
    "4",
    "--rounds",
    "80",
    "--eval-every",
    "40",
    "--lr",
    "0.2",
    "--partition",
    "iid",
    "--quiet",
]

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{ranks}/{name}.h5``: SMALL on the ring (its mean and CRFL) and on a server on 1, 2 and 4
    ranks, LEARN on 2."""
    root = tmp_path_factory.mktemp("training")
    for ranks in (1, 2, 4):
        (root / str(ranks)).mkdir()
        configs = {topology: [*SMALL, "--topology", topology] for topology in ("ring", "server")}
        # a ring rule that draws each round: CRFL's noise and a clip that binds
        configs["ring-crfl"] = [*SMALL, "--topology", "ring", "--aggregator", "crfl", "--set", "crfl.threshold=0.05"]
        if ranks == 2:
            configs["learn"] = LEARN
        out = {name: [*args, "--out", str(root / str(ranks) / f"{name}.h5")] for name, args in configs.items()}
        assert fedring_many(ranks, out, root / str(ranks))[0] == dict.fromkeys(configs, 0)
    return root


def load(path):
    with h5py.File(path, "r") as f:
        return (
            dict(f.attrs),
            {k: f["metrics"][k][:] for k in f["metrics"]},
            f["comm/bytes_sent"][:],
            f["comm/server_bytes_sent"][:],
            f["model/final"][:],
        )


@pytest.mark.parametrize("topology", ["ring", "server", "ring-crfl"])
def test_same_seed_same_results_on_1_2_4_ranks(runs, topology):
    loaded = [load(runs / str(ranks) / f"{topology}.h5") for ranks in (1, 2, 4)]
    _, metrics0, bytes0, server0, model0 = loaded[0]
    for _, metrics, sent, server, model in loaded[1:]:
        assert model.tobytes() == model0.tobytes()  # bit for bit
        for name in ("test_accuracy", "test_loss", "train_loss", "bytes_sent", "round"):
            assert metrics[name].tobytes() == metrics0[name].tobytes(), name
        np.testing.assert_array_equal(sent, bytes0)
        np.testing.assert_array_equal(server, server0)
    assert [r[0]["world_size"] for r in loaded] == [1, 2, 4]


def test_hdf5_layout_and_ring_bytes(runs):
    attrs, metrics, sent, server, model = load(runs / "2" / "ring.h5")
    assert attrs["status"] == "complete" and attrs["rounds_completed"] == 3
    assert attrs["n_clients"] == 8 and attrs["n_parameters"] == D_CNN == model.size
    assert json.loads(attrs["config"])["clients"] == 8
    assert metrics["round"].tolist() == [2, 3]
    assert sent.shape == (3, 8) and server.tolist() == [0, 0, 0]
    # n = 8 divides d = 139960: each client sends 2 (n-1)/n d float32 values per round
    assert np.all(sent == 2 * 7 * D_CNN * 4 // 8)
    assert metrics["bytes_sent"].tolist() == [8 * 2 * 7 * D_CNN * 4 // 8] * 2
    assert metrics["bytes_sent_total"].tolist() == [2 * 8 * 2 * 7 * D_CNN * 4 // 8, 3 * 8 * 2 * 7 * D_CNN * 4 // 8]
    assert 0 <= metrics["test_accuracy"].min() <= metrics["test_accuracy"].max() <= 1
    assert np.all(np.diff(metrics["wall_seconds"]) > 0)


def test_server_bytes(runs):
    _, metrics, sent, server, _ = load(runs / "2" / "server.h5")
    assert np.all(sent == D_CNN * 4)  # each client uploads its float32 gradient once
    assert np.all(server == 8 * D_CNN * 4)  # the server sends the aggregate to each client
    assert metrics["server_bytes_sent"].tolist() == [8 * D_CNN * 4] * 2


def test_learns_on_synthetic(runs):
    _, metrics, *_ = load(runs / "2" / "learn.h5")
    # 10 balanced classes: chance is 0.1; the synthetic classes are separable (seeded: no false alarm)
    assert metrics["test_accuracy"][-1] > 0.9
