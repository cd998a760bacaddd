"""A training run on one rank, as the parts a round flows through (:func:`fedring.train.loop.train_round`):

==================  ==========================================  =========================================
part                module                                      what it holds
==================  ==========================================  =========================================
``participation``   :mod:`fedring.train.participation`          who takes part in each round (the cohort)
``clients``         :mod:`fedring.train.clients`                this rank's clients: shards, optimizer
                                                                rows, the buffer of their uploads
``server_data``     :mod:`fedring.train.gradients`              the server's clean-data gradient source
``privacy``         :mod:`fedring.train.privacy`                DP-FedAvg: local clipping and noise, or
                                                                the server's noise on the mean
``adversary``       :mod:`fedring.train.adversary`              the Byzantine clients and their attack
``topology``        :mod:`fedring.train.topology`               the ring or the server, with its rule
``replica``         :mod:`fedring.train.replica`                the model, its weights, server optimizer
``evaluation``      :mod:`fedring.train.evaluation`             test and validation scores
==================  ==========================================  =========================================

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
from mpi4py import MPI

from fedring.aggregators.probe import OutputLayer
from fedring.arrays import host
from fedring.attacks import Backdoor
from fedring.attacks.base import ModelAccess
from fedring.comm import Layout, Network
from fedring.comm.ring import RingRule
from fedring.config import Config, defence_f
from fedring.datasets import DATASETS

from . import components
from .adversary import Adversary, byzantine_clients
from .attacker import AttackerModel, layer_slices
from .batched import VmapGradients
from .clients import Clients
from .data import FederatedData
from .device import Staging, describe, select
from .evaluation import Evaluation
from .gradients import ModelGradients
from .models import flatten, make_model
from .participation import from_config
from .probe import ModelProbe, output_layer
from .replica import Replica
from .schedules import StepSizes
from .state import ModelBuffers, checkpoint_rows, rows_from_file
from .topology import RingTopology, ServerTopology

#: checkpoint arrays that each rank reads for its own clients on --resume (rank 0 never holds them all)
PER_RANK = ("client_",)


def topology_of(
    parts: components.Components, net: Network, byzantine: np.ndarray, seed: int, d: int
) -> RingTopology | ServerTopology:
    """The topology of the run's rule: the ring for a ring rule (with its builder for cohorts), else the server."""
    if isinstance(parts.rule, RingRule):
        assert parts.ring_rule is not None, "a ring rule comes with its builder for cohorts"
        return RingTopology(net, parts.rule, parts.ring_rule, byzantine, d)
    return ServerTopology(net, parts.rule, seed, d)


def federated_data(cfg: Config, clients: range, server: bool) -> FederatedData:
    """The shards of this rank's ``clients`` (and the server's clean samples when ``server``)."""
    return FederatedData(
        cfg.dataset,
        cfg.data_dir,
        cfg.n_clients,
        clients,
        cfg.partition,
        cfg.noniid,
        cfg.seed,
        server_samples=cfg.server_samples if server else 0,
        shards_per_client=cfg.section("shards").get("per_client", 2),
        validation=cfg.validation,
        settings=cfg.section(cfg.partition),
    )


def attacker_model(cfg: Config, model: torch.nn.Module, layer: OutputLayer, client: int) -> AttackerModel:
    """Rank 0's copy of the model with Byzantine ``client``'s shard, for an attack that trains models."""
    shard = federated_data(cfg, range(client, client + 1), False).shards[0]
    steps = cfg.local_steps if cfg.local_epochs is None else cfg.local_epochs * -(-len(shard.y) // cfg.batch_size)
    return AttackerModel(model, shard, client, layer, cfg.batch_size, steps, cfg.seed)


class Trainer:
    """Collective: the parts of one run on one rank (module docstring), built from the run's settings
    and its ``parts`` (:func:`fedring.train.components.build`; built here when not given).
    ``host_path=False`` computes the clients' updates on the device path on the CPU too
    (:class:`fedring.train.device.Staging`; tests compare the paths)."""

    def __init__(
        self, cfg: Config, comm: MPI.Comm, host_path: bool | None = None, parts: components.Components | None = None
    ):
        torch.set_num_threads(cfg.threads)
        parts = components.build(cfg) if parts is None else parts
        self.cfg, self.comm = cfg, comm
        self.layout = Layout(cfg.n_clients, comm)
        self.net = Network(self.layout)
        model = make_model(cfg.model, cfg.seed, DATASETS[cfg.dataset].shape, DATASETS[cfg.dataset].classes)
        w = flatten(model)
        self.d = w.size
        self.device = select(cfg.device, comm)
        self.device_line = describe(comm, self.device) if cfg.device != "cpu" else ""
        model.to(self.device)
        stage = Staging(self.device, self.d, host_path)
        self.net.transfers = stage.transfers()
        self.lr_at = StepSizes(cfg.lr, parts.schedule, cfg.rounds)
        self.byzantine = byzantine_clients(cfg)
        self.f = defence_f(cfg)
        self.topology = topology_of(parts, self.net, self.byzantine, cfg.seed, self.d)
        self.adversary = Adversary(
            cfg, self.net, self.byzantine, parts.attack, self.topology.reference_rule, self.lr_at
        )
        data = federated_data(cfg, self.layout.local_clients, self.topology.needs_reference and comm.rank == 0)
        self.server_data = data.server
        self.rows_comm = comm.Dup()  # checkpoint rows, apart from the protocol's messages
        buffers = ModelBuffers(model, cfg.bn_stats, self.layout, on_device=not stage.on_host)
        self.model_gradients = ModelGradients(model, stage, buffers, self.layout.lo)
        source: ModelGradients | VmapGradients = self.model_gradients
        if cfg.batched_clients is not None:
            source = VmapGradients(model, cfg.model, stage, cfg.batched_clients, data.shards, cfg.batch_size, comm)
        self.clients = Clients(
            cfg,
            self.layout,
            data.shards,
            stage,
            source,
            parts.client_optimizer,
            self.adversary.poisoned(),
            self.adversary.data_attack,
            self.lr_at,
            self.d,
        )
        self.replica = Replica(model, w, stage, parts.server_optimizer, self.lr_at, buffers)
        self.model_probe: ModelProbe | None = None
        if self.topology.needs_probe:  # every rank reads the model, so one the rule cannot read stops all alike
            dataset = DATASETS[cfg.dataset]
            layer = output_layer(model, dataset.classes, dataset.shape)
            if comm.rank == 0:
                self.model_probe = ModelProbe(model, layer, dataset.shape, buffers)
        self.attacker: AttackerModel | None = None
        if getattr(parts.attack, "needs_model", False):  # every rank checks, so a bad setting stops all alike
            dataset = DATASETS[cfg.dataset]
            layer = output_layer(model, dataset.classes, dataset.shape, key="attack", who=cfg.attack)
            layer_slices(model)
            if comm.rank == 0:
                self.attacker = attacker_model(cfg, model, layer, int(self.byzantine[0]))
        backdoor = parts.attack if isinstance(parts.attack, Backdoor) else getattr(parts.attack, "trigger", None)
        self.evaluation = Evaluation(model, stage, buffers, data, self.layout, backdoor, cfg.validation > 0)
        self.participation = from_config(cfg)
        self.privacy = parts.privacy

    def reference(self) -> np.ndarray | None:
        """The server's gradient on its small clean data set (FLTrust, Zeno++), on rank 0; None elsewhere
        and for the rules that need none."""
        if self.server_data is None:
            return None
        return self.model_gradients.at(self.server_data.x, self.server_data.y, self.d)

    def probe(self, t: int) -> ModelProbe | None:
        """Round ``t``'s model for the rules that inspect it (DeepSight), on rank 0: the replica's weights
        and the round's learning rate; None elsewhere and for the rules that need none."""
        if self.model_probe is None:
            return None
        return self.model_probe.at(self.replica.w, self.lr_at(t))

    def attacker_model(self, t: int) -> ModelAccess | None:
        """Round ``t``'s model and data for an attack that trains models itself (3DFed), on rank 0: from
        the replica's weights and the round's learning rate; None elsewhere and for the other attacks."""
        if self.attacker is None:
            return None
        return self.attacker.at(t, self.replica.w, self.lr_at(t))

    def checkpoint(self) -> dict:
        """Collective: what a resumed run needs besides the round, on rank 0: the replica (model,
        server optimizer, buffers), the aggregator's state and every client's optimizer rows. The
        clients' rows come last: the other ranks send their blocks while rank 0 writes them
        (:class:`fedring.train.state.CheckpointRows`), before its next collective."""
        replica = self.replica.checkpoint()
        rows = {f"client_{k}": checkpoint_rows(self.rows_comm, self.layout, v) for k, v in self.clients.state.items()}
        attack = {f"attack_{k}": v for k, v in self.attack_state().items()}
        state = {f"state_{k}": host(v) for k, v in self.topology.state.items()}  # a device rule keeps some there
        return {**replica, **state, **attack, **rows}

    def attack_state(self) -> dict[str, np.ndarray]:
        """What the attack carries between rounds (3DFed's feedback state, on rank 0), else nothing."""
        return getattr(self.adversary.model_attack, "state", None) or {}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Collective: continue from :meth:`checkpoint` as stored. ``arrays`` holds all but the clients'
        rows (:data:`PER_RANK`), which each rank reads for its own clients."""
        self.replica.restore(arrays)
        self.topology.state.update(
            {k.removeprefix("state_"): np.array(v) for k, v in arrays.items() if k.startswith("state_")}
        )
        attack = {k.removeprefix("attack_"): np.array(v) for k, v in arrays.items() if k.startswith("attack_")}
        if attack:
            self.adversary.model_attack.state = attack  # type: ignore[union-attr]
        for name, local in self.clients.state.items():
            rows_from_file(self.rows_comm, self.layout, self.cfg.out, f"client_{name}", local)
