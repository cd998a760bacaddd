"""The ``device`` setting (fedring/train/device.py): refused where it cannot hold, and the GPU path
against the CPU one where a GPU is visible."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from conftest import fedring

from fedring.train.device import Staging
from fedring.train.models import flatten, make_model

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_stops_at_once(fedring_cli, tmp_path):
    out = tmp_path / "run.h5"
    result = fedring_cli("run", "--dataset", "synthetic", "--set", "device=cuda", "--out", out)
    assert result.returncode == 2
    assert result.stderr.startswith('fedring: error: device: "cuda" but no GPU is visible to this process')
    assert result.stderr.count("\n") == 1 and not out.exists()


def test_unknown_device_names_the_allowed_ones(fedring_cli, tmp_path):
    result = fedring_cli("run", "--dataset", "synthetic", "--set", "device=gpu", "--out", tmp_path / "run.h5")
    assert result.returncode == 2
    assert (
        result.stderr == "fedring: error: device: 'gpu' is not allowed; did you mean 'cpu'? allowed: cpu, cuda, auto\n"
    )


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_auto_without_a_gpu_is_the_cpu_run_and_says_so(tmp_path):
    """On a machine without GPU, ``auto`` is ``cpu``: the banner names each rank's device, the file is the same."""
    common = ["--dataset", "synthetic", "--clients", "4", "--rounds", "2", "--set", "eval_every=2"]
    files = {}
    for device in ("cpu", "auto"):
        files[device] = tmp_path / f"{device}.h5"
        result = fedring(2, "run", *common, "--set", f"device={device}", "--out", str(files[device]))
        shown = [line for line in result.stdout.splitlines() if line.startswith("fedring: device:")]
        assert shown == ([] if device == "cpu" else ["fedring: device: rank 0 on cpu; 2 ranks: cpu x2"])
    with h5py.File(files["cpu"]) as a, h5py.File(files["auto"]) as b:
        assert np.array_equal(a["model/final"][:], b["model/final"][:])


@needs_gpu
def test_staging_moves_parameters_and_gradients_exactly():
    """Parameters in and gradients out through the pinned buffers are the CPU model's, bit for bit."""
    cpu = make_model("lenet5", 0, (1, 28, 28))
    gpu = make_model("lenet5", 0, (1, 28, 28)).to("cuda")
    stage = Staging(torch.device("cuda"), flatten(cpu).size)
    w = np.random.default_rng(0).standard_normal(flatten(cpu).size).astype(np.float32)
    stage.load(gpu, w)
    assert np.array_equal(flatten(gpu.cpu()).view(np.uint32), w.view(np.uint32))
    gpu.to("cuda")
    for p in gpu.parameters():
        p.grad = torch.full_like(p, 0.5) * p.detach()
    got = np.empty_like(w)
    stage.grad_into(gpu, got)
    assert np.array_equal(got, np.float32(0.5) * w)
    assert not np.shares_memory(got, w)


def test_bench_train_times_the_same_steps_as_the_bare_loop(fedring_cli, tmp_path):
    """Both loops end at the same model (float32 sums of 3 gradients in another order: a few ulps of
    weights below 1 per round, so 1e-6 after 3 rounds), and the printed ratio is the timed one."""
    out = tmp_path / "bench.json"
    args = ["--clients", "3", "--rounds", "2", "--dataset", "synthetic", "--batched-clients", "2", "--json", out]
    result = fedring_cli("bench", "train", *args)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["max_weight_difference"] < 1e-6
    seconds = record["seconds_per_round"]
    assert record["ratio"] == seconds["fedring"] / seconds["bare-loop"]
    assert result.stdout.splitlines()[-1] == f"ratio fedring/bare-loop: {record['ratio']:.2f}"
    assert record["client_steps_per_second"]["fedring"] == 3 / seconds["fedring"]
    assert record["speedup_batched"] == seconds["fedring"] / seconds["fedring-batched"]
    assert f"over the per-client loop: {record['speedup_batched']:.2f}" in result.stdout


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--device", "gpu", "device: 'gpu' is not allowed; did you mean 'cpu'? allowed: cpu, cuda, auto"),
        ("--rounds", "0", "--rounds: must be >= 1, got 0"),
        ("--model", "resnet", "model: "),
    ],
)
def test_bench_train_refuses_bad_options(fedring_cli, option, value, message):
    result = fedring_cli("bench", "train", "--dataset", "synthetic", option, value)
    assert result.returncode == 2 and result.stderr.startswith(f"fedring: error: {message}")
    assert result.stderr.count("\n") == 1
