"""The fault matrix: how a fedring job ends under faults, measured on this machine.

    python benchmarks/fault_matrix.py [--kills 10] [--memory-ranks 100] [--only NAME ...] [--json out.json]

Rows (``--only`` picks some; ``docs/reliability.md`` quotes a full run):

- ``kill9``: ``kill -9`` of one rank (each rank in turn) at a random round, ``--kills`` times (4 ranks,
  8 clients, synthetic data): seconds until ``mpiexec`` returns, and whether the results file
  opens with every round completed before the kill (and resumes to completion).
- ``sigterm-checkpoint``: SIGTERM delivered while a checkpoint is being written: the job
  finishes the round, exits 75, and the file and its checkpoint are readable.
- ``sigkill-checkpoint``: SIGKILL of rank 0 half-way through writing a checkpoint: the previous
  checkpoint is intact and ``--resume`` ends bit-identical to an uninterrupted run.
- ``disk-full``: the file system fills up mid-run (a 4 MiB tmpfs, filled by another process;
  needs root), and the file may not grow past 3 MiB (``RLIMIT_FSIZE``, as ``ulimit -f``): a
  clear failure, ``status`` where it can still be written, earlier rounds readable.
- ``damaged-resume``: a truncated and a corrupted file given to ``--resume``: exit 2, a clear
  message, the file untouched.
- ``memory``: ``--memory-ranks`` ranks, 200 rounds, synthetic data: resident memory of every
  rank sampled through the run; growth from round 10 to the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec") or "mpiexec"
SMALL = ["--dataset", "synthetic", "--clients", "8", "--eval-every", "1", "--checkpoint-every", "5"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def launch(ranks: int, args: list[str], script: Path | None = None, **kw) -> subprocess.Popen:
    program = [str(script)] if script else ["-m", "fedring"]
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, *program, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def rank_pids(marker: str) -> dict[int, int]:
    """Rank -> pid of the python processes whose command line contains ``marker`` (MPICH sets PMI_RANK)."""
    out = {}
    for pid in map(int, subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" not in cmdline:
            continue
        for item in environ:
            if item.startswith(b"PMI_RANK="):
                out[int(item.split(b"=")[1])] = pid
    return out


def wait_round(proc: subprocess.Popen, target: int) -> None:
    """Read rank 0's progress lines until round ``target`` is reported."""
    for line in proc.stdout:
        m = re.match(r"round\s+(\d+)/", line)
        if m and int(m.group(1)) >= target:
            return
    raise RuntimeError(f"the job ended before round {target}: {proc.stderr.read()}")


def unlocked(path: Path, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while True:
        try:
            h5py.File(path, "r").close()
            return
        except BlockingIOError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def state(path: Path) -> dict:
    try:
        with h5py.File(path, "r") as f:
            rounds = f["metrics/round"][:].tolist() if "metrics/round" in f else []
            return {
                "opens": True,
                "status": str(f.attrs["status"]),
                "rounds": rounds,
                "contiguous": rounds == list(range(1, len(rounds) + 1)),
            }
    except OSError as e:
        return {"opens": False, "error": str(e)}


def final_model(path: Path) -> bytes:
    with h5py.File(path, "r") as f:
        return f["model/final"][:].tobytes()


# ---- rows -----------------------------------------------------------------------------


def kill9(tmp: Path, kills: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    trials = []
    for k in range(kills):
        out = tmp / f"kill{k}.h5"
        at, victim = rng.randint(2, 40), k % 4  # every rank in turn: rank 0 writes the file
        proc = launch(4, [*SMALL, "--rounds", "60", "--out", str(out)])
        wait_round(proc, at)
        os.kill(rank_pids(str(out))[victim], signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=300)
        ended = time.monotonic() - t0
        proc.stdout.close()
        proc.stderr.close()
        unlocked(out)
        st = state(out)
        resumed = subprocess.run(
            [sys.executable, "-m", "fedring", *SMALL, "--rounds", "60", "--out", str(out), "--resume", "--quiet"],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
        )
        trials.append(
            {
                "round": at,
                "rank": victim,
                "seconds_to_end": round(ended, 1),
                "exit": proc.returncode,
                "opens": st["opens"],
                "rounds_kept": len(st.get("rounds", [])),
                "kept_all_before_kill": st["opens"] and st["contiguous"] and len(st["rounds"]) >= at,
                "resumed_to_end": resumed.returncode == 0 and state(out)["status"] == "complete",
            }
        )
    return {
        "trials": trials,
        "max_seconds_to_end": max(t["seconds_to_end"] for t in trials),
        "all_readable": all(t["kept_all_before_kill"] for t in trials),
        "all_resumed": all(t["resumed_to_end"] for t in trials),
    }


CHECKPOINT_FAULT = """
import os, signal, sys
import fedring.results as results
original = results.ResultsFile.write_checkpoint
calls = []
def write_checkpoint(self, arrays, attrs):
    calls.append(1)
    if len(calls) == 3:  # the third checkpoint (round 10): a fault half-way through writing it
        slot = self.h5.require_group("checkpoint").require_group(
            "b" if self.h5["checkpoint"].attrs.get("current") == "a" else "a")
        slot["w"][:1000] = 0.0  # part of the new slot written...
        self.h5.flush()
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return original(self, arrays, attrs)
results.ResultsFile.write_checkpoint = write_checkpoint
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


def checkpoint_fault(tmp: Path, sig: str) -> dict:
    script = tmp / "ckpt.py"
    script.write_text(CHECKPOINT_FAULT)
    ref, out = tmp / f"ref-{sig}.h5", tmp / f"ckpt-{sig}.h5"
    args = [*SMALL, "--rounds", "20", "--quiet"]
    subprocess.run([sys.executable, "-m", "fedring", *args, "--out", str(ref)], cwd=ROOT, env=env(), check=True)
    proc = subprocess.run(
        [sys.executable, str(script), sig, *args, "--out", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    st = state(out)
    with h5py.File(out, "r") as f:
        from fedring.results import read_checkpoint

        ckpt_round = read_checkpoint(f)[1]["round"]
    resumed = subprocess.run(
        [sys.executable, "-m", "fedring", *args, "--out", str(out), "--resume"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    return {
        "exit": proc.returncode,
        "status": st.get("status"),
        "rounds_kept": len(st.get("rounds", [])),
        "checkpoint_round": ckpt_round,
        "resumed": resumed.returncode == 0,
        "bit_identical_to_uninterrupted": resumed.returncode == 0 and final_model(out) == final_model(ref),
    }


FSIZE_LIMIT = """
import resource, sys
from mpi4py import MPI
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


def disk_full(tmp: Path) -> dict:
    rows = {}
    args = [*SMALL, "--rounds", "400", "--checkpoint-every", "5"]
    if os.geteuid() == 0 and shutil.which("mount"):
        mnt = tmp / "tmpfs"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
        try:
            out = mnt / "full.h5"
            proc = launch(2, [*args, "--out", str(out)])
            wait_round(proc, 20)
            filler = mnt / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until ENOSPC
            _, err = proc.communicate(timeout=120)
            free_before = shutil.disk_usage(mnt).free
            filler.unlink()
            st = state(out)
            rows["tmpfs"] = {
                "exit": proc.returncode,
                "message": first_error(err),
                "free_bytes_left": free_before,
                **st,
                "rounds": len(st.get("rounds", [])),
                "filled_after_round": 20,
            }
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
    # ulimit -f on the whole job would stop MPICH itself (its shared-memory transport writes
    # files): the limit is set in each rank once MPI is up, so only the results file hits it.
    script, out = tmp / "fsize.py", tmp / "fsize.h5"
    script.write_text(FSIZE_LIMIT)
    proc = launch(2, [str(3 << 20), *args, "--out", str(out)], script=script)
    _, err = proc.communicate(timeout=600)
    st = state(out)
    rows["file size limit 3 MiB"] = {
        "exit": proc.returncode,
        "message": first_error(err),
        **st,
        "rounds": len(st.get("rounds", [])),
        "file_bytes": out.stat().st_size,
    }
    return rows


def first_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln.lower() and not ln.startswith("Abort(")]
    return lines[-1][:200] if lines else ""


def damaged_resume(tmp: Path) -> dict:
    good = tmp / "good.h5"
    subprocess.run(
        [sys.executable, "-m", "fedring", *SMALL, "--rounds", "3", "--quiet", "--out", str(good)],
        cwd=ROOT,
        env=env(),
        check=True,
    )
    rows = {}
    for kind in ("truncated", "corrupted"):
        out = tmp / f"{kind}.h5"
        data = good.read_bytes()
        if kind == "truncated":
            data = data[: len(data) // 2]
        else:
            data = bytearray(data)
            data[:8] = b"garbage!"  # the HDF5 signature
        out.write_bytes(bytes(data))
        proc = launch(2, [*SMALL, "--rounds", "3", "--out", str(out), "--resume"])
        _, err = proc.communicate(timeout=120)
        rows[kind] = {
            "exit": proc.returncode,
            "message": err.strip().splitlines()[-1][:160] if err.strip() else "",
            "file_untouched": out.read_bytes() == bytes(data),
        }
    return rows


def memory(tmp: Path, ranks: int) -> dict:
    out = tmp / "mem.h5"
    proc = launch(
        ranks,
        ["--dataset", "synthetic", "--clients", str(ranks), "--rounds", "200", "--eval-every", "10", "--out", str(out)],
    )
    samples: dict[int, dict[int, int]] = {}  # round -> rank -> RSS (kB)
    pids: dict[int, int] = {}
    os.set_blocking(proc.stdout.fileno(), False)
    buffer, current = "", 0
    while proc.poll() is None:
        with contextlib.suppress(TypeError, BlockingIOError):
            buffer += proc.stdout.read() or ""
        for m in re.finditer(r"round\s+(\d+)/", buffer):
            current = max(current, int(m.group(1)))
        buffer = buffer[-200:]
        if len(pids) < ranks:
            pids = rank_pids(str(out))
        if current:
            snap = {}
            for rank, pid in pids.items():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    snap[rank] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
                except (OSError, AttributeError):
                    pass
            if len(snap) == ranks:
                samples[current] = snap
        time.sleep(1.0)
    rounds = sorted(samples)
    first = next(r for r in rounds if r >= 10)
    last = rounds[-1]
    a = np.array([samples[first][r] for r in range(ranks)], float)
    b = np.array([samples[last][r] for r in range(ranks)], float)
    growth = (b - a) / a
    return {
        "ranks": ranks,
        "exit": proc.returncode,
        "round_from": first,
        "round_to": last,
        "rss_mib_median_from": round(float(np.median(a)) / 1024, 1),
        "rss_mib_median_to": round(float(np.median(b)) / 1024, 1),
        "growth_median_percent": round(100 * float(np.median(growth)), 2),
        "growth_max_percent": round(100 * float(growth.max()), 2),
        "total_rss_gib_to": round(float(b.sum()) / 2**20, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--memory-ranks", type=int, default=100)
    p.add_argument(
        "--only",
        nargs="+",
        choices=["kill9", "sigterm-checkpoint", "sigkill-checkpoint", "disk-full", "damaged-resume", "memory"],
    )
    p.add_argument("--json", metavar="FILE", help="write the rows measured (into FILE's other rows, if it exists)")
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fedring-faults-") as d:
        tmp = Path(d)
        todo = args.only or [
            "kill9",
            "sigterm-checkpoint",
            "sigkill-checkpoint",
            "disk-full",
            "damaged-resume",
            "memory",
        ]
        for name in todo:
            t0 = time.monotonic()
            if name == "kill9":
                rows[name] = kill9(tmp, args.kills)
            elif name == "sigterm-checkpoint":
                rows[name] = checkpoint_fault(tmp, "SIGTERM")
            elif name == "sigkill-checkpoint":
                rows[name] = checkpoint_fault(tmp, "SIGKILL")
            elif name == "disk-full":
                rows[name] = disk_full(tmp)
            elif name == "damaged-resume":
                rows[name] = damaged_resume(tmp)
            else:
                rows[name] = memory(tmp, args.memory_ranks)
            print(f"== {name} ({time.monotonic() - t0:.0f} s)\n{json.dumps(rows[name], indent=1)}", flush=True)
    if args.json:  # --only updates its rows of an existing file
        path = Path(args.json)
        earlier = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**earlier, **rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
