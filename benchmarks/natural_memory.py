"""Memory per rank of the natural partition at 3,500 clients: 1 rank against 2.

    python benchmarks/natural_memory.py [--users 3500] [--train 5] [--test 2] [--ranks 1 2]

Writes a synthetic FEMNIST in LEAF's format into a temporary folder: ``--users`` writers, each with
``--train`` training and ``--test`` test images, 100 writers per JSON file as LEAF's
``preprocess.sh`` writes them, the pixels mostly 1.0 (FEMNIST's background) and the rest
``k / 255``. Then, for each rank count, one MPI job in which every rank builds the data of its
block of the ``--users`` clients (``partition = natural``: one writer per client) as a training
run does (:class:`fedring.train.data.FederatedData`: the users, the partition, its clients'
samples and labels), and reports its resident set after the imports (numpy.random included,
which the partition imports lazily and a run has long imported) and its peak (``ru_maxrss``).
Prints a Markdown table and, of the largest rank on 2 ranks against 1 rank, two ratios: of the
peaks, and of the peaks less the RSS after the imports (the part the data governs). Training itself
is not run (3,500 clients of LEAF's CNN hold ``clients x d`` float32 upload rows, 92 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
USERS_PER_FILE = 100

#: run on every rank: build the rank's FederatedData and print one JSON line of its figures
WORKER = """
import json, resource, sys
import numpy.random  # imported lazily by the partition (by a run, long before): not the data's memory
from mpi4py import MPI
from fedring.comm import block_bounds
from fedring.train.data import FederatedData

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024

comm = MPI.COMM_WORLD
users, root = int(sys.argv[1]), sys.argv[2]
bounds = block_bounds(users, comm.size)
imported = rss()
data = FederatedData("femnist", root, users, range(bounds[comm.rank], bounds[comm.rank + 1]), "natural", 0.5, seed=0)
held = sum(s.x.nbytes for s in data.shards) + data.test.x.nbytes
figures = dict(rank=comm.rank, imported=imported, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
               held=held / 2**20, clients=len(data.shards))
for line in comm.gather(json.dumps(figures)) or []:
    print(line)
"""


def write_femnist(root: Path, users: int, train: int, test: int) -> None:
    """LEAF's ``train/`` and ``test/`` JSON files of ``users`` writers."""
    rng = np.random.default_rng(0)
    for part, per_user in (("train", train), ("test", test)):
        (root / part).mkdir(parents=True)
        for first in range(0, users, USERS_PER_FILE):
            names = [f"f{u:04d}_{u % 100:02d}" for u in range(first, min(first + USERS_PER_FILE, users))]
            user_data = {}
            for name in names:
                ink = rng.random((per_user, 784)) < 0.2
                pixels = np.where(ink, rng.integers(0, 255, (per_user, 784)) / 255, 1.0)
                user_data[name] = {"x": pixels.tolist(), "y": rng.integers(0, 62, per_user).tolist()}
            doc = {"users": names, "num_samples": [per_user] * len(names), "user_data": user_data}
            (root / part / f"all_data_{first // USERS_PER_FILE}_niid_0_keep_0_{part}_9.json").write_text(
                json.dumps(doc)
            )


def job(ranks: int, users: int, root: Path) -> list[dict]:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-c", WORKER, str(users), str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{ranks} ranks failed:\n{proc.stdout}\n{proc.stderr}")
    return sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda f: f["rank"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=3500)
    parser.add_argument("--train", type=int, default=5, help="training images per writer")
    parser.add_argument("--test", type=int, default=2, help="test images per writer")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    a = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="natural_memory."))
    try:
        write_femnist(tmp, a.users, a.train, a.test)
        files = list(tmp.rglob("*.json"))
        size = sum(p.stat().st_size for p in files) / 2**20
        print(f"{a.users} writers x ({a.train} + {a.test}) images, {size:.0f} MiB of JSON in {len(files)} files\n")
        print(
            "| ranks | rank | clients | RSS after imports, MiB | peak RSS, MiB | peak less imports, MiB "
            "| samples held, MiB |"
        )
        print("|---|---|---|---|---|---|---|")
        peaks, added = {}, {}
        for ranks in a.ranks:
            figures = job(ranks, a.users, tmp)
            for f in figures:
                print(
                    f"| {ranks} | {f['rank']} | {f['clients']} | {f['imported']} | {f['peak']} | "
                    f"{f['peak'] - f['imported']} | {f['held']:.1f} |"
                )
            peaks[ranks] = max(f["peak"] for f in figures)
            added[ranks] = max(f["peak"] - f["imported"] for f in figures)
        first = a.ranks[0]
        for ranks in a.ranks[1:]:
            print(
                f"\nlargest peak on {ranks} ranks / on {first}: {peaks[ranks] / peaks[first]:.3f}; "
                f"less the RSS after the imports: {added[ranks] / added[first]:.3f}"
            )
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
