"""What the client and server optimizers cost: time and memory per rank, measured in one go.

    python benchmarks/protocol_cost.py [--ranks 2] [--clients 20] [--rounds 20] [--repeat 2]

Runs Fashion-MNIST with its CNN (``--clients`` clients on ``--ranks`` ranks, ``--rounds`` rounds,
one evaluation at the end, no checkpoint but round 0's) with plain SGD, client momentum 0.9,
FedAdam, and both; the configurations are interleaved ``--repeat`` times so a busy machine
slows them alike. Prints, per configuration, the best wall time (the results file's
``wall_seconds``), its ratio to plain SGD, and the job's peak proportional set size per rank
(``benchmarks/peak_memory.sh``), beside the state the optimizers add per rank by construction:
client momentum ``local clients x d`` float32, FedAdam ``2 d`` float32. First it times the
updates alone (best of 200 calls at the CNN's d) beside one client's mini-batch gradient, which a
busy machine slows far less than it does whole runs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "sgd": [],
    "momentum 0.9": ["--set", "momentum=0.9"],
    "adam": ["--set", "server_optimizer=adam", "--set", "adam.lr=0.001"],
    "momentum 0.9 + adam": ["--set", "momentum=0.9", "--set", "server_optimizer=adam", "--set", "adam.lr=0.001"],
}


def best_seconds(fn, repeat: int = 200) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def update_costs() -> None:
    """Per-call time of each optimizer update at the Fashion-MNIST CNN's d, beside one client's gradient."""
    import torch
    import torch.nn.functional as F

    from fedring.train.models import make_model
    from fedring.train.optim import ClientOptimizer, make_server_optimizer

    torch.set_num_threads(1)
    model = make_model("cnn", 0)
    d = sum(p.numel() for p in model.parameters())
    x, y = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))

    def gradient():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    g = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    w = g.copy()
    rows = {}
    for name, opt in {
        "client momentum 0.9": ClientOptimizer(0.9),
        "client nesterov": ClientOptimizer(0.9, True),
        "client weight decay + clipping": ClientOptimizer(weight_decay=1e-4, clip_norm=1.0),
    }.items():
        state = opt.init(1, d)
        rows[name] = best_seconds(lambda opt=opt, state=state: opt.direction(state, 0, opt.gradient(g.copy(), w)))
    for name in ("sgd", "momentum", "adam", "yogi", "adagrad"):
        opt = make_server_optimizer(name)
        state = opt.init(d)
        rows[f"server {name}"] = best_seconds(lambda opt=opt, state=state: opt.update(state, g, 0.1))
    grad = best_seconds(gradient, 50)
    print(
        f"updates at d = {d:,} (best of 200 calls), beside one client's gradient on a batch of 32: {grad * 1e3:.2f} ms"
    )
    for name, sec in rows.items():
        print(f"  {name:32s} {sec * 1e3:7.3f} ms  ({sec / grad:.4f} of a gradient)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    update_costs()
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    pss: dict[str, list[int]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for name, extra in CONFIGS.items():
                out = Path(tmp) / "run.h5"
                cmd = [
                    str(ROOT / "benchmarks" / "peak_memory.sh"),
                    "mpiexec",
                    "-n",
                    str(args.ranks),
                    sys.executable,
                    "-m",
                    "fedring",
                    "run",
                    "--clients",
                    str(args.clients),
                    "--rounds",
                    str(args.rounds),
                    "--eval-every",
                    str(args.rounds),
                    "--checkpoint-every",
                    str(10 * args.rounds),
                    "--quiet",
                    "--overwrite",
                    "--out",
                    str(out),
                    *extra,
                ]
                text = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
                pss[name].append(int(re.search(r"\((\d+) MiB each\)", text).group(1)))
                with h5py.File(out, "r") as f:
                    wall[name].append(float(f["metrics/wall_seconds"][-1]))
    base = min(wall["sgd"])
    d = 139_960
    local = -(-args.clients // args.ranks)
    added = {"sgd": 0, "momentum 0.9": local * d * 4, "adam": 2 * d * 4, "momentum 0.9 + adam": (local + 2) * d * 4}
    print(
        f"Fashion-MNIST CNN (d = {d:,}), {args.clients} clients on {args.ranks} ranks, {args.rounds} rounds, "
        f"best of {args.repeat}"
    )
    print(
        f"{'configuration':22s} {'wall s':>8s} {'ratio':>6s} {'peak PSS/rank MiB':>18s} {'state added/rank MiB':>21s}"
    )
    for name in CONFIGS:
        print(
            f"{name:22s} {min(wall[name]):8.1f} {min(wall[name]) / base:6.3f} {min(pss[name]):18d} "
            f"{added[name] / 2**20:21.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
