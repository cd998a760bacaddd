"""Federated training over MPI: each rank hosts a block of clients; one round is :func:`train_round`.

Determinism: every random draw of client ``c`` in round ``t`` comes from
``numpy.random.default_rng([seed, c, t, stream])`` and the model is initialised from
``seed``; every ring chunk is summed in ring order. So the same seed gives bit-identical
results, final model included, on any number of ranks (with the same ``threads``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from .comm import Layout, Network
from .config import Config
from .data import FederatedData, Shard
from .errors import ConfigError
from .models import flat_grad_into, flatten, load_flat, make_model
from .results import ResultsFile
from .ring import ring_allreduce

STREAM_BATCH = 1
EVAL_BATCH = 500


@dataclass
class Update:
    """The aggregate every replica applies (``w <- w - lr * vector``) and what it cost."""

    vector: np.ndarray


class Topology:
    """How the clients' gradients become one update; built from the config."""

    def __init__(self, cfg: Config, net: Network):
        self.cfg, self.net = cfg, net
        if cfg.topology == "ring" and cfg.aggregator != "mean":
            raise ConfigError("aggregator", f"{cfg.aggregator!r} does not run on the ring; allowed on the ring: mean")
        if cfg.topology == "server" and cfg.aggregator != "mean":
            raise ConfigError("aggregator", f"unknown server aggregator {cfg.aggregator!r}; allowed: mean")

    def aggregate(self, grads: np.ndarray) -> Update:
        n = self.net.n_clients
        if self.cfg.topology == "ring":
            ring_allreduce(self.net, grads)
            return Update(grads[0] / np.float32(n))
        stacked = self.net.gather_to_server(grads, "uplink")
        vec = stacked.mean(axis=0, dtype=np.float32) if stacked is not None else None
        return Update(self.net.broadcast_from_server(vec, "downlink", grads.shape[1:], np.float32))


class Trainer:
    """The state of one run on one rank: its clients' data, the model replica, the network."""

    def __init__(self, cfg: Config, comm: MPI.Comm):
        torch.set_num_threads(cfg.threads)
        self.cfg, self.comm = cfg, comm
        self.layout = Layout(cfg.clients, comm)
        self.net = Network(self.layout)
        self.topology = Topology(cfg, self.net)
        self.data = FederatedData(
            cfg.dataset, cfg.data_dir, cfg.clients, self.layout.local_clients, cfg.partition, cfg.noniid, cfg.seed
        )
        self.model = make_model(cfg.model, cfg.seed)
        self.w = flatten(self.model)
        self.d = self.w.size
        self.grads = np.empty((self.layout.n_local, self.d), np.float32)
        self.batch_loss = np.zeros(cfg.clients)

    def client_rng(self, client: int, t: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, client, t, stream])

    def sample_batch(self, shard: Shard, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        size = min(self.cfg.batch_size, len(shard.y))
        idx = np.sort(rng.choice(len(shard.y), size, replace=False))
        return torch.from_numpy(shard.x[idx]), torch.from_numpy(shard.y[idx])

    def client_gradient(self, k: int, t: int, out: np.ndarray) -> float:
        """Client ``lo + k``'s update direction at round ``t`` into ``out``; returns its first batch loss.

        One local step: the stochastic gradient (FedSGD, the BRACE paper's setting). With
        ``local_steps`` > 1: ``(w - w_local) / lr`` after that many SGD steps.
        """
        client = self.layout.lo + k
        rng = self.client_rng(client, t, STREAM_BATCH)
        shard = self.data.shards[k]
        first_loss = 0.0
        for step in range(self.cfg.local_steps):
            x, y = self.sample_batch(shard, rng)
            self.model.zero_grad(set_to_none=False)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            if step == 0:
                first_loss = loss.item()
            if self.cfg.local_steps == 1:
                flat_grad_into(self.model, out)
                return first_loss
            with torch.no_grad():
                for p in self.model.parameters():
                    p -= self.cfg.lr * p.grad
        out[:] = (self.w - flatten(self.model)) / np.float32(self.cfg.lr)
        load_flat(self.model, self.w)
        return first_loss

    def apply(self, update: Update) -> None:
        self.w -= np.float32(self.cfg.lr) * update.vector
        load_flat(self.model, self.w)

    def evaluate(self) -> tuple[float, float] | None:
        """Test accuracy and loss of the shared model; each rank evaluates its clients' slices."""
        n = self.cfg.clients
        loss_sum, correct, count = np.zeros(n), np.zeros(n), np.zeros(n)
        with torch.no_grad():
            for k, client in enumerate(self.layout.local_clients):
                part = self.data.test_slice(k)
                for a in range(0, len(part.y), EVAL_BATCH):
                    x = torch.from_numpy(part.x[a : a + EVAL_BATCH])
                    y = torch.from_numpy(part.y[a : a + EVAL_BATCH])
                    logits = self.model(x)
                    loss_sum[client] += F.cross_entropy(logits, y, reduction="sum").item()
                    correct[client] += (logits.argmax(1) == y).sum().item()
                count[client] = len(part.y)
        # One entry per client, zeros elsewhere: the sums are exact whatever the rank count.
        stats = np.stack([loss_sum, correct, count])
        self.comm.Allreduce(MPI.IN_PLACE, stats, op=MPI.SUM)
        return stats[1].sum() / stats[2].sum(), stats[0].sum() / stats[2].sum()

    def mean_batch_loss(self) -> float:
        self.comm.Allreduce(MPI.IN_PLACE, self.batch_loss, op=MPI.SUM)
        return float(self.batch_loss.sum() / self.cfg.clients)


def train_round(tr: Trainer, t: int) -> None:
    """Round ``t``: every client computes its update, the topology aggregates, every replica applies it."""
    tr.net.ledger.reset()
    tr.batch_loss[:] = 0.0
    for k, client in enumerate(tr.layout.local_clients):
        tr.batch_loss[client] = tr.client_gradient(k, t, tr.grads[k])
    update = tr.topology.aggregate(tr.grads)
    tr.apply(update)


class Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet, self.start = total, quiet, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, rnd: int, acc: float, total_bytes: int) -> None:
        if self.quiet:
            return
        el = self.elapsed()
        eta = el / rnd * (self.total - rnd)
        print(
            f"round {rnd:>{len(str(self.total))}}/{self.total}  test_acc {acc:.4f}  "
            f"bytes_sent {total_bytes / 1e6:,.1f} MB  elapsed {_hms(el)}  ETA {_hms(eta)}",
            flush=True,
        )


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def train(tr: Trainer, guard) -> int:
    """Run a whole training job; rank 0 streams results into ``cfg.out``."""
    cfg, comm = tr.cfg, tr.comm
    results = None
    if comm.rank == 0:
        results = ResultsFile(
            cfg.out,
            {
                "config": cfg.to_json(),
                "world_size": comm.size,
                "n_clients": cfg.clients,
                "n_parameters": tr.d,
            },
            overwrite=cfg.overwrite,
        )
        guard.on_failure.append(lambda: results.close("failed"))
    progress = Progress(cfg.rounds, cfg.quiet or comm.rank != 0)
    total_bytes = 0
    for t in range(cfg.rounds):
        train_round(tr, t)
        client_bytes, server_bytes = tr.net.gather_ledger()
        rnd = t + 1
        rows = None
        if comm.rank == 0:
            total_bytes += int(client_bytes.sum())
            rows = {"comm/bytes_sent": client_bytes, "comm/server_bytes_sent": np.int64(server_bytes)}
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            acc, loss = tr.evaluate()
            train_loss = tr.mean_batch_loss()
            if comm.rank == 0:
                metrics = {
                    "round": rnd,
                    "test_accuracy": acc,
                    "test_loss": loss,
                    "train_loss": train_loss,
                    "bytes_sent": int(client_bytes.sum()),
                    "bytes_sent_total": total_bytes,
                    "server_bytes_sent": server_bytes,
                    "wall_seconds": progress.elapsed(),
                }
                results.append_round(metrics, rows, rounds_completed=rnd)
                progress.line(rnd, acc, total_bytes)
        elif comm.rank == 0:
            results.append_round({}, rows, rounds_completed=rnd)
    if comm.rank == 0:
        results.write("model/final", tr.w)
        results.close("complete")
        if not cfg.quiet:
            print(f"results: {cfg.out}", file=sys.stdout, flush=True)
    return 0

