"""``python -m fedring bench train``: fedring's training round against a bare PyTorch loop.

Both do the same client steps in the same run, on the same device, from the same initial model
and on the same mini-batches (drawn from the run's seed as fedring draws them): one SGD step per
client (FedSGD), then every replica moves by ``lr`` times the clients' mean gradient. fedring's
round is :func:`fedring.train.loop.train_round` with the ring's ``mean`` (sampling the batches,
flattening each gradient into the upload, the ring all-reduce, the server optimizer); evaluation
is off. The bare loop gets its batches ready on the device and sums the gradients in place:
per client ``zero_grad``, forward, backward, add; then ``p -= lr * sum / K`` (with an MPI
``Allreduce`` of the flat sum when there are several ranks). Rounds are interleaved (one of each
in turn, :func:`fedring.bench.comm._time`), so a change of the machine's load hits both alike;
the figures are medians over the rounds, after one untimed round of each.
On a GPU both loops run under the deterministic algorithms a run turns on
(:func:`fedring.train.device.select`); ``--nondeterministic`` turns them off for both, so that
the two runs' times give their cost. ``--device-path`` runs fedring's device path on the CPU (torch
tensors where the rows would be numpy, and a batched first step with one set of weights, as on a
GPU): with a small model, whose kernels take about as long as a GPU's launches, its overhead over the
bare loops is the host's work that a GPU's round waits for.

``--set KEY=VALUE`` changes a setting of fedring's run (client momentum, clipping, local steps
...); the bare loops keep their plain SGD steps, so the ratio is then that setting's cost too.
With ``--batched-clients B``, a second fedring run with ``batched_clients = B``
(:mod:`fedring.train.batched`) is interleaved too, and its speed-up over the per-client loop
printed. Prints rounds per second and client steps per second of each, ``ratio fedring/bare-loop: X.XX``
(time per round), the largest difference between the two final models (the same arithmetic up
to the order of the sum), and the load average around the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.func import functional_call, grad, vmap

from fedring.config import Config, merge, parse_setting
from fedring.datasets import DATASETS
from fedring.rng import Stream, generator
from fedring.runtime import world
from fedring.train.batched import VmapGradients
from fedring.train.loop import train_round
from fedring.train.models import flatten, make_model
from fedring.train.task import TrainTask
from fedring.train.trainer import Trainer
from fedring.validate import integer

from .comm import _time


def fedring_trainer(cfg: Config, comm: MPI.Comm, device_path: bool = False) -> Trainer:
    """fedring's trainer of ``cfg``; with ``device_path``, its device path on the CPU as a GPU runs it:
    the rows a tensor, and a batched first step with one set of weights (the CPU keeps per-slot
    weights only for its host path's bits)."""
    tr = Trainer(cfg, comm, False if device_path else None)
    if device_path and isinstance(tr.clients.source, VmapGradients):
        tr.clients.source.shared_first_step = True
    return tr


class BareLoop:
    """The same FedSGD rounds as fedring's, written as a plain PyTorch loop over this rank's clients."""

    def __init__(self, tr: Trainer, rounds: int):
        cfg = tr.cfg
        self.model = make_model(cfg.model, cfg.seed, DATASETS[cfg.dataset].shape)
        self.model.to(tr.device)
        self.params: list[torch.Tensor] = list(self.model.parameters())
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.lr, self.clients, self.comm = cfg.lr, tr.layout.n_clients, tr.comm
        self.batches = [
            [
                [
                    (tr.clients.stage.tensor(x), tr.clients.stage.tensor(y))
                    for x, y in tr.clients.local_batches(
                        tr.clients.shards[k], generator(cfg.seed, Stream.BATCH, client=client, step=t)
                    )
                ]
                for k, client in enumerate(tr.layout.local_clients)
            ]
            for t in range(rounds)
        ]

    def round(self, t: int) -> None:
        for s in self.sums:
            s.zero_()
        for client in self.batches[t]:
            for x, y in client:
                self.model.zero_grad(set_to_none=False)
                F.cross_entropy(self.model(x), y).backward()
                torch._foreach_add_(self.sums, [p.grad for p in self.params if p.grad is not None])
        self.apply()

    def apply(self) -> None:
        """``p -= lr * sum / K``, the sums reduced over the ranks first."""
        if self.comm.size > 1:
            flat = torch.nn.utils.parameters_to_vector(self.sums).cpu().numpy()
            self.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat).to(self.sums[0].device), self.sums)
        with torch.no_grad():
            torch._foreach_add_(self.params, self.sums, alpha=-self.lr / self.clients)

    def weights(self) -> np.ndarray:
        return flatten(self.model.cpu())


class BareBatchedLoop(BareLoop):
    """The bare loop with ``size`` clients per call, as ``batched_clients`` computes them: ``vmap`` over the
    clients of the gradient at the shared weights, summed on the device (the reference for fedring's
    batched round)."""

    def __init__(self, tr: Trainer, rounds: int, size: int):
        super().__init__(tr, rounds)
        names = [name for name, _ in self.model.named_parameters()]

        def loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(self.model, weights, (x,)), y)

        self.gradients = vmap(grad(loss), in_dims=(None, 0, 0))
        self.names = names
        self.chunks = [
            [
                (
                    torch.stack([c[0][0] for c in clients[a : a + size]]),
                    torch.stack([c[0][1] for c in clients[a : a + size]]),
                )
                for a in range(0, len(clients), size)
            ]
            for clients in self.batches
        ]

    def round(self, t: int) -> None:
        for s in self.sums:
            s.zero_()
        weights = {name: p.detach() for name, p in zip(self.names, self.params, strict=True)}
        for x, y in self.chunks[t]:
            grads = self.gradients(weights, x, y)
            torch._foreach_add_(self.sums, [grads[name].sum(0) for name in self.names])
        self.apply()


def timed_round(fn: Callable[[int], object], device: torch.device) -> Callable[[], None]:
    """``fn``'s next round, numbered from 0; on a GPU it ends when the round's kernels have run."""
    clock = iter(range(2**62))

    def run() -> None:
        fn(next(clock))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fedring bench train")
    p.add_argument("--clients", type=int, default=20, help="clients over all ranks (default 20)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds of each loop (default 30)")
    p.add_argument("--model", default="cnn", help="a model name (default: the data set's CNN)")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--topology", default="ring", help="ring or server (default ring)")
    p.add_argument("--aggregator", default="mean", help="fedring's rule (default mean; the bare loops average)")
    p.add_argument("--attack", default="none", help="an attack of the Byzantine clients (default none)")
    p.add_argument("--byzantine", type=float, default=0, help="Byzantine clients: a fraction or a count (default 0)")
    p.add_argument(
        "--batched-clients", type=int, metavar="B", help="also time fedring with batched_clients = B (its speed-up)"
    )
    p.add_argument(
        "--nondeterministic",
        action="store_true",
        help="on a GPU, time without PyTorch's deterministic algorithms and with cuDNN's autotuner (their cost)",
    )
    p.add_argument(
        "--device-path",
        action="store_true",
        help="on the CPU, fedring's device path (torch tensors, batched first steps with shared weights: as on a GPU)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of fedring's run (docs/cli.md), e.g. momentum=0.9; the bare loops keep plain SGD steps",
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.device_path and args.device != "cpu":
        p.error(f"--device-path runs the device path on the CPU: it needs --device cpu, got {args.device!r}")
    comm = world()
    integer("--rounds", args.rounds, lo=1)
    cfg = Config(
        clients=args.clients,
        rounds=args.rounds + 1,
        model=args.model,
        dataset=args.dataset,
        device=args.device,
        threads=args.threads,
        batch_size=args.batch_size,
        topology=args.topology,
        aggregator=args.aggregator,
        attack=args.attack,
        byzantine=args.byzantine,
        quiet=True,
    )
    for item in args.set:
        merge(cfg, parse_setting(item, "--set"), "--set")
    TrainTask(cfg, comm.size)  # validates and fills the defaults, as a run does
    load_before = os.getloadavg()
    tr = fedring_trainer(cfg, comm, args.device_path)
    bare = BareLoop(tr, cfg.rounds)
    loops: dict[str, Callable[[int], object]] = {"fedring": lambda t: train_round(tr, t), "bare-loop": bare.round}
    if args.batched_clients is not None:
        batched = fedring_trainer(
            dataclasses.replace(cfg, batched_clients=args.batched_clients), comm, args.device_path
        )
        loops["fedring-batched"] = lambda t: train_round(batched, t)
        bare_batched = BareBatchedLoop(tr, cfg.rounds, args.batched_clients)
        loops["bare-batched"] = bare_batched.round
    if args.nondeterministic:  # undoes what fedring.train.device.select turned on (each Trainer calls it) for the GPU
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = True
    impls = {name: (lambda: None, timed_round(fn, tr.device), lambda: 0) for name, fn in loops.items()}
    for _, run, _ in impls.values():
        run()  # untimed: first calls allocate and warm the caches
    seconds = {name: s for name, (s, _, _) in _time(impls, args.rounds, comm).items()}
    gap = comm.allreduce(float(np.max(np.abs(tr.replica.w - bare.weights()))), op=MPI.MAX)
    gap_batched = None
    if args.batched_clients is not None:  # the two bare loops take the same steps
        gap_batched = comm.allreduce(float(np.max(np.abs(bare.weights() - bare_batched.weights()))), op=MPI.MAX)
    if comm.rank != 0:
        return 0
    ratio = seconds["fedring"] / seconds["bare-loop"]
    record = {
        "clients": cfg.clients,
        "ranks": comm.size,
        "model": cfg.model,
        "dataset": cfg.dataset,
        "device": str(tr.device),
        "device_path": not tr.clients.stage.on_host,
        "device_name": torch.cuda.get_device_name(tr.device) if tr.device.type == "cuda" else "cpu",
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": cfg.threads,
        "batch_size": cfg.batch_size,
        "rounds": args.rounds,
        "seconds_per_round": seconds,
        "rounds_per_second": {k: 1 / s for k, s in seconds.items()},
        "client_steps_per_second": {k: cfg.clients / s for k, s in seconds.items()},
        "topology": cfg.topology,
        "aggregator": cfg.aggregator,
        "attack": cfg.attack,
        "byzantine": cfg.byzantine,
        "settings": args.set,
        "ratio": ratio,
        "max_weight_difference": gap,
        "load_average_before": load_before[0],
        "load_average_after": os.getloadavg()[0],
    }
    path = ", device path" if args.device_path else ""
    print(
        f"bench train: {cfg.clients} clients of {cfg.model} ({cfg.dataset}, batch {cfg.batch_size}) on {comm.size} "
        f"rank{'s' if comm.size > 1 else ''}, device {tr.device} ({record['device_name']}{path}), {cfg.threads} thread(s), "
        f"{args.rounds} rounds each{'' if record['deterministic_algorithms'] or tr.device.type != 'cuda' else ', nondeterministic'}"
    )
    print(f"{'loop':<16}{'s/round':>10}{'rounds/s':>10}{'steps/s':>10}")
    for name, s in seconds.items():
        print(f"{name:<16}{s:>10.4f}{1 / s:>10.2f}{cfg.clients / s:>10.1f}")
    if args.set:
        why = f"fedring's settings {', '.join(args.set)}; the bare loops take plain SGD steps"
    elif cfg.aggregator == "mean" and cfg.attack == "none":
        why = "the same steps; sums in another order"
    else:
        why = f"fedring's rule is {cfg.aggregator}, the bare loops average"
    print(f"final models differ by at most {gap:.2e} ({why})")
    print(f"load average (1 min): {load_before[0]:.2f} before, {record['load_average_after']:.2f} after")
    if "fedring-batched" in seconds:
        record["batched_clients"] = args.batched_clients
        record["speedup_batched"] = seconds["fedring"] / seconds["fedring-batched"]
        record["ratio_batched"] = seconds["fedring-batched"] / seconds["bare-batched"]
        record["max_weight_difference_bare_batched"] = gap_batched
        print(
            f"speed-up batched ({args.batched_clients} clients a call) over the per-client loop: {record['speedup_batched']:.2f}"
        )
        print(f"ratio fedring-batched/bare-batched: {record['ratio_batched']:.2f}")
    print(f"ratio fedring/bare-loop: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0
