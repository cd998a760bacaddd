"""No hang on any path: early exits agreed by every rank; a signal always ends the job.

Each early exit is checked once on several ranks (said once, every rank exits 2); the other
settings errors that take the same path are checked in this process, on one rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import pytest
from conftest import MPIEXEC, ROOT, fedring, mpi_env, run_mpi, wait_for_unlock

RUN = ["--dataset", "synthetic", "--model", "mlp", "--clients", "4", "--rounds", "3", "--eval-every", "1", "--quiet"]
#: a stuck-rank job hangs in round 4: eight rounds leave four for it to resume
LONG = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--clients",
    "4",
    "--rounds",
    "8",
    "--eval-every",
    "1",
    "--checkpoint-every",
    "2",
    "--quiet",
]


def said_once(proc, text):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert text in proc.stderr, proc.stderr
    assert proc.stderr.count("fedring: error") == 1 and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def complete(tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "x.h5"
    fedring(1, *RUN, "--out", str(out))
    return out


@pytest.mark.mpi
def test_resume_of_a_complete_file_exits_2_on_every_rank(complete):
    proc = fedring(2, *RUN, "--out", str(complete), "--resume", check=False, timeout=60)
    said_once(proc, f"resume: {complete} is already complete: nothing to resume")


def test_resume_with_other_settings_exits_2(complete, tmp_path, fedring_cli):
    out = tmp_path / "x.h5"
    out.write_bytes(complete.read_bytes())
    with h5py.File(out, "r+") as f:
        f.attrs["status"] = "preempted"
    proc = fedring_cli(*RUN, "--seed", "1", "--out", out, "--resume")
    said_once(proc, "was written with other settings (file -> given): seed: 0 -> 1")


def test_resume_without_a_checkpoint_exits_2(complete, tmp_path, fedring_cli):
    out = tmp_path / "x.h5"
    out.write_bytes(complete.read_bytes())
    with h5py.File(out, "r+") as f:
        f.attrs["status"] = "failed"
        del f["checkpoint"]
    proc = fedring_cli(*RUN, "--out", out, "--resume")
    said_once(proc, "has no checkpoint: start it again with --overwrite")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resume_of_a_damaged_file_exits_2_and_leaves_it_alone(complete, tmp_path, fedring_cli, damage):
    out = tmp_path / "x.h5"
    data = complete.read_bytes()
    out.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"\x00not hdf5" * 1000)
    before = out.read_bytes()
    proc = fedring_cli(*RUN, "--out", out, "--resume")
    said_once(proc, f"resume: {out} is not a readable fedring results file")
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["x.h5"]


def test_existing_file_without_overwrite_exits_2(complete, fedring_cli):
    proc = fedring_cli(*RUN, "--out", complete)
    said_once(proc, "pass --overwrite to replace it")


@pytest.mark.mpi
def test_sweep_refuses_to_run_under_mpiexec(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text('dataset = "synthetic"\n')
    proc = fedring(2, "sweep", str(grid), check=False, timeout=60)
    said_once(proc, "sweep: runs in one process and starts the MPI jobs itself: run it without mpiexec")


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args,text",
    [
        (["conformal", "labelshift", "--trials", "2"], "ranks: the gaussians experiment has 2 agents"),
        (
            ["conformal", "prism", "--clients", "3", "--participants", "2", "--byzantine", "1"],
            "clients: 3 clients on 4 MPI ranks: need clients >= ranks",
        ),
    ],
)
def test_conformal_setting_errors_exit_2_on_every_rank(tmp_path, args, text):
    """The one multi-rank settings error of each conformal task: one wrong for the number of ranks."""
    proc = fedring(4, *args, "--out", str(tmp_path / "c.h5"), check=False, timeout=120)
    said_once(proc, text)
    assert not list(tmp_path.iterdir())


def test_conformal_setting_error_exits_2(tmp_path, fedring_cli):
    proc = fedring_cli("conformal", "prism", "--alpha", "2", "--out", tmp_path / "c.h5")
    said_once(proc, "alpha: must be in (0, 1)")
    assert not list(tmp_path.iterdir())


# ---- signals ------------------------------------------------------------------------------

HANG = """
import os, sys, time
import fedring.train.loop as training
original = training.train_round
def train_round(tr, t):
    if tr.comm.rank == 1 and t == 3:
        open(sys.argv[1], "w").write(str(os.getpid()))
        while True:  # a rank stuck inside a round (it never reaches the next message)
            time.sleep(1)
    return original(tr, t)
training.train_round = train_round
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


def start_hung_job(tmp_path, grace: float):
    script, pid_file, out = tmp_path / "hang.py", tmp_path / "pid", tmp_path / "hang.h5"
    script.write_text(HANG)
    args = [*LONG, "--set", f"stop_grace={grace}", "--out", str(out)]
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "2", sys.executable, str(script), str(pid_file), *args],
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.monotonic()
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() - t0 < 60 and proc.poll() is None, "the job did not reach the hang"
        time.sleep(0.2)
    time.sleep(1)  # rank 0 is now blocked in the round's first message to rank 1
    return proc, int(pid_file.read_text()), out


def ends_within(proc, seconds: float):
    t0 = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job hung after the signal") from None
    return time.monotonic() - t0, stderr


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
@pytest.mark.parametrize("peer", ["hung", "stopped"])
def test_signal_ends_a_job_with_a_stuck_rank_and_keeps_every_round(tmp_path, peer):
    proc, pid, out = start_hung_job(tmp_path, grace=3)
    if peer == "stopped":
        os.kill(pid, signal.SIGSTOP)  # the peer cannot even run its signal handler
    proc.send_signal(signal.SIGTERM)
    elapsed, stderr = ends_within(proc, 3 + 10)
    assert proc.returncode == 75, stderr
    assert elapsed < 3 + 10  # rank 0 escalates after the grace period (its peers 10 s later)
    assert "the job did not stop cleanly after SIGTERM; aborting it" in stderr
    wait_for_unlock(out)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "preempted"
        assert f["metrics/round"][:].tolist() == [1, 2, 3]  # every completed round
    fedring(2, *LONG, "--out", str(out), "--resume")  # and it resumes from its last checkpoint (round 2)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "complete" and f["metrics/round"][:].tolist() == list(range(1, 9))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
def test_a_second_signal_aborts_at_once(tmp_path):
    proc, _, out = start_hung_job(tmp_path, grace=120)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1)
    proc.send_signal(signal.SIGUSR1)
    elapsed, stderr = ends_within(proc, 10)
    assert proc.returncode == 75 and elapsed < 10, stderr
    wait_for_unlock(out)
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "preempted"


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_75(tmp_path):
    out = tmp_path / "c.h5"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedring", *LONG[:-1], "--rounds", "100000", "--out", str(out)],
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("fedring: train: ring topology")  # the banner, then
    assert proc.stdout.readline().startswith("round")  # the first round
    proc.send_signal(signal.SIGINT)
    _, stderr = ends_within(proc, 30)
    assert proc.returncode == 75 and "SIGINT: stopping after the current round" in stderr
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "preempted"


FSIZE_LIMIT = """
import resource, sys
from mpi4py import MPI
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_a_results_file_that_cannot_grow_fails_clearly_and_keeps_every_round(tmp_path):
    """The file may not grow past 3 MiB (as under ``ulimit -f``): the checkpoint of round 10
    would pass the limit minus the reserve, so the job stops with one message before writing.
    The cnn's size sets the round."""
    script, out = tmp_path / "fsize.py", tmp_path / "x.h5"
    script.write_text(FSIZE_LIMIT)
    proc = run_mpi(
        2,
        [
            str(script),
            str(3 << 20),
            *LONG[:-1],
            "--model",
            "cnn",
            "--rounds",
            "400",
            "--checkpoint-every",
            "5",
            "--out",
            str(out),
        ],
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"fedring: error (rank 0): {out} cannot grow: 1.5 MiB left for it" in proc.stderr
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "failed" and f["metrics/round"][:].tolist() == list(range(1, 11))
