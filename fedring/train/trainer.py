"""The state of a training run on one rank: its clients' data, the model replica, the topology
(:mod:`fedring.train.topology`) and the adversary. One round is :func:`fedring.train.loop.train_round`.

Determinism: every random draw comes from :func:`fedring.rng.generator`, keyed by the seed,
the client (or the run), the round and the purpose, and the model is initialised from
``seed``; every ring chunk is summed in ring order. So the same seed gives
bit-identical results, final model included, on any number of ranks (with the same
``threads``), and a resumed run needs no RNG state: only the model, the aggregator's state,
the optimizers' state (:mod:`fedring.train.optim`), the model's buffers and the round counter
are checkpointed.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from fedring.attacks import AttackContext, Backdoor, DataAttack, ModelAttack, make_attack
from fedring.comm import Layout, Network
from fedring.config import Config, byzantine_count, defence_f
from fedring.datasets import DATASETS
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

from .batched import BatchedClients
from .data import FederatedData, Shard
from .device import Staging, describe, select
from .models import flatten, make_model
from .optim import ClientOptimizer, Vector, f32, make_server_optimizer
from .participation import Cohort, from_config
from .schedules import make_schedule
from .state import ModelBuffers, checkpoint_rows, rows_from_file
from .topology import RingTopology, ServerTopology, make_topology

EVAL_BATCH = 500
#: checkpoint arrays that each rank reads for its own clients on --resume (rank 0 never holds them all)
PER_RANK = ("client_",)


def byzantine_clients(cfg: Config) -> np.ndarray:
    """Sorted ids of the clients that attack: drawn from the seed, or the first ones."""
    count = byzantine_count(cfg)
    if cfg.byzantine_select == "first":
        return np.arange(count)
    return np.sort(generator(cfg.seed, Stream.BYZANTINE).choice(cfg.n_clients, count, replace=False))


class Adversary:
    """The Byzantine clients' attack; omniscient and colluding attacks learn the other
    clients' updates through an explicit side channel (ledger phase ``adversary``), whose
    bytes are never counted as protocol traffic."""

    def __init__(
        self, cfg: Config, net: Network, byzantine: np.ndarray, topology: RingTopology | ServerTopology, lr_at
    ):
        self.cfg, self.net, self.topology, self.lr_at = cfg, net, topology, lr_at
        self.byzantine = byzantine
        self.is_byzantine = np.zeros(cfg.n_clients, bool)
        self.is_byzantine[byzantine] = True
        self.f = defence_f(cfg)
        self.attack = make_attack(cfg.attack, cfg.section("attack"), n_clients=cfg.n_clients)
        self.model_attack = self.attack if isinstance(self.attack, ModelAttack) else None
        if self.model_attack is not None:
            self.model_attack.check(cfg.n_clients, len(byzantine), self.f)
        self.data_attack = self.attack if isinstance(self.attack, DataAttack) else None

    def poisons(self, client: int) -> bool:
        return self.data_attack is not None and self.is_byzantine[client]

    def context(
        self, rng: np.random.Generator, t: int, reference: np.ndarray | None = None, cohort: Cohort | None = None
    ) -> AttackContext:
        n, f = (self.cfg.n_clients, self.f) if cohort is None else (cohort.size, cohort.f)
        return AttackContext(
            rng=rng,
            n=n,
            f=f,
            lr=self.lr_at(t),
            round=t,
            aggregator=lambda X: self.topology.reference_rule(X, reference, cohort),
            aggregator_name=self.cfg.aggregator,
        )

    def attacking(self, cohort: Cohort | None) -> np.ndarray:
        """The Byzantine clients that attack this round: all, or the cohort's, and none when the
        attack is undefined for the cohort (:meth:`fedring.attacks.ModelAttack.check`)."""
        if cohort is None:
            return self.byzantine
        if cohort.byzantine and self.model_attack is not None:
            try:
                self.model_attack.check(cohort.size, cohort.byzantine, cohort.f)
            except ConfigError:
                return self.byzantine[:0]
        return self.byzantine[cohort.member[self.byzantine]]

    def learn(
        self, grads: np.ndarray, omniscient: bool, dtype: np.dtype | type = np.float64
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Over the side channel, on rank 0: the Byzantine clients' rows and, for an omniscient
        attack, the honest rows in ``dtype`` (the clients' own, or float64 for an attack that is
        not ``blockwise`` or centres them in place), each row copied as its rank's block arrives,
        so rank 0 never holds all n rows besides; (None, None) elsewhere."""
        byz = honest = None
        if self.net.layout.rank == 0:
            byz = np.empty((len(self.byzantine), *grads.shape[1:]), grads.dtype)
            if omniscient:
                honest = np.empty((self.cfg.n_clients - len(self.byzantine), *grads.shape[1:]), dtype)
        for first, block in self.net.gather_blocks(grads, "adversary"):
            for k, client in enumerate(range(first, first + len(block))):
                before = int(np.searchsorted(self.byzantine, client))  # Byzantine clients with smaller ids
                rows, slot = (byz, before) if self.is_byzantine[client] else (honest, client - before)
                if rows is not None:
                    rows[slot] = block[k]
        return byz, honest

    def attack_model(
        self, grads: np.ndarray, t: int, reference: np.ndarray | None, cohort: Cohort | None = None
    ) -> None:
        """Replace the Byzantine clients' rows of ``grads`` (this rank's clients) in place; with a
        ``cohort``, those of its Byzantine members, which learn only its honest members' rows."""
        attack = self.model_attack
        attackers = self.attacking(cohort)
        if attack is None or not len(attackers):
            return
        lay = self.net.layout
        local = [c - lay.lo for c in attackers if lay.lo <= c < lay.hi]
        if attack.knowledge == "own":
            for k in local:
                rng = generator(self.cfg.seed, Stream.ATTACK, client=lay.lo + k, step=t)
                grads[k] = attack(grads[k : k + 1], None, self.context(rng, t, cohort=cohort))[0]
            return
        crafted = None
        dtype = grads.dtype if attack.blockwise else np.float64  # cast as the rows arrive
        byz, honest = self.learn(grads, attack.knowledge == "omniscient", dtype)
        if byz is not None:
            if cohort is not None:  # the cohort's rows only
                byz = byz[cohort.member[self.byzantine]]
                honest = None if honest is None else honest[cohort.member[~self.is_byzantine]]
            rng = generator(self.cfg.seed, Stream.ATTACK, step=t)
            crafted = attack(byz, honest, self.context(rng, t, reference, cohort))
            del byz, honest  # before the scatter and the server's own gather
        mine = self.net.scatter_from_server(crafted, attackers, "adversary", grads.shape[1:], grads.dtype)
        grads[local] = mine


class Trainer:
    """The state of one run on one rank: its clients' data, the model replica, the network."""

    def __init__(self, cfg: Config, comm: MPI.Comm, host_path: bool | None = None):
        """``host_path=False`` computes the clients' updates on the device path on the CPU too
        (:class:`fedring.train.device.Staging`; tests compare the paths)."""
        torch.set_num_threads(cfg.threads)
        self.cfg, self.comm = cfg, comm
        self.layout = Layout(cfg.n_clients, comm)
        self.net = Network(self.layout)
        self.model = make_model(cfg.model, cfg.seed, DATASETS[cfg.dataset].shape)
        self.w = flatten(self.model)
        self.device = select(cfg.device, comm)
        self.device_line = describe(comm, self.device) if cfg.device != "cpu" else ""
        self.model.to(self.device)
        self.stage = Staging(self.device, self.w.size, host_path)
        #: ``w`` as the clients' updates read it: ``w`` itself on the host path, its device copy on the device
        #: path, made once per change of ``w`` (:meth:`load_weights`) instead of once per client
        self.w_staged = self.stage.vector(self.w)
        self.w0 = self.w.copy()  # the drift diagnostic measures w_t - w_0
        self.d = self.w.size
        self.schedule = make_schedule(cfg.lr_schedule, cfg.section(cfg.lr_schedule))
        self.byzantine = byzantine_clients(cfg)
        self.topology = make_topology(cfg, self.net, self.byzantine, self.d)
        self.adversary = Adversary(cfg, self.net, self.byzantine, self.topology, self.lr_at)
        self.data = FederatedData(
            cfg.dataset,
            cfg.data_dir,
            cfg.n_clients,
            self.layout.local_clients,
            cfg.partition,
            cfg.noniid,
            cfg.seed,
            server_samples=cfg.server_samples if self.topology.needs_reference and comm.rank == 0 else 0,
            shards_per_client=cfg.section("shards").get("per_client", 2),
            validation=cfg.validation,
        )
        self.grads = np.empty((self.layout.n_local, self.d), np.float32)
        self.client_opt = ClientOptimizer(cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.clip_norm)
        self.client_state = self.client_opt.init(
            self.layout.n_local, self.d, None if self.stage.on_host else self.device
        )
        self.server_opt = make_server_optimizer(cfg.server_optimizer, cfg.section(cfg.server_optimizer))
        self.server_state = self.server_opt.init(self.d)  # the same on every replica: it sees the same updates
        self.rows_comm = comm.Dup()  # checkpoint rows, apart from the protocol's messages
        self.buffers = ModelBuffers(self.model, cfg.bn_stats, self.layout)
        self.batched = None if cfg.batched_clients is None else BatchedClients(self, cfg.batched_clients)
        participation = from_config(cfg)
        self.participation = None if participation.everyone else participation

    def cohort(self, t: int) -> Cohort | None:
        """Round ``t``'s cohort (:mod:`fedring.train.participation`); None when every client takes part."""
        if self.participation is None:
            return None
        return self.participation.draw(t, self.adversary.is_byzantine, defence_f(self.cfg))

    def checkpoint_arrays(self) -> dict:
        """Collective: what a resumed run needs besides the round, on rank 0: the model, the
        aggregator's and the server optimizer's state, the model's buffers and every client's
        optimizer rows. The clients' rows come last: the other ranks send their blocks while rank
        0 writes them (:class:`fedring.train.state.CheckpointRows`), before its next collective."""
        buffers = self.buffers.checkpoint()
        clients = {f"client_{k}": checkpoint_rows(self.rows_comm, self.layout, v) for k, v in self.client_state.items()}
        return {
            "w": self.w,
            **{f"state_{k}": v for k, v in self.topology.state.items()},
            **{f"optim_{k}": v for k, v in self.server_state.items()},
            **buffers,
            **clients,
        }

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Collective: continue from :meth:`checkpoint_arrays` as stored. ``arrays`` holds all but
        the clients' rows (:data:`PER_RANK`), which each rank reads for its own clients."""

        def prefixed(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix) :]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}

        self.w[:] = arrays["w"]
        self.load_weights()
        self.topology.state.update(prefixed("state_"))
        self.server_state.update(prefixed("optim_"))
        for name, local in self.client_state.items():
            rows_from_file(self.rows_comm, self.layout, self.cfg.out, f"client_{name}", local)
        self.buffers.restore(arrays.get("buffers"))

    def load_weights(self) -> None:
        """After ``w`` changed: its staged copy and the model's parameters."""
        self.w_staged = self.stage.vector(self.w)
        self.stage.load(self.model, self.w_staged)

    def lr_at(self, t: int) -> float:
        """The step size of round ``t``: ``lr`` times the schedule's factor."""
        return self.cfg.lr * self.schedule.factor(t, self.cfg.rounds)

    def sample_batch(self, shard: Shard, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        size = min(self.cfg.batch_size, len(shard.y))
        idx = np.sort(rng.choice(len(shard.y), size, replace=False))
        return shard.x[idx], shard.y[idx]

    def local_steps(self, shard: Shard) -> int:
        """Local SGD steps of a client: ``local_steps``, or ``local_epochs`` passes of ceil(|shard| / batch_size)."""
        if self.cfg.local_epochs is None:
            return self.cfg.local_steps
        return self.cfg.local_epochs * -(-len(shard.y) // self.cfg.batch_size)

    def local_batches(self, shard: Shard, rng: np.random.Generator):
        """The mini-batches of one round: ``local_steps`` drawn without replacement each, or
        ``local_epochs`` passes over a fresh permutation of the shard (the last batch of a pass may be smaller)."""
        if self.cfg.local_epochs is None:
            for _ in range(self.cfg.local_steps):
                yield self.sample_batch(shard, rng)
            return
        for _ in range(self.cfg.local_epochs):
            order = rng.permutation(len(shard.y))
            for a in range(0, len(order), self.cfg.batch_size):
                idx = np.sort(order[a : a + self.cfg.batch_size])
                yield shard.x[idx], shard.y[idx]

    def _backward(self, x: np.ndarray, y: np.ndarray) -> float:
        self.model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(self.stage.tensor(x)), self.stage.tensor(y))
        loss.backward()
        return loss.item()

    def client_gradient(self, k: int, t: int, out: np.ndarray) -> float:
        """Client ``lo + k``'s upload at round ``t`` into ``out``; returns its first batch loss.

        One local step: the stochastic gradient (FedSGD, the BRACE paper's setting). With more
        (``local_steps`` > 1, or ``local_epochs``): ``(w - w_local) / lr`` after that many SGD
        steps. Each mini-batch gradient is clipped and decayed, and the client's momentum turns the
        result into the vector it uploads (:class:`fedring.train.optim.ClientOptimizer`). A Byzantine
        client under a data attack trains on poisoned batches, and scales its upload.
        """
        client = self.layout.lo + k
        rng = generator(self.cfg.seed, Stream.BATCH, client=client, step=t)
        poison_rng = generator(self.cfg.seed, Stream.POISON, client=client, step=t)
        shard = self.data.shards[k]
        lr = f32(self.lr_at(t))
        data_attack = self.adversary.data_attack if self.adversary.poisons(client) else None
        steps = self.local_steps(shard)
        w, g = self.w_staged, self.stage.output(out)  # on the device path: device vectors
        w_local = self.stage.copy(w) if steps > 1 else w
        self.buffers.use(k)
        first_loss = 0.0
        for step, (x, y) in enumerate(self.local_batches(shard, rng)):
            if data_attack is not None:
                x, y = data_attack.poison(x, y, poison_rng)
            loss = self._backward(x, y)
            if step == 0:
                first_loss = loss
            self.stage.grad_into(self.model, g)
            self.client_opt.gradient(g, w_local)
            if steps > 1:
                w_local -= lr * g
                self.stage.load(self.model, w_local)
        self.buffers.keep(k)
        if steps > 1:
            g[:] = (w - w_local) / lr
            self.stage.load(self.model, w)
        self.upload(k, g, out)
        return first_loss

    def upload(self, k: int, u: Vector, out: np.ndarray) -> None:
        """Local client ``k``'s update direction ``u`` (made by ``stage.output(out)``) as the vector
        it uploads, in ``out``: its momentum direction, copied to host memory, scaled under a data
        attack. The per-client loop and :mod:`fedring.train.batched` end a client's update with it."""
        self.client_opt.direction(self.client_state, k, u)
        self.stage.upload(u, out)
        attack = self.adversary.data_attack
        if attack is not None and self.adversary.poisons(self.layout.lo + k) and attack.scale != 1:
            out *= np.float32(attack.scale)

    def reference_gradient(self) -> np.ndarray | None:
        """The server's gradient on its small clean data set (FLTrust, Zeno++), on rank 0."""
        if not self.topology.needs_reference or self.comm.rank != 0:
            return None
        server = self.data.server
        assert server is not None, "rank 0 loads the server's set when the rule needs a reference"
        self._backward(server.x, server.y)
        out = np.empty(self.d, np.float32)
        self.stage.grad_into(self.model, out)
        return out

    def apply(self, update: np.ndarray, t: int, cohort: Cohort | None = None) -> None:
        """``w <- w - step`` of the server optimizer on the round's aggregate (every replica alike), and
        the round's BatchNorm statistics (the ``cohort``'s, when one is given)."""
        eta = self.server_opt.eta(self.cfg.lr, self.schedule.factor(t, self.cfg.rounds))
        step, self.server_state = self.server_opt.update(self.server_state, update, eta)
        self.w -= step
        self.load_weights()
        self.buffers.aggregate(None if cohort is None else cohort.member)

    def weight_mean_change(self) -> float:
        """Drift diagnostic: the mean over coordinates of ``w_t - w_0``."""
        return float(np.mean(self.w - self.w0, dtype=np.float64))

    def evaluate(self) -> dict[str, float]:
        """Test accuracy and loss of the shared model (and the backdoor's success rate), and the
        validation set's, in eval mode (BatchNorm uses its running statistics, dropout is off)."""
        backdoor = self.adversary.attack if isinstance(self.adversary.attack, Backdoor) else None
        self.model.eval()
        try:
            out = self._scores("test", self.data.test_slice, backdoor)
            if self.cfg.validation:
                out.update(self._scores("validation", lambda k: self.data.validation[k], None))
        finally:
            self.model.train()
        return out

    def _scores(self, name: str, part_of, backdoor: Backdoor | None) -> dict[str, float]:
        n = self.cfg.n_clients
        stats = np.zeros((5, n))  # loss sum, correct, count, triggered hits, triggered count
        with torch.no_grad():
            for k, client in enumerate(self.layout.local_clients):
                part = part_of(k)
                self.buffers.use(k)
                for a in range(0, len(part.y), EVAL_BATCH):
                    x, y = self.stage.tensor(part.x[a : a + EVAL_BATCH]), self.stage.tensor(part.y[a : a + EVAL_BATCH])
                    logits = self.model(x)
                    stats[0, client] += F.cross_entropy(logits, y, reduction="sum").item()
                    stats[1, client] += (logits.argmax(1) == y).sum().item()
                    if backdoor is not None:
                        keep = part.y[a : a + EVAL_BATCH] != backdoor.target
                        triggered = self.stage.tensor(backdoor.stamp(part.x[a : a + EVAL_BATCH][keep]))
                        if len(triggered):
                            stats[3, client] += (self.model(triggered).argmax(1) == backdoor.target).sum().item()
                        stats[4, client] += keep.sum()
                stats[2, client] = len(part.y)
        # One entry per client, zeros elsewhere: the sums are exact whatever the rank count.
        self.comm.Allreduce(MPI.IN_PLACE, stats, op=MPI.SUM)
        total = stats.sum(axis=1)
        out = {f"{name}_accuracy": total[1] / total[2], f"{name}_loss": total[0] / total[2]}
        if backdoor is not None:
            out["attack_success_rate"] = total[3] / max(total[4], 1)
        return out

    def mean_batch_loss(self, batch_loss: np.ndarray, cohort: Cohort | None = None) -> float:
        """Collective: the mean over every client, or the ``cohort``'s members (NaN for an empty one),
        of ``batch_loss`` (each rank fills its clients' entries)."""
        total = batch_loss.copy()
        self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        if cohort is not None:
            return float(total.sum() / cohort.size) if cohort.size else float("nan")
        return float(total.sum() / self.cfg.n_clients)
