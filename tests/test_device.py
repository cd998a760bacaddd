"""The ``device`` setting (fedring/train/device.py): refused where it cannot hold, the device path
(clients' updates and optimizer rows as torch tensors) against the host path on the CPU, and the
GPU path against the CPU one where a GPU is visible."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from conftest import fedring
from mpi4py import MPI

from fedring import arrays, rng
from fedring.aggregators import _kernels_torch, nonfinite_rows
from fedring.bench.ops import counting
from fedring.config import Config
from fedring.results import ResultsFile, read_checkpoint
from fedring.train.device import Staging
from fedring.train.loop import train_round
from fedring.train.models import flatten, make_model
from fedring.train.task import TrainTask
from fedring.train.trainer import PER_RANK, Trainer

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
    common = ["--dataset", "synthetic", "--model", "mlp", "--clients", "4", "--rounds", "2", "--set", "eval_every=2"]
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
    stage.grad_into(list(gpu.parameters()), got)
    assert np.array_equal(got, np.float32(0.5) * w)
    assert not np.shares_memory(got, w)
    on_device = stage.empty(got.shape)
    stage.grad_into(list(gpu.parameters()), on_device)
    assert on_device.device.type == "cuda"
    stage.upload(on_device, got)
    assert np.array_equal(got, np.float32(0.5) * w)


def trainer(host_path: bool | None = None, **settings) -> Trainer:
    cfg = Config(**{"dataset": "synthetic", "model": "mlp", "clients": 4, "rounds": 3, "quiet": True, **settings})
    TrainTask(cfg, 1)
    return Trainer(cfg, MPI.COMM_WORLD, host_path)


def uploads(tr: Trainer, rounds: int) -> list[np.ndarray]:
    """Each round's uploads (host copies of the device path's tensor rows), copied before the ring sums into them."""
    seen = []
    aggregate = tr.topology.aggregate

    def record(grads, *args):
        seen.append(np.array(arrays.host(grads)))
        return aggregate(grads, *args)

    tr.topology.aggregate = record
    for t in range(rounds):
        train_round(tr, t)
    return seen


#: client-side settings whose every operation is elementwise: the device path is the host path's bits
ELEMENTWISE = {
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "local steps, weight decay": dict(local_steps=3, weight_decay=0.01, momentum=0.5),
    "batched": dict(batched_clients=3, local_steps=2, weight_decay=0.01, momentum=0.9, nesterov=True),
    "batched, one step": dict(batched_clients=2, momentum=0.9),
}


@pytest.mark.parametrize("settings", ELEMENTWISE.values(), ids=ELEMENTWISE.keys())
def test_device_path_uploads_are_the_host_paths_bit_for_bit(settings):
    """Three rounds on the CPU: every upload, the weights and the momentum rows are equal bit for bit;
    the device path's rows are tensors on the trainer's device."""
    host, device = trainer(**settings), trainer(host_path=False, **settings)
    assert host.clients.stage.on_host and not device.clients.stage.on_host
    for a, b in zip(uploads(host, 3), uploads(device, 3), strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(host.replica.w.view(np.uint32), device.replica.w.view(np.uint32))
    rows = device.clients.state["m"]
    assert isinstance(rows, torch.Tensor) and rows.device == device.device
    assert np.array_equal(host.clients.state["m"].view(np.uint32), rows.numpy().view(np.uint32))


def test_device_path_ring_over_a_sampled_cohort_is_the_host_paths_bit_for_bit():
    """Half of the clients a round: the device path joins the members' rows as runs of consecutive
    rows (``topology.members``), the host path by a mask; the weights are equal bit for bit."""
    settings = dict(participation=0.5, clients=6, momentum=0.9)
    host, device = trainer(**settings), trainer(host_path=False, **settings)
    for t in range(3):
        cohorts = [train_round(tr, t).cohort.member for tr in (host, device)]
        assert np.array_equal(*cohorts) and cohorts[0].sum() == 3
    assert np.array_equal(host.replica.w.view(np.uint32), device.replica.w.view(np.uint32))


@pytest.mark.parametrize("bn_stats", ["aggregate", "local"])
def test_device_path_batchnorm_statistics_are_the_host_paths(bn_stats):
    """BatchNorm statistics on the device path: each client's loaded and kept on the device, the
    round's mean on the host. Three rounds with two local steps: the uploads, the weights, the
    shared statistics, every client's and the checkpoint's are the host path's bit for bit."""
    settings = dict(model="cnn_bn", bn_stats=bn_stats, local_steps=2)
    host, device = trainer(**settings), trainer(host_path=False, **settings)
    for a, b in zip(uploads(host, 3), uploads(device, 3), strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(host.replica.w.view(np.uint32), device.replica.w.view(np.uint32))
    hb, db = host.model_gradients.buffers, device.model_gradients.buffers
    assert isinstance(db.rows, torch.Tensor) and db.rows.device == device.device and db.rows.dtype == torch.float64
    assert np.array_equal(hb.shared, db.shared) and np.array_equal(hb.rows, db.rows.numpy())
    assert np.array_equal(hb.checkpoint()["buffers"], db.checkpoint()["buffers"])
    assert np.array_equal(hb.host_read(), db.host_read())  # what the models hold now
    rows, shared = db.rows.clone(), db.shared.copy()
    db.restore(db.checkpoint()["buffers"])  # a resumed run's statistics, on the device again
    assert isinstance(db.rows, torch.Tensor) and torch.equal(db.rows, rows) and np.array_equal(db.shared, shared)


@pytest.mark.parametrize("batched", [None, 2], ids=["per-client", "batched"])
@pytest.mark.parametrize("local_steps", [1, 3])
def test_device_path_clips_within_the_norms_rounding(local_steps, batched):
    """Clipping scales by ``c / ||g||`` with the norm summed in float64, in another order by torch
    than by numpy: the norms differ by about 1e-16 relative, which can move the float32 factor by
    one ulp (6e-8 relative) and, over 3 local steps and 3 rounds, the weights they are taken at.
    Bound: 1e-6 of the largest upload entry (a wrong step or row would differ by O(1)); with one
    local step and no momentum every upload is a clipped gradient, of norm c. Measured: equal bit
    for bit on these runs."""
    c = 0.01  # far below the synthetic model's gradient norms: every mini-batch gradient is clipped
    settings = dict(
        clip_norm=c, local_steps=local_steps, weight_decay=0.0 if local_steps == 1 else 0.01, batched_clients=batched
    )
    for a, b in zip(uploads(trainer(**settings), 3), uploads(trainer(host_path=False, **settings), 3), strict=True):
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
        if local_steps == 1:
            np.testing.assert_allclose(np.linalg.norm(b.astype(np.float64), axis=1), c, rtol=1e-6)


def test_device_rows_checkpoint_and_resume(tmp_path):
    """Device-resident momentum rows are checkpointed through host memory and restored onto the
    device: 2 rounds, checkpoint, a new trainer restores it and runs 2 more, bit for bit the
    uninterrupted 4 rounds."""
    settings = dict(momentum=0.9, local_steps=2, rounds=4, out=str(tmp_path / "run.h5"))
    whole, first = trainer(host_path=False, **settings), trainer(host_path=False, **settings)
    for t in range(2):
        train_round(whole, t), train_round(first, t)
    results = ResultsFile(settings["out"], {})
    results.write_checkpoint(first.checkpoint(), {})
    results.h5.close()
    with h5py.File(settings["out"]) as f:
        stored = f["checkpoint/a/client_m"][()]
        found = read_checkpoint(f, PER_RANK)
    assert found is not None
    assert np.array_equal(stored, first.clients.state["m"].numpy())
    resumed = trainer(host_path=False, **settings)
    resumed.restore(found[0])
    rows = resumed.clients.state["m"]
    assert isinstance(rows, torch.Tensor) and rows.device == resumed.device
    assert np.array_equal(rows.numpy(), stored)
    for t in range(2, 4):
        train_round(whole, t), train_round(resumed, t)
    assert np.array_equal(whole.replica.w.view(np.uint32), resumed.replica.w.view(np.uint32))
    assert torch.equal(whole.clients.state["m"], resumed.clients.state["m"])


@pytest.mark.parametrize("together_from", [1, rng.TOGETHER_FROM], ids=["generators-together", "each-clients-own"])
@pytest.mark.parametrize("settings", [dict(local_steps=3), dict(local_epochs=2, batch_size=7)], ids=["steps", "epochs"])
def test_device_batches_are_the_host_batches(settings, together_from, monkeypatch):
    """The device path gathers a round's batches on the device from indices drawn as the host path
    draws them, from each client's generator (``rng.generator``), whether the round's generators
    are made together or not: the same samples, batch for batch (a pass's last, shorter batch too);
    clients that sit out the round get none."""
    monkeypatch.setattr(rng, "TOGETHER_FROM", together_from)
    tr = trainer(host_path=False, **settings)
    taking = np.array([True, False, True, True])
    ready = tr.clients.device_batches(5, taking, tr.clients.source.groups(tr.layout.local_clients, taking))
    assert sorted(ready.spans) == [0, 2, 3]
    for c, spans in ready.spans.items():
        own = rng.generator(tr.cfg.seed, rng.Stream.BATCH, client=c, step=5)
        host_batches = list(tr.clients.local_batches(tr.clients.shards[c], own))
        got = [ready.batch(c, k) for k in range(len(spans))]
        assert len(got) == len(host_batches) > 1
        for (x, y), (hx, hy) in zip(got, host_batches, strict=True):
            assert isinstance(x, torch.Tensor) and x.device == tr.device
            assert np.array_equal(x.numpy(), hx) and np.array_equal(y.numpy(), hy)


def test_a_full_groups_batches_are_gathered_at_once():
    """A group of slots that all hold clients of the round gets each step's batches in one gather,
    ``(slots, batch, ...)``: the per-client batches stacked, exactly; a group with a slot that sits
    out gets none (its batches are taken one by one)."""
    tr = trainer(host_path=False, batched_clients=2, local_steps=2)
    taking = np.array([True, True, False, True])
    groups = tr.clients.source.groups(tr.layout.local_clients, taking)
    assert [g.held for g in groups] == [[0, 1], [3]]
    ready = tr.clients.device_batches(0, taking, groups)
    for step in range(2):
        x, y = ready.stacked(groups[0], step)
        assert x.shape == (2, 32, *tr.clients.shards[0].x.shape[1:]) and y.shape == (2, 32)
        assert torch.equal(x, torch.stack([ready.batch(c, step)[0] for c in (0, 1)]))
        assert torch.equal(y, torch.stack([ready.batch(c, step)[1] for c in (0, 1)]))
        assert ready.stacked(groups[1], step) is None


def test_counting_sorts_operations_into_kernels_views_reads_and_copies():
    """``fedring.bench.ops.counting``, the waits' counter: a tensor made from host data and a numpy
    view of a tensor are copies, ``float()`` a host read, each recorded as a wait after the kernels
    queued before it; a copy between devices (here to ``meta``) is no kernel (its host end is the
    copy); a view is no kernel."""
    with counting() as counted:
        x = torch.from_numpy(np.arange(4, dtype=np.float32))  # copy, after 0 kernels
        y = (x * 2).view(2, 2)  # a kernel and a view
        x.to("meta")
        torch.empty(4, device="meta").copy_(x)  # a kernel (empty); the copy crosses devices
        float(y[0, 0])  # two views (selects) and a host read, after 2 kernels
        y.numpy()  # copy
        torch.tensor(3.0)  # copy (and two views: the new tensor lifted and detached)
    assert dict(counted.kinds) == {"copies": 3, "kernels": 2, "views": 6, "host reads": 1}
    assert counted.waits == [0, 2, 2, 2]


#: settings whose device round must wait for the device only at its start and at its end
WAITING = {
    "the field's protocol": dict(momentum=0.9, clip_norm=0.5, weight_decay=0.01),
    "batched, protocol": dict(momentum=0.9, clip_norm=0.5, weight_decay=0.01, batched_clients=2),
    "local steps, sampled": dict(local_steps=2, participation=0.5, clients=6),
    "server adam": dict(momentum=0.9, server_optimizer="adam", batched_clients=2),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("settings", WAITING.values(), ids=WAITING.keys())
def test_a_device_ring_round_waits_for_the_device_only_at_its_start_and_end(settings, device, monkeypatch):
    """A ring-mean round of the device path reads no tensor's value on the host, and its copies
    between host memory and the device (each a wait for a GPU) are the batches' sample indices, before
    any kernel, and the uploads' non-finite flags and the batch losses, after the last: the host
    queues the ring and the update while the device computes the gradients. Clipping chooses its
    factor on the device (it read each norm before: a wait per client and step); the flags are made
    as on a GPU (``BY_EXTREMES``); a sampled cohort's rows are joined without a mask from the host."""
    monkeypatch.setitem(_kernels_torch.BY_EXTREMES, "host", True)
    tr = trainer(host_path=False, device=device, **settings)
    train_round(tr, 0)
    with counting() as counted:
        train_round(tr, 1)
    kernels = counted.kinds["kernels"]
    assert counted.kinds["host reads"] == 0 and kernels > 50
    assert counted.waits == [0, kernels, kernels]


@needs_gpu
def test_nonfinite_flags_on_a_gpu_are_numpys():
    """On a GPU the uploads' flags come from each row's extremes (no read): numpy's flags exactly, for
    NaN, infinities of either sign and finite rows whose sum overflows."""
    X = np.random.default_rng(0).standard_normal((8, 1000)).astype(np.float32)
    X[1, 7], X[2, 999], X[3, 0], X[4, :] = np.nan, np.inf, -np.inf, np.finfo(np.float32).max
    X[5, 3], X[5, 4] = np.inf, -np.inf
    got = _kernels_torch.nonfinite_flags(torch.from_numpy(X).cuda())
    assert got.device.type == "cuda" and got.cpu().tolist() == nonfinite_rows(X).tolist()
    assert nonfinite_rows(X).tolist() == [False, True, True, True, False, True, False, False]


def test_staging_copies_a_read_only_array():
    """A shard that is a view of a read-only file buffer becomes a tensor of its own, not a shared
    (writable) view of memory torch may not write."""
    data = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), np.float32)
    t = Staging(torch.device("cpu"), 6, host_path=False).tensor(data)
    assert t.tolist() == [0, 1, 2, 3, 4, 5] and not np.shares_memory(t.numpy(), data)


@needs_gpu
def test_a_gpu_round_keeps_batches_statistics_and_rule_state_on_the_gpu():
    """On a GPU: the round's batches are gathered there (the host path's samples, exactly), the
    clients' BatchNorm statistics and cclip's center live there, and two rounds train to finite
    weights (the kernels differ from the CPU's, so no bits are compared with it)."""
    tr = trainer(device="cuda", model="cnn_bn", topology="server", aggregator="cclip")
    taking = np.ones(4, bool)
    ready = tr.clients.device_batches(0, taking, tr.clients.source.groups(tr.layout.local_clients, taking))
    for c, spans in ready.spans.items():
        got = [ready.batch(c, k) for k in range(len(spans))]
        for (x, y), (hx, hy) in zip(got, tr.clients.batches(0, c), strict=True):
            assert (
                x.device.type == "cuda" and np.array_equal(x.cpu().numpy(), hx) and np.array_equal(y.cpu().numpy(), hy)
            )
    for t in range(2):
        train_round(tr, t)
    assert tr.model_gradients.buffers.rows.device.type == "cuda"
    assert tr.topology.state["center"].device.type == "cuda"
    assert np.isfinite(tr.replica.w).all()


@needs_gpu
def test_a_gpu_batched_round_with_the_fields_settings_is_the_cpu_device_paths_within_rounding():
    """On a GPU, batched clients (two full groups of 2: batches gathered at once, gradients in the
    rows), momentum, clipping chosen on the device and weight decay, 2 local steps, 3 rounds: the
    uploads and weights within 1e-4 of their largest entry of the CPU's device path (other kernels
    sum in another order; a wrong batch, slot, factor or row would differ by O(1))."""
    settings = dict(batched_clients=2, momentum=0.9, clip_norm=0.5, weight_decay=0.01, local_steps=2)
    gpu, cpu = trainer(device="cuda", **settings), trainer(host_path=False, **settings)
    cpu.clients.source.shared_first_step = True  # as the GPU's (the MLP's bits either way)
    taking = np.ones(4, bool)
    groups = gpu.clients.source.groups(gpu.layout.local_clients, taking)
    x, _ = gpu.clients.device_batches(0, taking, groups).stacked(groups[0], 0)
    assert x.device.type == "cuda" and x.shape[0] == 2
    for t in range(3):
        train_round(gpu, t), train_round(cpu, t)
        rows, ref = gpu.clients.rows.cpu().numpy(), cpu.clients.rows.numpy()
        assert np.abs(rows - ref).max() <= 1e-4 * np.abs(ref).max(), t
    assert np.abs(gpu.replica.w - cpu.replica.w).max() <= 1e-4 * np.abs(cpu.replica.w).max()


def test_device_rule_state_checkpoint_and_resume(tmp_path):
    """cclip's center lives on the rows' device from its first round; a checkpoint stores a host
    copy, and a resumed run moves it back and continues bit for bit the uninterrupted 4 rounds."""
    settings = dict(topology="server", aggregator="cclip", rounds=4, out=str(tmp_path / "run.h5"))
    whole, first = trainer(host_path=False, **settings), trainer(host_path=False, **settings)
    for t in range(2):
        train_round(whole, t), train_round(first, t)
    center = first.topology.state["center"]
    assert isinstance(center, torch.Tensor) and center.dtype == torch.float64 and center.abs().sum() > 0
    results = ResultsFile(settings["out"], {})
    results.write_checkpoint(first.checkpoint(), {})
    results.h5.close()
    with h5py.File(settings["out"]) as f:
        found = read_checkpoint(f, PER_RANK)
    assert found is not None and np.array_equal(found[0]["state_center"], center.numpy())
    resumed = trainer(host_path=False, **settings)
    resumed.restore(found[0])
    for t in range(2, 4):
        train_round(whole, t), train_round(resumed, t)
    assert np.array_equal(whole.replica.w.view(np.uint32), resumed.replica.w.view(np.uint32))
    assert torch.equal(whole.topology.state["center"], resumed.topology.state["center"])


def test_bench_train_times_the_same_steps_as_the_bare_loop(fedring_cli, tmp_path):
    """Both loops end at the same model (float32 sums of 3 gradients in another order: a few ulps of
    weights below 1 per round, so 1e-6 after 3 rounds), and the printed ratio is the timed one."""
    out = tmp_path / "bench.json"
    args = [
        "--clients",
        "3",
        "--rounds",
        "2",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--batched-clients",
        "2",
        "--json",
        out,
    ]
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
    # the bare batched loop (vmap over the clients, summed on the device) takes the bare loop's steps
    assert record["max_weight_difference_bare_batched"] < 1e-6
    assert record["ratio_batched"] == seconds["fedring-batched"] / seconds["bare-batched"]
    assert f"ratio fedring-batched/bare-batched: {record['ratio_batched']:.2f}" in result.stdout
    assert record["device_path"] is False


def test_bench_train_device_path_runs_the_gpus_path_on_the_cpu(fedring_cli, tmp_path):
    """``--device-path`` times fedring's device path on the CPU (tensors for rows, the batched first
    step with shared weights, as on a GPU): the same steps as the bare loops (the MLP's shared-weights
    step is the per-slot one bit for bit, ``test_shared_weights_at_the_first_step...``); with another
    device it is refused before any work, naming the option."""
    out = tmp_path / "bench.json"
    args = ["--clients", "3", "--rounds", "2", "--dataset", "synthetic", "--model", "mlp", "--batched-clients", "2"]
    result = fedring_cli("bench", "train", *args, "--device-path", "--json", out)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["device_path"] is True and "(cpu, device path)" in result.stdout.splitlines()[0]
    assert record["max_weight_difference"] < 1e-6 and record["max_weight_difference_bare_batched"] < 1e-6
    refused = fedring_cli("bench", "train", *args, "--device-path", "--device", "cuda")
    assert refused.returncode == 2 and not refused.stdout
    assert "--device-path runs the device path on the CPU: it needs --device cpu, got 'cuda'" in refused.stderr


def test_bench_train_set_changes_fedrings_settings_only(fedring_cli, tmp_path):
    """``--set`` changes fedring's run (here client momentum), not the bare loops' plain SGD: the two
    models then differ by the setting, and the line says why; a malformed item is refused."""
    out = tmp_path / "bench.json"
    args = ["--clients", "3", "--rounds", "2", "--dataset", "synthetic", "--model", "mlp", "--json", out]
    result = fedring_cli("bench", "train", *args, "--set", "momentum=0.9")
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["settings"] == ["momentum=0.9"] and record["max_weight_difference"] > 1e-4
    assert "(fedring's settings momentum=0.9; the bare loops take plain SGD steps)" in result.stdout
    refused = fedring_cli("bench", "train", *args, "--set", "momentum")
    assert refused.returncode == 2 and "--set: expected KEY=VALUE, got 'momentum'" in refused.stderr


def test_bench_train_times_a_server_rule_under_attack(fedring_cli, tmp_path):
    """``--topology``, ``--aggregator``, ``--attack``: fedring's round is the run's (a median under a sign
    flip), the bare loop still averages, and the models differ by the rule (the line says so)."""
    out = tmp_path / "bench.json"
    args = ["--clients", "4", "--rounds", "1", "--dataset", "synthetic", "--model", "mlp", "--json", out]
    server = ["--topology", "server", "--aggregator", "median", "--attack", "signflip", "--byzantine", "1"]
    result = fedring_cli("bench", "train", *args, *server)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert (record["topology"], record["aggregator"], record["attack"], record["byzantine"]) == (
        "server",
        "median",
        "signflip",
        1,
    )
    assert record["max_weight_difference"] > 1e-3
    assert "(fedring's rule is median, the bare loops average)" in result.stdout


def test_bench_train_nondeterministic_times_every_loop_without_deterministic_algorithms(
    fedring_cli, tmp_path, monkeypatch
):
    """Every Trainer turns deterministic algorithms on when it selects a GPU; ``--nondeterministic``
    must turn them off after the last Trainer is built (a GPU run once timed the batched loop with
    them back on). Here each Trainer's device selection turns them on, as on a GPU."""
    from fedring.train import trainer

    def gpu_like_select(setting, comm):
        torch.use_deterministic_algorithms(True)
        return torch.device("cpu")

    monkeypatch.setattr(trainer, "select", gpu_like_select)
    out = tmp_path / "bench.json"
    args = ["--clients", "3", "--rounds", "1", "--dataset", "synthetic", "--model", "mlp", "--batched-clients", "2"]
    try:
        result = fedring_cli("bench", "train", *args, "--nondeterministic", "--json", out)
    finally:
        torch.use_deterministic_algorithms(False)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["deterministic_algorithms"] is False


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


def ring_of_one_rank(device: str) -> None:
    """The ring all-reduce of 100 clients on one rank, on ``device``'s tensors, by each of the
    reduce-scatter's two ways (``Network.reduce_owned``), against numpy's rows: the same bits."""
    from fedring.comm import Layout, Network, network, ring_allreduce

    chosen = network.PADDED_BYTES
    try:
        for d in (1, 99, 100, 1001, 139_960):
            X = np.random.default_rng(d).standard_normal((100, d)).astype(np.float32)
            expected = ring_allreduce(Network(Layout(100, MPI.COMM_SELF)), X.copy())
            for bound in (1 << 40, -1):  # the padded path, the planned path
                network.PADDED_BYTES = {"host": bound, "device": bound}
                rows = torch.from_numpy(X.copy()).to(device)
                ring_allreduce(Network(Layout(100, MPI.COMM_SELF)), rows)
                assert rows.cpu().numpy().tobytes() == expected.tobytes(), (d, bound)
    finally:
        network.PADDED_BYTES = chosen


@needs_gpu
def test_the_ring_of_one_rank_on_a_gpu_gives_numpys_bits_by_either_path():
    ring_of_one_rank("cuda")
