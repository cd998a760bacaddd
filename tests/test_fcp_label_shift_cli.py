"""Command line, results file and MPI invariance of ``conformal labelshift``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedring import fcp_label_shift as ls
from fedring.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
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


def _read(path):
    with h5py.File(path, "r") as f:
        out = {}
        f["calibration"].visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        return out, dict(f.attrs), dict(f["calibration"].attrs)


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--alpha", "1.5"], "--alpha"),
        (["--gamma", "0"], "--gamma"),
        (["--trials", "0"], "--trials"),
        (["--method", "magic"], "labelshift"),
        (["--method", "weighted", "--epsilon", "1"], "--method"),
        (["--experiment", "logits"], "--experiment"),
        (["--logits", "/nonexistent.npz"], "--logits"),
        (["--target", "3"], "--target"),
        (["--participants", "3"], "--participants"),
        (["--epsilon", "1", "--participants", "1", "--rounds", "1"], "delta"),  # 1 - 2 (1 - 1/2)^1 = 0: no delta
        (["--model-from", "/nonexistent.h5"], "--model-from"),
    ],
)
def test_bad_settings_raise_config_error_before_work(argv, key, tmp_path):
    out = tmp_path / "r.h5"
    with pytest.raises(ConfigError) as e:
        cfg = ls.parse_config([*argv, "--out", str(out)])
        from mpi4py import MPI

        exp = ls._make_experiment(cfg, MPI.COMM_WORLD)
        ls._resolve(cfg, exp)
    assert e.value.key == key
    assert not out.exists()
    assert ls.main([*argv, "--out", str(out)]) == 2


def test_malformed_npz(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, logits=np.zeros((5, 3)))
    with pytest.raises(ConfigError, match="'labels'"):
        ls.load_logits_npz(str(bad))
    np.savez(bad, logits=np.zeros((5, 3)), labels=np.array([0, 1, 2, 3, 0]))
    with pytest.raises(ConfigError, match="labels must be integers"):
        ls.load_logits_npz(str(bad))


def test_refuses_to_overwrite(tmp_path):
    out = tmp_path / "r.h5"
    out.write_bytes(b"precious")
    assert ls.main(["--trials", "1", *FAST, "--out", str(out)]) == 2
    assert out.read_bytes() == b"precious"
    assert ls.main(["--trials", "1", *FAST, "--out", str(out), "--overwrite"]) == 0
    assert h5py.is_hdf5(out)


def test_logits_experiment_writes_distribution_over_runs(logits_npz, tmp_path, capsys):
    out = tmp_path / "r.h5"
    argv = ["--logits", str(logits_npz), "--trials", "3", *FAST, "--sigma-g", "0.5", "--out", str(out)]
    assert ls.main(argv) == 0
    printed = capsys.readouterr().out
    assert "target agent 4 (N=50)" in printed and "significantly worse than DP-FedCP (Fig. 2)" in printed
    data, root, calib = _read(out)
    assert root["status"] == "complete"
    cfg = json.loads(root["config"])
    assert cfg["experiment"] == "logits" and cfg["targets"] == [4]
    for m in ("unweighted-local", "unweighted-global", "oracle", "weighted", "nonprivate", "dp-sigma=0.5"):
        assert data[f"{m}/coverage"].shape == (3, 1)
        assert np.all((data[f"{m}/coverage"] >= 0) & (data[f"{m}/coverage"] <= 1))
        assert data[f"{m}/threshold"].shape == (3, 1, 10)
        assert np.all(data[f"{m}/set_size"] >= 0) and np.all(data[f"{m}/set_size"] <= 10)
    assert data["trial"].tolist() == [0, 1, 2]
    eps = data["dp-sigma=0.5/epsilon"]
    lam_max = data["dp-sigma=0.5/lambda_max"]
    want = ls.epsilon_for_sigma(0.5, 1e-5, 20, 2, 10, 10, float(lam_max[0, 0, 0]))
    assert eps[0, 0, 0] == pytest.approx(want)
    assert json.loads(calib["privacy"])["dp-sigma=0.5"]["epsilon_per_query"] == pytest.approx(eps.max())
    # Algorithm 1's traffic: T rounds x (Delta q, Delta qbar) x 20 columns (2 variants x 10 labels) x 8 bytes
    assert np.all(calib["client_bytes/labelshift/fedavgqe"] == 3 * 20 * 2 * 20 * 8)


def test_results_do_not_depend_on_trial_batch(logits_npz, tmp_path):
    common = ["--logits", str(logits_npz), "--trials", "3", *FAST, "--sigma-g", "1", "--count-noise", "2"]
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert ls.main([*common, "--trial-batch", "1", "--out", str(a)]) == 0
    assert ls.main([*common, "--trial-batch", "3", "--out", str(b)]) == 0
    da, db = _read(a)[0], _read(b)[0]
    assert da.keys() == db.keys()
    for k in da:
        assert np.array_equal(da[k], db[k]), k


def test_all_targets_and_partial_participation(tmp_path):
    out = tmp_path / "r.h5"
    assert ls.main(["--trials", "2", *FAST, "--target", "all", "--participants", "1", "--method", "nonprivate", "unweighted-local", "--out", str(out)]) == 0
    data = _read(out)[0]
    assert data["nonprivate/coverage"].shape == (2, 2)
    assert set(k.split("/")[0] for k in data) == {"nonprivate", "unweighted-local", "trial"}


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
    argv = ["--model-from", str(run), "--save-logits", str(saved), "--trials", "1", *FAST, "--method", "unweighted-global", "--out", str(out)]
    assert ls.main(argv) == 0
    again = ls.load_logits_npz(str(saved))
    assert np.allclose(again[0], logits, atol=1e-5) and np.array_equal(again[1], labels)


def _mpiexec():
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpiexec not found")
    return exe


@pytest.mark.parametrize("experiment", ["gaussians", "logits"])
def test_same_results_on_one_and_two_ranks(experiment, logits_npz, tmp_path):
    """Agents hosted 2/0 vs 1/1 (Gaussians) or 10 vs 5/5 (logits): identical files."""
    exe = _mpiexec()
    args = ["--trials", "2", *FAST, "--sigma-g", "2", "--count-noise", "1.5", "--trial-batch", "2"]
    if experiment == "logits":
        args += ["--logits", str(logits_npz)]
    else:
        args += ["--participants", "1", "--target", "all"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outs = []
    for n in (1, 2):
        out = tmp_path / f"n{n}.h5"
        cmd = [exe, "-n", str(n), sys.executable, "-m", "fedring", "conformal", "labelshift", *args, "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outs.append(_read(out))
    (d1, r1, c1), (d2, r2, c2) = outs
    assert d1.keys() == d2.keys()
    for k in d1:
        assert np.array_equal(d1[k], d2[k]), k
    for k in c1:
        if k.startswith("client_bytes"):
            assert np.array_equal(c1[k], c2[k]), k  # the ledger counts logical clients, not ranks
