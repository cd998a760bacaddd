"""jobs/ against a real SLURM: the one-node cluster of ../shared/tools/local-slurm (started
here; CI runs as root with shared/ beside the repo), or an existing cluster with
FEDRING_TEST_SLURM=1. Skipped, with the reason, where neither is available.

Every wait polls squeue with a deadline, so a broken cluster fails a test instead of hanging.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import ROOT, fedring, mpi_env, wait_for

JOBS = ROOT / "jobs"

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # SLURM jobs that run fedring under mpiexec


@pytest.fixture
def slurm(slurm_cluster):
    """The session's SLURM cluster (conftest's ``slurm_cluster``), or the test is skipped with the reason."""
    if slurm_cluster is not None:
        pytest.skip(slurm_cluster)


def job_env() -> dict:
    env = mpi_env()
    env["FEDRING_PYTHON"] = sys.executable
    env.pop("FEDRING_LAUNCHER", None)
    return env


def squeue(job: str) -> list[tuple[str, str, str]] | None:
    """(task id, state, reason) of the job's tasks still pending or running; None if squeue failed."""
    proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T %r"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return None
    return [tuple(line.split(None, 2)) for line in proc.stdout.splitlines() if line.strip()]


def sbatch_wait(
    args: list[str], tmp_path: Path, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Submit a job and wait for its end: a CompletedProcess with the job's exit code.

    ``sbatch --wait`` checks after 2 s, then after 8 more: a 3-second job would take 10. This polls
    the controller every 0.2 s instead.
    """
    cmd = ["sbatch", "--parsable", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env or job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.strip().split(";")[0]

    def ended():
        show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
        fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
        return fields if fields.get("JobState") in JOB_ENDS else None

    try:
        fields = wait_for(f"job {job} to end", ended, timeout, interval=0.2)
    except AssertionError:
        subprocess.run(["scancel", job], timeout=30)
        raise
    code, signal_number = map(int, fields["ExitCode"].split(":"))
    return subprocess.CompletedProcess(cmd, code or (128 + signal_number if signal_number else 0))


#: the states of a job that has ended (``scontrol show job``'s JobState)
JOB_ENDS = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def test_world_size_mismatch_fails_loudly(slurm, tmp_path):
    """Plain srun (no PMI) would start 2 separate 1-rank runs: the job refuses before the run."""
    env = job_env()
    env["FEDRING_SRUN_MPI"] = "none"
    log = tmp_path / "job.out"
    out = tmp_path / "r.h5"
    proc = sbatch_wait(
        [
            "--job-name=fedring-test",
            "--ntasks=2",
            f"--output={log}",
            str(JOBS / "run.sbatch"),
            "--dataset",
            "synthetic",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        tmp_path,
        env,
    )
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "MPI world size is 1 but SLURM_NTASKS=2" in text
    assert "does not start one MPI job of 2 ranks" in text
    assert not out.exists()


def test_run_script_with_mpiexec_then_skips_complete_file(slurm, tmp_path):
    env = job_env()
    env["FEDRING_LAUNCHER"] = "mpiexec"
    out = tmp_path / "r.h5"
    args = [
        "--job-name=fedring-test",
        "--ntasks=2",
        f"--output={tmp_path / 'job.out'}",
        str(JOBS / "run.sbatch"),
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--clients",
        "3",
        "--rounds",
        "3",
        "--eval-every",
        "1",
        "--out",
        str(out),
    ]
    proc = sbatch_wait(args, tmp_path, env)
    text = (tmp_path / "job.out").read_text()
    assert proc.returncode == 0, text
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "complete"
        assert f.attrs["world_size"] == 2
        assert list(f["metrics/round"][:]) == [1, 2, 3]
    # The same submission again finds the file complete and does nothing.
    proc = sbatch_wait(args, tmp_path, env)
    text = (tmp_path / "job.out").read_text()
    assert proc.returncode == 0, text
    assert text.count("complete: nothing to do") == 1
    assert text.count("-m fedring run") == 1


GRID = """\
dataset = "synthetic"
clients = 4
rounds = {rounds}
eval_every = 2
checkpoint_every = 10
seed = [0, 1]

[sweep]
ranks = 2
out_dir = "{out}"
"""


def test_sweep_survives_preemption(slurm, tmp_path):
    """Submit a 2-config sweep, stop task 0 mid-run with USR1, let SLURM requeue it: all complete.

    The requeued task resumes from the checkpoint its stop wrote, and its final model equals
    an uninterrupted run's bit for bit.
    """
    rounds = 40
    out = tmp_path / "sweep"
    grid = tmp_path / "grid.toml"
    grid.write_text(GRID.format(rounds=rounds, out=out))
    env = job_env()
    proc = subprocess.run(
        [sys.executable, "-m", "fedring", "sweep", str(grid), "--submit"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted array job (\d+)", proc.stdout).group(1)
    try:
        hashes = (next(out.glob("tasks-*.txt"))).read_text().split()
        assert len(hashes) == 2
        log0 = out / "logs" / f"{job}_0.out"

        # Stop task 0 once its run is under way (its signal handler is installed by then).
        wait_for(
            "task 0 to report progress", lambda: log0.is_file() and re.search(r"round +\d+/", log0.read_text()), 90
        )
        subprocess.run(["scancel", "--signal=USR1", f"{job}_0"], check=True, timeout=30)

        # A requeued job waits ~2 minutes (SLURM's BeginTime) before it may start: release it
        # sooner, but not within the second of the requeue, whose revoked job credential
        # (1 s resolution) would also revoke the new start's.
        def requeued():
            return any(t == f"{job}_0" and s == "PENDING" for t, s, _ in squeue(job) or [])

        wait_for("task 0 to be requeued", requeued, 60)
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={job}_0", "StartTime=now"], check=True, timeout=30)
        wait_for("the sweep to finish", lambda: squeue(job) == [], 150, interval=1)
    finally:
        subprocess.run(["scancel", job], timeout=30)

    text0 = log0.read_text()
    assert "stopped by signal after round" in text0, text0
    assert "checkpointed after a stop signal; requeueing" in text0
    assert "resuming from its checkpoint" in text0
    assert "(restart 1)" in text0
    for h in hashes:
        with h5py.File(out / f"{h}.h5", "r") as f:
            assert f.attrs["status"] == "complete", (h, f.attrs["status"])
            assert f.attrs["rounds_completed"] == rounds
            assert list(f["metrics/round"][:]) == list(range(2, rounds + 1, 2))
    # Submitting again finds nothing to do.
    proc = subprocess.run(
        [sys.executable, "-m", "fedring", "sweep", str(grid), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert "(2 complete)" in proc.stdout and "nothing to run" in proc.stdout, proc.stdout

    # Bit-exact against an uninterrupted run of the same config (1 rank: same results).
    ref = tmp_path / "ref.h5"
    fedring(1, "run", "--config", out / "configs" / f"{hashes[0]}.toml", "--out", ref, "--quiet", cwd=tmp_path)
    with h5py.File(ref, "r") as a, h5py.File(out / f"{hashes[0]}.h5", "r") as b:
        assert np.array_equal(a["model/final"][:], b["model/final"][:])
        assert np.array_equal(a["metrics/test_accuracy"][:], b["metrics/test_accuracy"][:])
        assert np.array_equal(a["comm/bytes_sent"][:], b["comm/bytes_sent"][:])
