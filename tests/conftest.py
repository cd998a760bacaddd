"""Shared helpers: run fedring (or a script) under ``mpiexec -n N`` with a hard timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec")


def mpi_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_mpi(n: int, args: list[str], timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n python <args>``; fails the test (not hangs) past ``timeout`` seconds."""
    if n > 1 and MPIEXEC is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def fedring(n: int, *args: str, **kw) -> subprocess.CompletedProcess:
    return run_mpi(n, ["-m", "fedring", *args], **kw)


#: ``python crash.py ROUND ARGS...``: fedring run ARGS, raising in round ROUND (0-based) on every rank.
CRASH_AT_ROUND = """
import sys
import fedring.train.loop as training
original = training.train_round
def train_round(tr, t):
    if t == int(sys.argv[1]):
        raise RuntimeError("injected failure on purpose")
    return original(tr, t)
training.train_round = train_round
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


def crash_at_round(tmp_path: Path, ranks: int, round_: int, args: list[str]) -> subprocess.CompletedProcess:
    """Run fedring ARGS under ``ranks`` ranks with an exception injected in round ``round_``."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH_AT_ROUND)
    proc = run_mpi(ranks, [str(script), str(round_), *args], check=False)
    assert proc.returncode != 0 and "injected failure on purpose" in proc.stderr
    return proc


def wait_for_unlock(path: Path, seconds: float = 30) -> None:
    """Wait until no process holds the HDF5 file lock of ``path`` (a killed rank's lock goes
    with its last file descriptor, which may outlive the launcher by a moment)."""
    import h5py

    deadline = time.time() + seconds
    while True:
        try:
            h5py.File(path, "r").close()
            return
        except BlockingIOError:
            assert time.time() < deadline, f"{path} is still locked: a rank survived"
            time.sleep(0.2)
