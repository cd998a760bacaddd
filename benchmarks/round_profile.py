"""Where a training round's time goes: ``cProfile`` of rounds of 100 clients on one rank, the
per-client loop and then every client batched in one call (``batched_clients = 100``).

    python benchmarks/round_profile.py [--device cuda | --device-path] [--model cnn] [--rounds 5] [--clients 100]

Three untimed rounds first; on a GPU the profiled rounds end with a synchronize, so kernels
that ran asynchronously are counted. Prints seconds per round and the functions with the most
time of their own (docs/figures.md, training throughput). ``--device-path`` profiles the device
path on the CPU, as ``bench train --device-path`` times it (tensor rows, the batched first step with
shared weights, as on a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch
from mpi4py import MPI

from fedring.bench.train import fedring_trainer
from fedring.config import Config
from fedring.train.loop import train_round
from fedring.train.task import TrainTask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="cnn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--device-path", action="store_true", help="the device path on the CPU")
    args = p.parse_args()
    if args.device_path and args.device != "cpu":
        p.error(f"--device-path runs the device path on the CPU: it needs --device cpu, got {args.device!r}")
    base = Config(
        clients=args.clients, rounds=args.rounds + 4, model=args.model, batch_size=32, quiet=True, device=args.device
    )
    for batched in (None, args.clients):
        cfg = dataclasses.replace(base, batched_clients=batched)
        TrainTask(cfg, 1)
        tr = fedring_trainer(cfg, MPI.COMM_WORLD, args.device_path)
        for t in range(3):
            train_round(tr, t)
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for t in range(3, 3 + args.rounds):
            train_round(tr, t)
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        profile.disable()
        print(f"=== batched_clients={batched}: {(time.perf_counter() - start) / args.rounds:.4f} s/round")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
