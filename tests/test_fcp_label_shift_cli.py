"""Command line, results file, resume and MPI invariance of ``conformal labelshift``."""

import json

import h5py
import numpy as np
import pytest
from conftest import MPIEXEC, fedring, run_mpi

from fedring.cli.run import build_task, section_parser
from fedring.conformal import labelshift as ls
from fedring.conformal.labelshift.task import LabelShiftSettings, privacy_summary
from fedring.conformal.trials import read_calibration
from fedring.errors import ConfigError

FAST = ["--rounds", "20", "--local-steps", "2"]


@pytest.fixture
def logits_npz(tmp_path):
    """A tiny stand-in for a classifier's test logits: 10 classes, 40 examples each."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 40)
    logits = 3.0 * np.eye(10)[labels] + rng.normal(size=(400, 10))
    path = tmp_path / "logits.npz"
    np.savez(path, logits=logits.astype(np.float32), labels=labels)
    return path


def labelshift(*args, ranks=1, check=True):
    return fedring(ranks, "conformal", "labelshift", *map(str, args), check=check, timeout=300)


def prepare(argv):
    """The job ``conformal labelshift argv`` would run, built in this process (one rank)."""
    from mpi4py import MPI

    parser = section_parser("labelshift", LabelShiftSettings, "")
    return build_task(list(map(str, argv)), 1, parser, section="labelshift").prepare(MPI.COMM_WORLD).job


def read(path):
    """``/calibration`` (attrs, rows), the ``/comm`` rows and the root attributes."""
    attrs, rows = read_calibration(path)
    with h5py.File(path, "r") as f:
        comm = {name: ds[()] for name, ds in f["comm"].items()}
        root = dict(f.attrs)
    return attrs, rows, comm, root


def assert_same_rows(a, b):
    (attrs_a, rows_a, comm_a, _), (attrs_b, rows_b, comm_b, _) = read(a), read(b)
    assert attrs_a["cases"] == attrs_b["cases"]
    assert rows_a.keys() == rows_b.keys() and comm_a.keys() == comm_b.keys()
    for k in rows_a:
        assert np.array_equal(rows_a[k], rows_b[k], equal_nan=True), k
    for k in comm_a:
        assert np.array_equal(comm_a[k], comm_b[k]), k  # the ledger counts logical clients, not ranks


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--alpha", "1.5"], "labelshift.alpha"),
        (["--gamma", "0"], "labelshift.gamma"),
        (["--trials", "0"], "labelshift.trials"),
        (["--methods", "magic"], "labelshift.methods"),
        (["--methods", "weighted", "--epsilon", "1"], "labelshift.methods"),
        (["--experiment", "logits"], "labelshift.experiment"),
        (["--logits", "/nonexistent.npz"], "labelshift.logits"),
        (["--targets", "3"], "labelshift.targets"),
        (["--participants", "3"], "labelshift.participants"),
        (["--epsilon", "1", "--participants", "1", "--rounds", "1"], "labelshift.delta"),  # 1 - 2 (1 - 1/2)^1 = 0
        (["--model-from", "/nonexistent.h5"], "labelshift.model_from"),
    ],
)
def test_bad_settings_raise_config_error_before_work(argv, key, tmp_path, fedring_cli):
    out = tmp_path / "r.h5"
    with pytest.raises(ConfigError) as e:
        prepare([*argv, "--out", out])
    assert e.value.key == key
    assert not out.exists()
    proc = fedring_cli("conformal", "labelshift", *argv, "--out", out)
    assert proc.returncode == 2 and f"{key}:" in proc.stderr, proc.stderr
    assert not out.exists()


def test_malformed_npz(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, logits=np.zeros((5, 3)))
    with pytest.raises(ConfigError, match="'labels'"):
        ls.load_logits_npz(str(bad))
    np.savez(bad, logits=np.zeros((5, 3)), labels=np.array([0, 1, 2, 3, 0]))
    with pytest.raises(ConfigError, match="labels must be integers"):
        ls.load_logits_npz(str(bad))


@pytest.mark.slow
def test_refuses_to_overwrite(tmp_path, fedring_cli):
    out = tmp_path / "r.h5"
    out.write_bytes(b"precious")
    assert fedring_cli("conformal", "labelshift", "--trials", "1", *FAST, "--out", out).returncode == 2
    assert out.read_bytes() == b"precious"
    assert labelshift("--trials", "1", *FAST, "--out", out, "--overwrite").returncode == 0
    assert h5py.is_hdf5(out)


@pytest.mark.slow
def test_logits_experiment_writes_distribution_over_runs(logits_npz, tmp_path):
    out = tmp_path / "r.h5"
    argv = ["--logits", logits_npz, "--trials", "3", *FAST, "--sigma-g", "0.5", "--trial-batch", "3"]
    printed = labelshift(*argv, "--out", out).stdout
    assert "target agent 4 (N=50)" in printed and "significantly worse than DP-FedCP (Fig. 2)" in printed
    attrs, rows, comm, root = read(out)
    assert root["status"] == "complete" and root["task"] == "labelshift"
    assert attrs["settings"]["experiment"] == "logits" and attrs["settings"]["targets"] == [4]
    assert attrs["size_kind"] == "set size" and attrs["alpha"] == 0.1
    labels = [case["label"] for case in attrs["cases"]]
    methods = ("unweighted-local", "unweighted-global", "oracle", "weighted", "nonprivate", "dp-sigma=0.5")
    assert labels == [f"{m}/target 4" for m in methods]
    assert rows["trial"].tolist() == [0, 1, 2]
    assert rows["coverage"].shape == rows["size"].shape == (3, 6)
    assert np.all((rows["coverage"] >= 0) & (rows["coverage"] <= 1))
    assert rows["threshold"].shape == (3, 6, 10)
    assert np.all(rows["size"] >= 0) and np.all(rows["size"] <= 10)
    assert np.all(np.isnan(rows["exact_threshold"][:, :4])) and not np.any(np.isnan(rows["exact_threshold"][:, 4:]))
    dp = labels.index("dp-sigma=0.5/target 4")
    assert attrs["cases"][dp] == {
        "label": "dp-sigma=0.5/target 4",
        "method": "dp",
        "target": 4,
        "sigma_g": 0.5,
        "weights": "exact counts",
        "delta": 1e-5,
        "count_noise": 0.0,
        "count_noise_epsilon": 0.0,
    }
    eps, lam_max = rows["epsilon"][:, dp], rows["lambda_max"][:, dp]
    want = ls.epsilon_for_sigma(0.5, 1e-5, 20, 2, 10, 10, float(lam_max[0, 0]))
    assert eps[0, 0] == pytest.approx(want)
    privacy = privacy_summary(attrs["cases"], rows)["dp-sigma=0.5/target 4"]
    assert privacy["epsilon_per_query"] == pytest.approx(eps.max())
    assert privacy["epsilon_composed"] == pytest.approx(eps.sum(axis=-1).max()) and privacy["delta_composed"] == 1e-4
    # Protocol bytes per client and trial: counts (1 weight source x 10 labels x 8 bytes), weight sums
    # (1 source x 1 target x 10 labels x 8), Algorithm 1: T rounds x (Delta q, Delta qbar) x 20 columns
    # (2 variants x 10 labels) x 8 bytes. The scores the baselines pool are not protocol traffic.
    assert np.all(comm["bytes_sent"] == 80 + 80 + 20 * 2 * 20 * 8)
    # the server, to each of 10 agents: weights (10 labels), subsample sizes (10 labels x 10 agents),
    # sigma_g (20 columns), q_t (20 columns, T rounds) and the result (20 columns), 8 bytes each
    assert np.all(comm["server_bytes_sent"] == 10 * 8 * (10 + 100 + 20 + 20 * 20 + 20))
    # the same batch in this process: Algorithm 1's phase alone, and the same rows
    job = prepare([*argv, "--out", tmp_path / "unused.h5"])
    again = job.run_batch([0, 1, 2])
    assert np.all(job.net.ledger.phase_bytes("labelshift/fedavgqe") == 3 * 20 * 2 * 20 * 8)
    for t, row in enumerate(again):
        for k, v in row.items():
            assert np.array_equal(v, rows[k][t], equal_nan=True), k


@pytest.mark.slow
def test_results_do_not_depend_on_trial_batch(logits_npz, tmp_path):
    common = ["--logits", logits_npz, "--trials", "3", *FAST, "--sigma-g", "1", "--count-noise", "2", "--quiet"]
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    labelshift(*common, "--trial-batch", "1", "--out", a)
    labelshift(*common, "--trial-batch", "3", "--out", b)
    assert_same_rows(a, b)


STOP_AFTER_FIRST_BATCH = """
import os, signal, sys
from fedring.conformal.labelshift import task
original = task.LabelShiftJob.run_batch
def run_batch(self, trials):
    rows = original(self, trials)
    if trials[0] == 0:
        os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal would: stop after this batch
    return rows
task.LabelShiftJob.run_batch = run_batch
from fedring.cli import main
sys.exit(main(["conformal", "labelshift", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_stopped_and_resumed_run_has_the_rows_of_an_uninterrupted_one(tmp_path):
    args = [
        "--trials",
        "5",
        "--trial-batch",
        "2",
        *FAST,
        "--sigma-g",
        "1",
        "--count-noise",
        "1",
        "--participants",
        "1",
        "--targets",
        "all",
        "--quiet",
    ]
    whole, resumed = tmp_path / "whole.h5", tmp_path / "resumed.h5"
    labelshift(*args, "--out", whole)
    script = tmp_path / "stop.py"
    script.write_text(STOP_AFTER_FIRST_BATCH)
    proc = run_mpi(1, [str(script), *args, "--out", str(resumed)], check=False)
    assert proc.returncode == 75, proc.stderr
    with h5py.File(resumed, "r") as f:
        assert f.attrs["status"] == "preempted" and f["calibration/trial"][()].tolist() == [0, 1]
    labelshift(*args, "--out", resumed, "--resume")
    assert read(resumed)[3]["status"] == "complete"
    assert_same_rows(whole, resumed)


@pytest.mark.slow
def test_all_targets_and_partial_participation(tmp_path):
    out = tmp_path / "r.h5"
    labelshift(
        "--trials",
        "2",
        *FAST,
        "--targets",
        "all",
        "--participants",
        "1",
        "--methods",
        "nonprivate",
        "unweighted-local",
        "--out",
        out,
    )
    attrs, rows, _, _ = read(out)
    assert rows["coverage"].shape == (2, 4)  # 2 trials x (2 targets x 2 methods)
    assert {c["method"] for c in attrs["cases"]} == {"nonprivate", "unweighted-local"}
    assert [c["target"] for c in attrs["cases"]] == [1, 1, 2, 2]


@pytest.mark.slow
def test_model_from_training_run(tmp_path):
    """``--model-from``: rebuild fedring's CNN from /model/final (synthetic data set: no download)."""
    torch = pytest.importorskip("torch")  # noqa: F841
    from fedring.train import models

    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        f.attrs["config"] = json.dumps({"model": "cnn", "seed": 3, "dataset": "synthetic"})
        f["model/final"] = models.flatten(models.make_model("cnn", 3))
    logits, labels = ls.logits_from_run(str(run))
    assert logits.shape == (labels.size, 10) and labels.size > 0
    saved = tmp_path / "saved.npz"
    out = tmp_path / "r.h5"
    labelshift(
        "--model-from",
        run,
        "--save-logits",
        saved,
        "--trials",
        "1",
        *FAST,
        "--methods",
        "unweighted-global",
        "--out",
        out,
    )
    again = ls.load_logits_npz(str(saved))
    assert np.allclose(again[0], logits, atol=1e-5) and np.array_equal(again[1], labels)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
@pytest.mark.parametrize("experiment", ["gaussians", "logits"])
def test_same_results_on_one_and_two_ranks(experiment, logits_npz, tmp_path):
    """Agents hosted 2/0 vs 1/1 (Gaussians) or 10 vs 5/5 (logits): identical rows and bytes."""
    args = ["--trials", "2", *FAST, "--sigma-g", "2", "--count-noise", "1.5", "--trial-batch", "2", "--quiet"]
    if experiment == "logits":
        args += ["--logits", logits_npz]
    else:
        args += ["--participants", "1", "--targets", "all"]
    outs = [tmp_path / f"n{n}.h5" for n in (1, 2)]
    for n, out in zip((1, 2), outs):
        labelshift(*args, "--out", out, ranks=n)
    assert [read(out)[3]["world_size"] for out in outs] == [1, 2]
    assert_same_rows(*outs)
