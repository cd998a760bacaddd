"""``batched_clients`` (fedring/train/batched.py): within float rounding of the per-client loop,
the same file on any number of ranks, and the combinations it cannot do refused."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import fedring
from mpi4py import MPI

from fedring.config import Config
from fedring.train.loop import train_round
from fedring.train.task import TrainTask
from fedring.train.trainer import Trainer

#: every client-side setting the batched path reproduces: local steps, the client optimizer, a data attack with scaling
CLIENT_SIDE = dict(
    dataset="synthetic",
    clients=6,
    rounds=3,
    local_steps=3,
    momentum=0.9,
    clip_norm=5.0,
    weight_decay=1e-4,
    byzantine=2,
    attack="backdoor",
    quiet=True,
)


def trainer(**settings) -> Trainer:
    cfg = Config(**{**CLIENT_SIDE, **settings})
    TrainTask(cfg, 1)
    return Trainer(cfg, MPI.COMM_WORLD)


def test_batched_clients_match_the_per_client_loop_up_to_rounding():
    """Uploads and weights after 3 rounds, B = 4 (one full chunk and one padded): within 1e-4 of the
    upload's largest entry (measured: 6e-6). The batched kernels sum each gradient in another order than the per-client
    ones (float32 eps 1.2e-7 per operation, over sums of hundreds of terms and 3 local steps whose
    differences carry over), so not bit for bit; a wrong batch, slot or optimizer row would differ by O(1)."""
    ref, batched = trainer(), trainer(batched_clients=4)
    for t in range(3):
        a, b = train_round(ref, t), train_round(batched, t)
        scale = np.abs(ref.clients.rows).max()
        assert np.abs(ref.clients.rows - batched.clients.rows).max() <= 1e-4 * scale
        np.testing.assert_allclose(a.batch_loss, b.batch_loss, rtol=1e-5)
    assert np.abs(ref.replica.w - batched.replica.w).max() <= 1e-4 * np.abs(ref.replica.w).max()


@pytest.mark.parametrize("model,local_steps", [("mlp", 1), ("mlp", 3), ("cnn", 1)])
def test_shared_weights_at_the_first_step_match_the_per_slot_weights(model, local_steps):
    """A GPU's batched first step takes one set of weights for every slot (the shared w), and a
    one-step group reads w itself (no B x d copy). Forced on the CPU's device path (B = 4, 3 rounds):
    the MLP's uploads and losses are the per-slot weights' bit for bit (the same matrix products, one
    batched and one not), later local steps included; the CNN's within 1e-5 of the largest entry
    (its convolutions sum in another order with one set of weights; measured: 2e-7). With several
    local steps a CNN's later rounds can differ more, where a max-pool or ReLU flips on a rounding
    difference, so the CNN is checked with one local step."""
    settings = dict(model=model, batched_clients=4, local_steps=local_steps, attack="none", byzantine=0)
    runs = []
    for shared in (False, True):
        cfg = Config(**{**CLIENT_SIDE, **settings})
        TrainTask(cfg, 1)
        tr = Trainer(cfg, MPI.COMM_WORLD, host_path=False)
        assert tr.clients.source.shared_first_step is False  # the CPU's default keeps its bits
        tr.clients.source.shared_first_step = shared
        runs.append(tr)
    source, w = runs[1].clients.source, runs[1].replica.w_staged
    w_local, _ = source.start(w, source.groups(range(6), np.ones(6, bool))[0], 1, None)
    assert w_local.shape == (1, w.shape[0]) and w_local.data_ptr() == w.data_ptr()
    for t in range(3):
        a, b = train_round(runs[0], t), train_round(runs[1], t)
        rows_a, rows_b = runs[0].clients.rows.numpy(), runs[1].clients.rows.numpy()
        if model == "mlp":
            assert np.array_equal(rows_a.view(np.uint32), rows_b.view(np.uint32))
            assert np.array_equal(a.batch_loss, b.batch_loss)
        else:
            assert np.abs(rows_a - rows_b).max() <= 1e-5 * np.abs(rows_a).max()
            np.testing.assert_allclose(a.batch_loss, b.batch_loss, rtol=1e-6)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_same_file_on_any_number_of_ranks(tmp_path):
    """7 clients in chunks of 3 (0-2, 3-5, 6): on 3 ranks (blocks 0-2, 3-4, 5-6) two chunks are split
    and padded; every array of the file is the same bit for bit."""
    args = [
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--clients",
        "7",
        "--rounds",
        "2",
        "--byzantine",
        "2",
        "--attack",
        "labelflip",
    ]
    args += ["--set", "batched_clients=3", "--set", "local_steps=2", "--set", "momentum=0.5", "--set", "eval_every=2"]
    files = [tmp_path / f"n{n}.h5" for n in (1, 3)]
    for n, path in zip((1, 3), files):
        fedring(n, "run", *args, "--out", str(path))
    with h5py.File(files[0]) as a, h5py.File(files[1]) as b:
        for name in ("model/final", "metrics/test_accuracy", "metrics/test_loss", "metrics/train_loss"):
            assert np.array_equal(a[name][:], b[name][:]), name


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["model=cnn_bn"], "batched_clients: model cnn_bn has buffers (BatchNorm statistics), which vmap cannot"),
        (["local_epochs=1"], "batched_clients: local_epochs' last batch of a pass is shorter"),
        (["batched_clients=0"], "batched_clients: must be in [1, 4], got 0"),
        (["batched_clients=5"], "batched_clients: must be in [1, 4], got 5"),
        (["clients=200"], "batched_clients: a client has fewer than batch_size (32) training samples"),
    ],
)
def test_what_the_batched_path_cannot_do_is_refused(fedring_cli, tmp_path, settings, message):
    sets = [a for s in ["clients=4", "batched_clients=2", *settings] for a in ("--set", s)]
    result = fedring_cli("run", "--dataset", "synthetic", *sets, "--out", tmp_path / "run.h5")
    assert result.returncode == 2 and result.stderr.startswith(f"fedring: error: {message}"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run.h5").exists()
