"""Check that a code change leaves training results bit-identical.

    python benchmarks/same_results.py run DIR [RANKS]   # run the reference configs with the code here
    python benchmarks/same_results.py compare OLD NEW

``run`` writes one results file per reference config (small synthetic runs that cover both
topologies, the ring sign rules, stateful server rules, a data attack, an omniscient attack,
local steps, client sampling on both topologies and batched clients) on RANKS ranks (default 2).
``compare`` checks that every dataset and root attribute of each OLD
file exists in the NEW file with identical bytes; datasets and attributes added by NEW, and
the ``config`` and ``fedring_version`` attributes, are ignored. An OLD file's ``/brace/X`` (as
0.2.0 wrote the ring rules' figures) is compared with the NEW file's ``/ring/X``. Exit code 1
on any difference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

COMMON = ["--dataset", "synthetic", "--rounds", "12", "--eval-every", "4", "--quiet", "--overwrite"]
CONFIGS = {
    "ring-mean": ["--clients", "6"],
    "ring-brace-gaussian": [
        "--clients",
        "8",
        "--aggregator",
        "brace",
        "--lr",
        "0.01",
        "--byzantine",
        "0.25",
        "--attack",
        "gaussian",
        "--set",
        "brace.lambda=1",
    ],
    "ring-signsgd-alie": [
        "--clients",
        "8",
        "--aggregator",
        "signsgd",
        "--lr",
        "0.01",
        "--byzantine",
        "2",
        "--attack",
        "alie",
    ],
    "ring-rlr-bias-check": [
        "--clients",
        "8",
        "--aggregator",
        "rlr",
        "--lr",
        "0.01",
        "--byzantine",
        "2",
        "--set",
        "rlr.relay_attack=bias",
        "--set",
        "rlr.check=on",
        "--set",
        "rlr.sign_zero=1",
    ],
    "server-krum-fang": [
        "--clients",
        "9",
        "--topology",
        "server",
        "--aggregator",
        "krum",
        "--byzantine",
        "2",
        "--attack",
        "fang_krum",
    ],
    "server-cclip-minmax": [
        "--clients",
        "8",
        "--topology",
        "server",
        "--aggregator",
        "cclip",
        "--byzantine",
        "2",
        "--attack",
        "minmax",
        "--pre-aggregators",
        "bucketing",
    ],
    "server-fldetector-labelflip": [
        "--clients",
        "8",
        "--topology",
        "server",
        "--aggregator",
        "fldetector",
        "--byzantine",
        "2",
        "--attack",
        "labelflip",
    ],
    "server-fltrust-backdoor": [
        "--clients",
        "8",
        "--topology",
        "server",
        "--aggregator",
        "fltrust",
        "--byzantine",
        "2",
        "--attack",
        "backdoor",
    ],
    "server-median-local-steps": [
        "--clients",
        "6",
        "--topology",
        "server",
        "--aggregator",
        "median",
        "--local-steps",
        "3",
        "--lr",
        "0.05",
    ],
    "server-hplus-adaptive": [
        "--clients",
        "10",
        "--topology",
        "server",
        "--aggregator",
        "hplus",
        "--byzantine",
        "2",
        "--attack",
        "adaptive",
        "--set",
        "attack.target=generic",
        "--set",
        "attack.evals=4",
    ],
    "ring-brace-cohort": [
        "--clients",
        "9",
        "--aggregator",
        "brace",
        "--lr",
        "0.01",
        "--byzantine",
        "2",
        "--attack",
        "signflip",
        "--set",
        "participation=0.5",
        "--set",
        "availability=0.8",
    ],
    "server-fldetector-cohort": [
        "--clients",
        "9",
        "--topology",
        "server",
        "--aggregator",
        "fldetector",
        "--byzantine",
        "2",
        "--attack",
        "alie",
        "--set",
        "participation=5",
    ],
    "server-trimmed-batched": [
        "--clients",
        "6",
        "--topology",
        "server",
        "--aggregator",
        "trimmed_mean",
        "--byzantine",
        "1",
        "--attack",
        "ipm",
        "--local-steps",
        "2",
        "--set",
        "batched_clients=4",
    ],
}


def run(out: Path, ranks: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, args in CONFIGS.items():
        cmd = [
            "mpiexec",
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "fedring",
            "run",
            *COMMON,
            *args,
            "--out",
            str(out / f"{name}.h5"),
        ]
        subprocess.run(cmd, check=True)
        print(f"{name}: done", flush=True)


def differences(old: Path, new: Path) -> list[str]:
    out = []
    with h5py.File(old, "r") as a, h5py.File(new, "r") as b:
        for key, value in a.attrs.items():
            if key in ("config", "fedring_version"):
                continue
            if key not in b.attrs or not np.array_equal(np.asarray(b.attrs[key]), np.asarray(value)):
                out.append(f"attribute {key}: {value!r} -> {b.attrs.get(key)!r}")

        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset) or name.startswith("checkpoint"):
                return
            if name.startswith("brace/") and name not in b:  # 0.2.0 wrote the ring rules' figures under /brace
                name = "ring/" + name[len("brace/") :]
            if name not in b:
                out.append(f"{name}: missing")
            elif name == "metrics/wall_seconds":
                return
            elif obj.dtype != b[name].dtype or obj.shape != b[name].shape or obj[()].tobytes() != b[name][()].tobytes():
                out.append(f"{name}: differs")

        a.visititems(visit)
    return out


def compare(old_dir: Path, new_dir: Path) -> int:
    bad = 0
    for old in sorted(old_dir.glob("*.h5")):
        diff = differences(old, new_dir / old.name)
        print(f"{old.stem}: {'identical' if not diff else '; '.join(diff)}")
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
