"""The ``train`` task: federated training, configured by the top-level settings (``docs/cli.md``).

Validation here imports no torch and builds the run's components once
(:mod:`fedring.train.components`); :meth:`TrainTask.prepare` builds the :class:`Trainer` (data,
model, the parts of a round) from them on every rank.
"""

from __future__ import annotations

from fedring import validate
from fedring.config import Config, byzantine_count
from fedring.datasets import DATASETS, Dataset
from fedring.errors import ConfigError
from fedring.tasks import TASKS, Task

from .data import PARTITIONS
from .participation import validate_settings

TOPOLOGIES = ("ring", "server")
DEVICES = ("cpu", "cuda", "auto")  # fedring.train.device
#: more torch threads per rank than any machine has cores is a typo
MAX_THREADS = 1024


def clients_and_device(cfg: Config, world_size: int) -> None:
    """The topology, the data set and partition's names, the clients and their ranks, the device (fills
    ``clients`` and the default ``model``)."""
    validate.choice("topology", cfg.topology, TOPOLOGIES)
    DATASETS.get(cfg.dataset, "dataset")
    validate.choice("partition", cfg.partition, PARTITIONS)
    if cfg.clients is None:
        cfg.clients = world_size
    validate.integer("clients", cfg.clients, lo=1)
    samples = DATASETS[cfg.dataset].train_samples
    if samples is not None and cfg.clients > samples:
        raise ConfigError(
            "clients",
            f"{cfg.clients} clients but {cfg.dataset} has {samples:,} training samples: "
            "every client needs at least one",
        )
    validate.integer("threads", cfg.threads, lo=1, hi=MAX_THREADS)
    validate.choice("device", cfg.device, DEVICES)
    if cfg.device == "cuda":  # no GPU: one message on every rank, before any work (imports torch)
        from .device import require_visible

        require_visible(cfg.device)
    if cfg.batched_clients is not None:
        validate.integer("batched_clients", cfg.batched_clients, lo=1, hi=cfg.clients)
        if cfg.local_epochs is not None:
            raise ConfigError(
                "batched_clients",
                "local_epochs' last batch of a pass is shorter: use local_steps, or the per-client loop",
            )
    if cfg.model == "cnn":  # the default model: the one that fits the data set's images
        cfg.model = DATASETS[cfg.dataset].model
    validate.fills_ranks("clients", cfg.clients, world_size)


def local_work_and_adversary(cfg: Config) -> None:
    """The rounds and local work, the Byzantine clients and what the defence is told, the step size."""
    for key in ("rounds", "batch_size", "local_steps", "eval_every", "checkpoint_every", "server_samples"):
        validate.integer(key, getattr(cfg, key), lo=1)
    validate.choice("byzantine_select", cfg.byzantine_select, ("random", "first"))
    if cfg.byzantine < 0 or (cfg.byzantine >= 1 and not float(cfg.byzantine).is_integer()):
        raise ConfigError("byzantine", f"a fraction in [0, 1) or a whole count of clients, got {cfg.byzantine}")
    if byzantine_count(cfg) >= cfg.n_clients:
        raise ConfigError(
            "byzantine", f"{byzantine_count(cfg)} Byzantine of {cfg.clients} clients leaves no honest client"
        )
    if cfg.declared_f is not None:
        validate.integer("declared_f", cfg.declared_f, lo=0, hi=cfg.n_clients - 1)
    validate.real("lr", cfg.lr, lo=0, lo_open=True)
    if cfg.local_epochs is not None:
        validate.integer("local_epochs", cfg.local_epochs, lo=1)
        if cfg.local_steps != 1:
            raise ConfigError(
                "local_epochs",
                f"local_epochs ({cfg.local_epochs}) and local_steps "
                f"({cfg.local_steps}) both set the local work: give one of them",
            )
    validate.real("validation", cfg.validation, lo=0, hi=1, hi_open=True)
    validate.choice("bn_stats", cfg.bn_stats, ("aggregate", "local"))


def partition_fits(cfg: Config) -> None:
    """The partition's own setting, and a natural partition's users."""
    if cfg.partition == "fang":
        validate.real("noniid", cfg.noniid, lo=0, hi=1)
    if cfg.partition == "dirichlet" and not cfg.noniid > 0:
        raise ConfigError("noniid", f"Dirichlet alpha must be > 0, got {cfg.noniid}")
    if cfg.partition == "natural" and DATASETS[cfg.dataset].train_users is Dataset.train_users:
        raise ConfigError(
            "partition",
            f"natural gives each client one of the data set's users, and {cfg.dataset} records none "
            "(femnist and shakespeare do, and a data set whose train_users() returns them)",
        )


@TASKS.register
class TrainTask(Task):
    """Federated training over the ring or with a server (:mod:`fedring.train`)."""

    name = "train"

    def __init__(self, cfg: Config, world_size: int):
        super().__init__(cfg, world_size)
        clients_and_device(cfg, world_size)
        local_work_and_adversary(cfg)
        partition_fits(cfg)
        validate_settings(
            cfg.participation, cfg.availability, cfg.availability_file, cfg.cohort_f, cfg.rounds, cfg.n_clients
        )
        from .components import build  # no torch: the run's components, built once and used by the run

        self.parts = build(cfg)

    def default_out(self) -> str:
        def short(name: str) -> str:  # an import path by its class name
            return name.rpartition(":")[2]

        cfg = self.cfg
        attack = "" if cfg.attack == "none" else f"-{short(cfg.attack)}"
        return (
            f"results/{cfg.topology}-{short(cfg.aggregator)}{attack}-{short(cfg.dataset)}-n{cfg.clients}"
            f"-seed{cfg.seed}.h5"
        )

    def steps(self) -> tuple[int, str]:
        return self.cfg.rounds, "rounds"

    def banner(self, world_size: int) -> str:
        cfg = self.cfg
        b = byzantine_count(cfg)
        attack = (
            f", {b} Byzantine ({100 * b / cfg.n_clients:.0f} %) "
            f"{'attacking: ' + cfg.attack if cfg.attack != 'none' else 'behaving honestly'}"
            if b
            else ", no Byzantine clients"
        )
        schedule = "" if cfg.lr_schedule == "constant" else f" ({cfg.lr_schedule} schedule)"
        return (
            f"fedring: train: {cfg.topology} topology, {self.parts.label}; {cfg.clients} clients on {world_size} rank"
            f"{'s' if world_size > 1 else ''}{attack}; {cfg.dataset}, {cfg.rounds} rounds, lr {cfg.lr:g}{schedule}, "
            f"seed {cfg.seed} -> {cfg.out}"
        ) + (f"\n{self.device_line}" if getattr(self, "device_line", "") else "")

    def prepare(self, comm):
        from fedring.job import Driver

        from .loop import TrainJob  # torch is imported only now
        from .trainer import Trainer

        trainer = Trainer(self.cfg, comm, parts=self.parts)
        self.device_line = trainer.device_line
        return Driver(TrainJob(trainer), self.cfg, comm)
