"""What client sampling costs: time per round and peak memory per rank, participation 1.0 against less.

    python benchmarks/participation_cost.py [--ranks 4] [--clients 100] [--rounds 8] [--repeat 2]

Runs the Fashion-MNIST CNN with ``--clients`` clients on ``--ranks`` ranks, on the ring (mean) and
on a server (median), with every participation of ``--participation`` (default 1.0 and 0.1), the
runs interleaved ``--repeat`` times so that the machine's load falls on all of them alike; each
job under ``benchmarks/peak_memory.sh``. Time per round: the seconds between the evaluations at
rounds ``rounds / 2`` and ``rounds`` (``/metrics/wall_seconds``) over ``rounds / 2`` rounds (one
test-set evaluation included), best of the repeats; memory: the largest peak resident set (VmHWM)
of a rank. Prints a Markdown table with the ratios to participation 1.0 (docs/training.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parent.parent


def run(ranks: int, args: list[str], out: Path) -> tuple[float, int]:
    """One job: (seconds per round, the largest rank's peak RSS in MiB)."""
    cmd = [str(ROOT / "benchmarks" / "peak_memory.sh"), "mpiexec", "-n", str(ranks), sys.executable, "-m", "fedring"]
    proc = subprocess.run([*cmd, "run", *args, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    peak = max(int(m) for m in re.findall(r"rank \d+: peak RSS (\d+) MiB", proc.stdout))
    with h5py.File(out, "r") as f:
        wall, rounds = f["metrics/wall_seconds"][:], f["metrics/round"][:]
    return float((wall[-1] - wall[-2]) / (rounds[-1] - rounds[-2])), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--participation", type=float, nargs="+", default=[1.0, 0.1])
    a = parser.parse_args()
    common = ["--clients", str(a.clients), "--rounds", str(a.rounds), "--eval-every", str(a.rounds // 2)]
    common += ["--quiet", "--overwrite"]
    topologies = {
        "ring mean": ["--topology", "ring"],
        "server median": ["--topology", "server", "--aggregator", "median"],
    }
    best: dict[tuple[str, float], tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeat):
            for name, topo in topologies.items():
                for p in a.participation:
                    seconds, peak = run(a.ranks, [*common, *topo, "--set", f"participation={p}"], Path(tmp) / "r.h5")
                    old = best.get((name, p), (float("inf"), 0))
                    best[(name, p)] = (min(old[0], seconds), max(old[1], peak))
    print(f"{a.clients} clients on {a.ranks} ranks, CNN, Fashion-MNIST; best of {a.repeat}\n")
    print("| topology | participation | s per round | ratio | peak RSS per rank, MiB | ratio |")
    print("|---|---|---|---|---|---|")
    for name in topologies:
        s0, m0 = best[(name, a.participation[0])]
        for p in a.participation:
            s, m = best[(name, p)]
            print(f"| {name} | {p:g} | {s:.2f} | {s / s0:.3f} | {m} | {m / m0:.3f} |")


if __name__ == "__main__":
    main()
