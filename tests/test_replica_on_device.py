"""The replica on the device (docs/arrays.md, "Rows and the ring on the device"): the weights and
the server optimizer's state as torch tensors (``Trainer(host_path=False)``, torch CPU tensors),
against numpy: every server optimizer step for step, the drift diagnostic, whole runs on 1 and 2
ranks, and a resumed run."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from conftest import file_datasets, path_runs, run_mpi
from mpi4py import MPI

from fedring.config import Config
from fedring.train import trainer as trainers
from fedring.train.loop import train_round
from fedring.train.optim import SERVER_OPTIMIZERS, ServerAdam, make_server_optimizer
from fedring.train.replica import Replica
from fedring.train.task import TrainTask

#: every server optimizer and the variants that change its code
OPTIMIZERS = {
    "sgd": ("sgd", {}),
    "sgd-lr": ("sgd", {"lr": 0.3}),
    "momentum": ("momentum", {"beta": 0.9}),
    "adam": ("adam", {"beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
    "adam-flower": ("adam", {"variant": "flower", "tau": 1e-3}),
    "yogi": ("yogi", {"beta1": 0.5, "beta2": 0.9, "tau": 1e-2}),
    "yogi-flower": ("yogi", {"variant": "flower"}),
    "adagrad": ("adagrad", {"tau": 1e-2}),
    "adagrad-flower": ("adagrad", {"variant": "flower"}),
}


def test_every_server_optimizer_is_checked_and_runs_on_the_device():
    assert {name for name, _ in OPTIMIZERS.values()} == set(SERVER_OPTIMIZERS)
    assert all(SERVER_OPTIMIZERS[name].on_device for name in SERVER_OPTIMIZERS)


def same_bits(a: np.ndarray, b: torch.Tensor) -> bool:
    return isinstance(b, torch.Tensor) and a.dtype == b.numpy().dtype and a.tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_server_optimizer_on_tensors_is_numpys_bits(name):
    """Eight rounds on tensors and on numpy arrays from the same state: every step and state array is
    the same bits. Each operation is a correctly rounded float32 one (a product with a float32 scalar,
    a sum, a quotient of two vectors, the square root: ``sqrt32``), in the same order on either kind.
    The aggregates span eight decades and cross ``v`` (Yogi's sign takes both values and 0)."""
    opt = make_server_optimizer(*OPTIMIZERS[name])
    d = 4099
    host = opt.init(d)
    device = {k: torch.from_numpy(v.copy()) for k, v in host.items()}
    rng = np.random.default_rng(0)
    for t in range(8):
        g = (rng.standard_normal(d) * 10.0 ** rng.integers(-6, 2, d)).astype(np.float32)
        g[:3] = 0.0
        eta = 0.1 * 0.9**t
        step, host = opt.update(host, g.copy(), eta, t)
        dstep, device = opt.update(device, torch.from_numpy(g.copy()), eta, t)
        assert same_bits(step, dstep), t
        assert host.keys() == device.keys()
        for k in host:
            assert same_bits(host[k], device[k]), (t, k)


@pytest.mark.parametrize("name", ["momentum", "adam", "yogi", "adagrad-flower"])
def test_server_optimizer_on_tensors_keeps_nonfinite_where_numpy_does(name):
    """A NaN or an infinite aggregate (recorded as ``nonfinite_update``, applied all the same) makes
    the same entries non-finite on either kind; Yogi's sign of NaN is NaN on both (torch's own gives 0)."""
    opt = make_server_optimizer(*OPTIMIZERS[name])
    host = opt.init(6)
    device = {k: torch.from_numpy(v.copy()) for k, v in host.items()}
    g = np.float32([1, np.nan, np.inf, -np.inf, 0, -2])
    with np.errstate(invalid="ignore"):  # inf / inf, as a run records a non-finite update
        step, host = opt.update(host, g.copy(), 0.1)
    dstep, device = opt.update(device, torch.from_numpy(g.copy()), 0.1)
    for a, b in [(step, dstep), *((host[k], device[k]) for k in host)]:
        b = b.numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)])


def trainer(host_path: bool | None = None, **settings) -> trainers.Trainer:
    cfg = Config(**{"dataset": "synthetic", "model": "mlp", "clients": 4, "rounds": 3, "quiet": True, **settings})
    TrainTask(cfg, 1)
    return trainers.Trainer(cfg, MPI.COMM_WORLD, host_path)


ADAM = dict(server_optimizer="adam", sections={"adam": {"lr": 0.05}}, momentum=0.9)


def test_device_replica_keeps_weights_and_state_on_the_device():
    """Three rounds: the weights, ``w0`` and the optimizer's state are tensors on the trainer's device,
    the model's parameters are the weights, and ``w``, the checkpoint's arrays and the drift are the
    host path's bits."""
    host, device = trainer(**ADAM), trainer(host_path=False, **ADAM)
    rep = device.replica
    for t in range(3):
        train_round(host, t), train_round(device, t)
        assert host.replica.weight_mean_change() == rep.weight_mean_change()
    for vec in (rep.w_staged, rep.w0, *rep.state.values()):
        assert isinstance(vec, torch.Tensor) and vec.device == device.device
    assert same_bits(host.replica.w, rep.w_staged)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in rep.model.parameters()]), rep.w_staged)
    a, b = host.replica.checkpoint(), rep.checkpoint()
    assert a.keys() == b.keys() == {"w", "optim_m", "optim_v"}
    for k in a:
        assert isinstance(b[k], np.ndarray) and a[k].tobytes() == b[k].tobytes(), k


class NumpyAdam(ServerAdam):
    """A plugin's optimizer written for numpy only: it declares no ``on_device``."""

    name = "numpy_adam"

    def update(self, state, g, eta, t=0):
        assert isinstance(g, np.ndarray) and all(isinstance(v, np.ndarray) for v in state.values())
        return super().update(state, g, eta, t)


def test_an_optimizer_without_on_device_steps_on_the_host():
    """``on_device`` is not inherited: a subclass that does not declare it gets numpy arrays on the
    device path (its state in host memory), and its steps come to the device weights; the same bits."""
    assert not NumpyAdam.on_device
    host, device = trainer(**ADAM), trainer(host_path=False, **ADAM)
    rep = device.replica
    device.replica = Replica(rep.model, rep.w.copy(), rep.stage, NumpyAdam(lr=0.05), rep.step_sizes, rep.buffers)
    assert device.replica.optimizer_on_host and all(isinstance(v, np.ndarray) for v in device.replica.state.values())
    for t in range(3):
        train_round(host, t), train_round(device, t)
    assert isinstance(device.replica.w_staged, torch.Tensor)
    assert same_bits(host.replica.w, device.replica.w_staged)


#: server optimizers with state in runs: server momentum over client momentum, Adam with BatchNorm
#: statistics (aggregated, so checkpointed), Yogi (Flower's) behind the server's median with cohorts,
#: Adagrad
CONFIGS = {
    "momentum": ["--model", "mlp", "--set", "server_optimizer=momentum", "--set", "momentum=0.9"],
    "adam-bn": ["--model", "bn_mlp:BatchNormMLP", "--set", "server_optimizer=adam", "--set", "adam.lr=0.05"],
    "yogi-median": [
        *("--model", "mlp", "--topology", "server", "--aggregator", "median", "--set", "participation=4"),
        *("--set", "server_optimizer=yogi", "--set", "yogi.variant=flower", "--set", "yogi.lr=0.05"),
    ],
    "adagrad": ["--model", "mlp", "--set", "server_optimizer=adagrad", "--set", "adagrad.lr=0.05"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return path_runs(
        tmp_path_factory.mktemp("replica_on_device"),
        CONFIGS,
        ["--dataset", "synthetic", "--rounds", "4", "--eval-every", "2", "--quiet", "--clients", "6"],
        [("device", 1), ("device", 2), ("host", 1)],
    )


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_replica_runs_are_the_host_paths_bits_on_1_and_2_ranks(runs, name):
    """The whole results file (model, buffers, metrics with the drift, per-round rows) of the device
    path on 1 and 2 ranks is the host path's bytes: the server optimizer's step is the same float32
    operations on either kind, and the drift is reduced in numpy's order."""
    host = file_datasets(runs / f"{name}-host1.h5")
    assert {"model/final", "metrics/weight_mean_change"} <= host.keys()
    for ranks in (1, 2):
        device = file_datasets(runs / f"{name}-device{ranks}.h5")
        assert device.keys() == host.keys()
        for key in host:
            assert host[key].tobytes() == device[key].tobytes(), (ranks, key)


#: ``python resume.py ROUND OUT [--resume]``: a run on the device path into OUT that fails in round
#: ROUND (0-based; -1: none)
RESUME_SCRIPT = """
import sys
import fedring.train.loop as loop
import fedring.train.trainer as trainer
from fedring.cli import main

build, train = trainer.Trainer.__init__, loop.train_round

def on_device(self, cfg, comm, host_path=None, parts=None):
    build(self, cfg, comm, False, parts)

def train_round(tr, t):
    if t == int(sys.argv[1]):
        raise RuntimeError("injected failure on purpose")
    return train(tr, t)

trainer.Trainer.__init__, loop.train_round = on_device, train_round
args = ["run", "--dataset", "synthetic", "--clients", "4", "--rounds", "5", "--eval-every", "1", "--quiet"]
args += ["--checkpoint-every", "2", "--model", "bn_mlp:BatchNormMLP", "--set", "momentum=0.5"]
args += ["--set", "server_optimizer=yogi", "--set", "yogi.lr=0.05"]
sys.exit(main([*args, "--out", *sys.argv[2:]]))
"""


@pytest.mark.slow
def test_device_replica_resumes_bit_exactly(tmp_path):
    """On the device path, a run that fails in round 3 (its checkpoint after round 2) and is resumed
    with ``--resume`` ends with the uninterrupted run's file, bit for bit: the weights, the server
    optimizer's state (Yogi), the client momentum rows and the BatchNorm statistics go to host memory
    for the checkpoint and back to the device."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    whole, split = tmp_path / "whole.h5", tmp_path / "split.h5"
    run_mpi(1, [str(script), "-1", str(whole)])
    failed = run_mpi(1, [str(script), "2", str(split)], check=False)
    assert failed.returncode != 0 and "injected failure on purpose" in failed.stderr
    with h5py.File(split) as f:
        assert int(f.attrs["rounds_completed"]) == 2
    run_mpi(1, [str(script), "-1", str(split), "--resume"])
    a, b = file_datasets(whole), file_datasets(split)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), key
