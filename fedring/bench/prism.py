"""``python -m fedring bench prism``: PRISM-FCP speed.

1. PSO-Fed training (the paper's synthetic setup: K = 100, |S_n| = 10, D = 50, M = 15,
   1000 iterations) on one rank (the network over ``MPI.COMM_SELF``: every message a memory
   copy), and the same run over MPI ranks (server on rank 0, clients in blocks): prints both
   times and their ratio. Run under ``mpiexec -n R`` it uses those R ranks; run without, it
   launches ``mpiexec -n --ranks`` itself for the MPI half.
2. Calibration of 100 clients x 1000 scores with filtering (known |S_B| and MAD).

The MPI run is bit-identical to the one-rank run (checked here too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from fedring import runtime
from fedring.comm import Layout, Network
from fedring.conformal.prism.calibration import robust_calibrate
from fedring.conformal.prism.environment import synthetic_environment
from fedring.conformal.prism.psofed import train_psofed
from fedring.conformal.prism.settings import settings
from fedring.errors import ConfigError
from fedring.validate import integer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedring bench prism", description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--shared", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3, help="best of R runs (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks to launch when run without mpiexec (default 2)")
    p.add_argument("--mpi-only", action="store_true", help=argparse.SUPPRESS)
    return p


def _time_training(s, repeats: int, comm: MPI.Comm) -> tuple[float, np.ndarray | None, int | None]:
    """Best time of ``repeats`` trainings over ``comm``; the model and the uplink bytes (rank 0)."""
    net = Network(Layout(s.clients, comm))
    env = synthetic_environment(s, 0, 0, net.layout.lo, net.layout.hi)
    best, res = np.inf, None
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        res = train_psofed(s, env, s.shared, net, 0, 0)
        best = min(best, time.perf_counter() - t0)
    assert res is not None, "repeats >= 1"
    up = comm.reduce(res.bytes_up, root=0)
    return best, res.w, up


def _wait_quietly(comm: MPI.Comm) -> None:
    """Non-root ranks wait without spinning a core while rank 0 runs alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _calibration_seconds() -> float:
    rng = np.random.default_rng(0)
    scores = np.abs(rng.standard_normal((100, 1000))) * rng.uniform(0.1, 0.3, (100, 1))
    scores[:20] = 0.0
    best = np.inf
    for _ in range(5):
        t0 = time.perf_counter()
        robust_calibrate(scores, 0.1, "known", n_byzantine=20)
        robust_calibrate(scores, 0.1, "mad")
        best = min(best, time.perf_counter() - t0)
    return best / 2


def _mpi_half(args, argv: list[str]) -> tuple | None:
    """(seconds, model, uplink bytes, ranks) of the MPI run launched with ``mpiexec``, or None."""
    mpiexec = shutil.which("mpiexec")
    if args.ranks <= 1 or not mpiexec:
        return None
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        mpiexec,
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "fedring.bench.prism",
        "--mpi-only",
        *argv,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stdout + out.stderr)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return rec["seconds"], np.array(rec["w"]), rec["bytes_up"], rec["ranks"]


def main(argv: list[str]) -> int:
    world = runtime.world()
    try:
        args = _parser().parse_args(argv)
        integer("iterations", args.iterations, lo=1)
        integer("clients", args.clients, lo=2)
        integer("repeats", args.repeats, lo=1)
        integer("ranks", args.ranks, lo=1)
        s = settings(clients=args.clients, iterations=args.iterations, shared=args.shared)
    except ConfigError as e:
        if world.rank == 0:
            print(f"fedring: error: {e}", file=sys.stderr)
        return 2
    if args.mpi_only:
        t, w, up = _time_training(s, args.repeats, world)
        if w is not None:  # rank 0
            print(json.dumps({"seconds": t, "w": w.tolist(), "bytes_up": up, "ranks": world.size}))
        return 0
    single = None
    if world.rank == 0:
        single = _time_training(s, args.repeats, MPI.COMM_SELF)
        world.Ibarrier().Wait()
    else:
        _wait_quietly(world)
    mpi = (*_time_training(s, args.repeats, world), world.size) if world.size > 1 else _mpi_half(args, argv)
    if world.rank != 0:
        return 0
    assert single is not None, "rank 0 timed the one-rank run"
    t1, w1, up1 = single
    K, N, M = args.clients, args.iterations, args.shared
    print(f"PSO-Fed training, K={K} clients, |S_n|=10, D=50, M={M}, {N} iterations (best of {args.repeats}):")
    print(f"  one rank (memory copies)  : {t1:.3f} s  ({1e6 * t1 / N:.0f} us/iteration)")
    if mpi is not None:
        t_mpi, w_mpi, up_mpi, ranks = mpi
        same = w1 is not None and np.array_equal(w1, w_mpi) and up1 == up_mpi
        print(f"  MPI, {ranks} ranks{'':<13}: {t_mpi:.3f} s  ({1e6 * t_mpi / N:.0f} us/iteration)")
        print(f"  ratio MPI / one rank      : {t_mpi / t1:.2f}  (target <= 3)   bit-identical model and bytes: {same}")
    else:
        print("  MPI: skipped (no mpiexec)")
    print(f"  uplink bytes {up1} = {up1 / (10 * 50 * 8 * N):.3f} x full sharing (M/D = {M / 50:.3f})")
    print(
        f"Calibration, 100 clients x 1000 scores, characterization + distances + filter + quantile: "
        f"{1e3 * _calibration_seconds():.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
