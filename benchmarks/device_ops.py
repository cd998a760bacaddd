"""How many operations a training round asks of the device: the device path's torch operations per
round, counted on CPU tensors (as ``bench train --device-path`` runs it: the rows a tensor, the
batched first step with shared weights, as on a GPU), per client and batched.

    python benchmarks/device_ops.py [--clients 100] [--model mlp] [--batched-clients 100]
                                    [--set KEY=VALUE ...] [--rounds 3] [--json PATH]

The bare loops of ``bench train`` (``BareLoop``, ``BareBatchedLoop``: the same clients' steps, the
gradients summed in place) are counted alike: the floor a round's operations are read against.

What is counted (``fedring.bench.ops``): every operation that reaches PyTorch's dispatcher, as
*kernels* (each a launch on a GPU, whose host cost a small model's round is bound by), *views*
(which compute nothing but still take the host's time) and *host reads* (``float()``, ``bool()``
or ``.item()`` of a tensor); and the *copies* between host memory and the device, counted where
the round makes them (on CPU tensors they copy nothing). On a GPU a read, and a copy from pageable
memory, waits for the device's queued work: after it the host no longer runs ahead, and what it
queues next runs after a gap. So the round's *waits* (its reads and copies) are listed with the
number of kernels queued before each: the kernels after a wait that follows the clients'
gradients run on an idle device. The counts are exact and do not depend on the machine's load: a
change's effect on a GPU's host work, read on a CPU. The choices that depend on where the rows
are take a GPU's (``fedring.comm.network.PADDED_BYTES``: the reduce-scatter on one rank by the
padded path up to the device's bound; ``fedring.aggregators._kernels_torch.BY_EXTREMES``: the
uploads' non-finite flags made with no read). One untimed round first; the figures are per round
over ``--rounds`` rounds, the waits those of the last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from mpi4py import MPI

from fedring.aggregators import _kernels_torch
from fedring.bench.ops import KINDS, counting
from fedring.bench.train import BareBatchedLoop, BareLoop, fedring_trainer
from fedring.comm import network
from fedring.config import Config, merge, parse_setting
from fedring.errors import ConfigError
from fedring.train.loop import train_round
from fedring.train.task import TrainTask


def counts(round_fn, rounds: int) -> dict:
    """The operations per round of ``round_fn(t)``, after one untimed round, and the last round's waits."""
    round_fn(0)
    with counting() as counted:
        for t in range(1, 1 + rounds):
            counted.new_round()
            round_fn(t)
    return {
        "per_round": {kind: counted.kinds[kind] / rounds for kind in KINDS},
        "waits_after_kernels": counted.waits,
        "most_common": {n: k / rounds for n, k in counted.names.most_common(12)},
    }


def count(cfg: Config, rounds: int) -> dict:
    """The device path's operations per round of ``cfg`` on one rank, and its bare loop's."""
    TrainTask(cfg, 1)
    tr = fedring_trainer(cfg, MPI.COMM_WORLD, device_path=True)
    bare = (
        BareLoop(tr, rounds + 1)
        if cfg.batched_clients is None
        else BareBatchedLoop(tr, rounds + 1, cfg.batched_clients)
    )
    return {
        "batched_clients": cfg.batched_clients,
        **counts(lambda t: train_round(tr, t), rounds),
        "bare": counts(bare.round, rounds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--model", default="mlp")
    p.add_argument("--batched-clients", type=int, metavar="B", help="also count batched_clients = B")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of the run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    base = Config(clients=args.clients, rounds=args.rounds + 1, model=args.model, batch_size=32, quiet=True)
    try:
        for item in args.set:
            merge(base, parse_setting(item, "--set"), "--set")
    except ConfigError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    network.PADDED_BYTES = {"host": network.PADDED_BYTES["device"], "device": network.PADDED_BYTES["device"]}
    _kernels_torch.BY_EXTREMES = {"host": True, "device": True}
    records = []
    for batched in (None, args.batched_clients) if args.batched_clients else (None,):
        record = count(dataclasses.replace(base, batched_clients=batched), args.rounds)
        records.append(record)
        loop = "per-client loop" if batched is None else f"batched {batched}"
        for who, counted in (("fedring", record), ("bare loop", record["bare"])):
            figures = ", ".join(f"{n:g} {kind}" for kind, n in counted["per_round"].items())
            waits = ", ".join(map(str, counted["waits_after_kernels"])) or "none"
            print(f"{loop}, {who}: {figures} per round; waits after kernels {waits}")
            print("  most common:", ", ".join(f"{name} {n:g}" for name, n in counted["most_common"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"clients": args.clients, "model": args.model, "settings": args.set, "runs": records}, f, indent=1
            )


if __name__ == "__main__":
    main()
