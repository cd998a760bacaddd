"""LEAF's Shakespeare LSTM through the training path: int64 token batches (B, 80) in the per-client
backward pass, in ``vmap`` (batched clients) and in evaluation; both topologies with a model attack
and label flipping; the image-only backdoor refused; the same file on 1 and 2 ranks."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import fedring
from mpi4py import MPI
from test_datasets_formats import LEAF_LETTERS, write_leaf

from fedring.attacks import LabelFlip
from fedring.config import Config
from fedring.errors import ConfigError
from fedring.train.loop import train_round
from fedring.train.task import TrainTask
from fedring.train.trainer import Trainer

D_LSTM = 817_872


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    """6 speaking roles, 16 training and 4 test samples each, of random LEAF characters."""
    root = tmp_path_factory.mktemp("shakespeare")
    rng = np.random.default_rng(0)
    letters = list(LEAF_LETTERS)

    def role(n):
        return ["".join(rng.choice(letters, 80)) for _ in range(n)], [str(rng.choice(letters)) for _ in range(n)]

    roles = [f"THE_TEMPEST_ROLE{k}" for k in range(6)]
    write_leaf(
        root,
        {"train/a.json": {r: role(16) for r in roles}, "test/a.json": {r: role(4) for r in roles}},
        hierarchies=True,
    )
    return root


def trainer(plays, **settings) -> Trainer:
    base = dict(dataset="shakespeare", data_dir=str(plays), partition="natural", clients=5, batch_size=8, quiet=True)
    cfg = Config(**{**base, **settings})
    TrainTask(cfg, 1)
    return Trainer(cfg, MPI.COMM_WORLD)


@pytest.mark.parametrize(
    "settings",
    [
        dict(topology="ring"),
        dict(topology="ring", aggregator="brace", byzantine=1, attack="alie", lr=0.01),
        dict(topology="server", aggregator="krum", byzantine=1, attack="alie"),
        dict(topology="server", aggregator="median", byzantine=1, attack="labelflip"),
    ],
    ids=["ring-mean", "ring-brace-alie", "server-krum-alie", "server-median-labelflip"],
)
def test_two_rounds_of_the_lstm(plays, settings):
    tr = trainer(plays, **settings)
    assert tr.d == D_LSTM and tr.clients.shards[0].x.dtype == np.int64 and tr.clients.shards[0].x.shape[1:] == (80,)
    w0 = tr.replica.w.copy()
    for t in range(2):
        result = train_round(tr, t)
        assert np.isfinite(result.batch_loss).all()
    assert np.isfinite(tr.replica.w).all() and not np.array_equal(tr.replica.w, w0)
    scores = tr.evaluation.scores()
    # chance on 80 classes: the loss starts near log 80 = 4.38
    assert 0 <= scores["test_accuracy"] <= 1 and 3 < scores["test_loss"] < 6


def test_label_flipping_flips_the_data_sets_classes(plays):
    tr = trainer(plays, byzantine=1, attack="labelflip")
    attack = tr.clients.data_attack
    assert isinstance(attack, LabelFlip) and attack.num_classes == 80 and attack.mapping[0] == 79
    synthetic = trainer(plays, dataset="synthetic", data_dir=None, partition="iid", attack="labelflip", byzantine=1)
    assert synthetic.clients.data_attack.num_classes == 10


def test_the_backdoor_refuses_token_sequences(plays):
    with pytest.raises(ConfigError) as e:
        trainer(plays, byzantine=1, attack="backdoor")
    assert str(e.value) == (
        "attack: backdoor poisons images, and shakespeare's samples are sequences of 80 tokens: "
        "use labelflip or a model attack"
    )


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap loops over the LSTM kernel
def test_batched_clients_run_the_lstm_within_rounding_of_the_loop(plays):
    """int64 batches through vmap: uploads after 2 rounds within 1e-4 of the largest entry (the bound of
    tests/test_batched.py for the same kernels summed in another order)."""
    ref, batched = trainer(plays, local_steps=2), trainer(plays, local_steps=2, batched_clients=2)
    for t in range(2):
        train_round(ref, t), train_round(batched, t)
        scale = np.abs(ref.clients.rows).max()
        assert np.abs(ref.clients.rows - batched.clients.rows).max() <= 1e-4 * scale


@pytest.mark.mpi
@pytest.mark.slow
def test_the_same_file_on_1_and_2_ranks(plays, tmp_path):
    """The natural partition and the text path on 2 ranks: every array bit for bit as on 1."""
    args = ["--dataset", "shakespeare", "--data-dir", str(plays), "--partition", "natural", "--clients", "5"]
    args += ["--rounds", "2", "--eval-every", "1", "--batch-size", "8", "--topology", "server"]
    args += ["--aggregator", "median", "--byzantine", "1", "--attack", "ipm", "--quiet"]
    files = [tmp_path / f"n{n}.h5" for n in (1, 2)]
    for n, path in zip((1, 2), files):
        fedring(n, "run", *args, "--out", str(path))
    with h5py.File(files[0]) as a, h5py.File(files[1]) as b:
        assert a.attrs["n_parameters"] == D_LSTM
        for name in ("model/final", "metrics/test_accuracy", "metrics/test_loss", "metrics/train_loss"):
            assert np.array_equal(a[name][:], b[name][:]), name
