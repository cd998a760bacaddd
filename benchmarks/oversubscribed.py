"""Is the oversubscribed single machine slower than with release 0.2.0's comm layer?

Release 0.3.0 changed how point-to-point messages travel (segments of FEDRING_SEGMENT_BYTES,
nonblocking waits under FEDRING_WAIT, BRACE's quantizing overlapped with the transfer;
docs/figures.md, "The wait policy and ring segments"). This script times the same commands
on a checkout of 0.2.0 and on this one, alternated so that both see the same load, and prints
each case's ratio of median wall times (this tree over 0.2.0):

- ``ring`` and ``brace``: 200 rounds of the headline job's training (8 clients on 8 ranks,
  Fashion-MNIST's CNN, 2 Byzantine clients sending Gaussian noise; one evaluation at the end),
  the whole ``mpiexec`` from launch to exit;
- ``bench-comm``: ``mpiexec -n 4 python -m fedring bench comm`` at 2^18-2^22 elements, the ring's
  and BRACE's seconds per size, and MPI's own Allreduce (``native``, the same code in both trees:
  a control for the load, which moves all three alike).

    git archive 76b1835 | (mkdir -p /tmp/fedring-0.2.0 && tar -x -C /tmp/fedring-0.2.0)
    python benchmarks/oversubscribed.py /tmp/fedring-0.2.0 --pairs 2 --out docs/measured/oversubscribed.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

TRAIN = {
    "ring": ["--aggregator", "mean", "--lr", "0.1"],
    "brace": ["--aggregator", "brace", "--lr", "0.003", "--set", "brace.lambda=0.4"],
}


def _run(tree: Path, argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def train_seconds(tree: Path, rule: str, out: Path) -> float:
    argv = ["mpiexec", "-n", "8", sys.executable, "-m", "fedring", "run", "--clients", "8", "--rounds", "200"]
    argv += ["--eval-every", "200", "--attack", "gaussian", "--byzantine", "0.2", *TRAIN[rule]]
    return _run(tree, [*argv, "--out", str(out), "--overwrite", "--quiet"])


def comm_seconds(tree: Path, out: Path) -> list[dict]:
    argv = ["mpiexec", "-n", "4", sys.executable, "-m", "fedring", "bench", "comm"]
    _run(tree, [*argv, "--min-exp", "18", "--max-exp", "22", "--repeats", "5", "--json", str(out)])
    return [r for r in json.loads(out.read_text()) if r["impl"] in ("native", "ring", "brace")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path, help="a checkout of release 0.2.0 (76b1835)")
    p.add_argument("--pairs", type=int, default=2, help="times each case runs on each tree (default 2)")
    p.add_argument("--out", type=Path, help="tidy CSV: case, op, elements, tree, pair, seconds")
    args = p.parse_args(argv)
    trees = {"0.2.0": args.old.resolve(), "current": HERE}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = list(trees.items()) if pair % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                for rule in TRAIN:
                    seconds = train_seconds(tree, rule, Path(tmp) / f"{rule}.h5")
                    rows.append(dict(case="train", op=rule, elements=139960, tree=name, pair=pair, seconds=seconds))
                for r in comm_seconds(tree, Path(tmp) / "comm.json"):
                    row = dict(case="bench-comm", op=r["impl"], elements=r["elements"], tree=name, pair=pair)
                    rows.append({**row, "seconds": r["seconds"]})
                print(f"pair {pair} {name}: done (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    if args.out:
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"{'case':<11}{'op':<7}{'elements':>10}{'0.2.0 s':>10}{'current s':>11}{'current/0.2.0':>15}")
    for key in dict.fromkeys((r["case"], r["op"], r["elements"]) for r in rows):
        med = {
            name: statistics.median(
                r["seconds"] for r in rows if (r["case"], r["op"], r["elements"]) == key and r["tree"] == name
            )
            for name in trees
        }
        print(
            f"{key[0]:<11}{key[1]:<7}{key[2]:>10}{med['0.2.0']:>10.3f}{med['current']:>11.3f}{med['current'] / med['0.2.0']:>15.2f}"
        )


if __name__ == "__main__":
    main()
