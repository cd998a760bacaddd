"""The ``train`` task: federated training, configured by the top-level settings (``docs/cli.md``).

Validation here imports no torch; :meth:`TrainTask.prepare` builds the :class:`Trainer`
(data, model, topology, adversary) on every rank.
"""

from __future__ import annotations

from fedring import validate as check
from fedring.config import Config, byzantine_count
from fedring.datasets import DATASETS
from fedring.errors import ConfigError
from fedring.tasks import TASKS, Task

TOPOLOGIES = ("ring", "server")
PARTITIONS = ("iid", "fang", "dirichlet", "shards")
DEVICES = ("cpu", "cuda", "auto")  # fedring.train.device
#: more torch threads per rank than any machine has cores is a typo
MAX_THREADS = 1024


def aggregator_rules(topology: str):
    """The registry of the rules that run on ``topology``."""
    from fedring.aggregators import AGGREGATORS
    from fedring.comm import RING_RULES

    return RING_RULES if topology == "ring" else AGGREGATORS


def aggregator_names(topology: str) -> list[str]:
    """The rules that run on ``topology``."""
    return list(aggregator_rules(topology))


def check_aggregator(cfg: Config) -> None:
    """The rule exists and runs on the topology; a near miss or a rule of the other topology gets a hint."""
    if ":" in cfg.aggregator:  # an import path: imported and checked as a rule of this topology
        aggregator_rules(cfg.topology).get(cfg.aggregator, "aggregator")
        return
    here = aggregator_names(cfg.topology)
    if cfg.aggregator in here:
        return
    other = "server" if cfg.topology == "ring" else "ring"
    there = aggregator_names(other)
    move = f"a {other} rule: add --topology {other}"
    if cfg.aggregator in there:
        raise ConfigError(
            "aggregator", f"{cfg.aggregator!r} is {move}; allowed on the {cfg.topology}: {', '.join(here)}"
        )
    close = check.closest(cfg.aggregator, [*here, *there])
    hint = "" if close is None else f"did you mean {close!r}{'' if close in here else f' ({move})'}? "
    raise ConfigError(
        "aggregator", f"unknown aggregator {cfg.aggregator!r}; {hint}allowed on the {cfg.topology}: {', '.join(here)}"
    )


def check_components(cfg: Config) -> None:
    """Components exist and fit the topology (their parameters are checked when they are built)."""
    from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS
    from fedring.attacks import ATTACKS
    from fedring.comm import RING_RULES

    from .optim import SERVER_OPTIMIZERS, ClientOptimizer, make_server_optimizer
    from .schedules import SCHEDULES, make_schedule

    check_aggregator(cfg)
    ClientOptimizer(cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.clip_norm)
    make_server_optimizer(cfg.server_optimizer, cfg.section(cfg.server_optimizer))
    if cfg.partition == "shards":
        check.known_keys("shards", "partition shards", cfg.section("shards"), ["per_client"])
        check.integer("shards.per_client", cfg.section("shards").get("per_client", 2), lo=1)
    for name in cfg.pre_aggregators:
        PRE_AGGREGATORS.get(name, "pre_aggregators")
        if cfg.topology != "server":
            raise ConfigError("pre_aggregators", f"{name!r} runs in front of a server rule: add --topology server")
    if cfg.attack != "none":
        ATTACKS.get(cfg.attack, "attack", hint="or none; ")
        if byzantine_count(cfg) == 0:
            raise ConfigError("byzantine", f"--attack {cfg.attack} needs Byzantine clients: set --byzantine")
    make_schedule(cfg.lr_schedule, cfg.section(cfg.lr_schedule))
    known = sorted(
        {
            *AGGREGATORS,
            *PRE_AGGREGATORS,
            *RING_RULES,
            *(s for s in SCHEDULES if s != "constant"),
            "attack",
            *SERVER_OPTIMIZERS,
            "shards",
        }
    )
    used = {cfg.aggregator, *cfg.pre_aggregators, cfg.lr_schedule, "attack", cfg.server_optimizer, cfg.partition}
    if cfg.topology == "server" and cfg.aggregator == "hplus":
        used.add(cfg.section("hplus").get("base", "median"))  # its base rule takes its own section
    for section in cfg.sections:
        if section not in known:
            raise ConfigError(
                section, f"unknown settings section; {check.suggestion(section, known)}allowed: {', '.join(known)}"
            )
        if section not in used and cfg.sections[section]:
            raise ConfigError(
                section,
                f"settings of {section}, which this run does not use (aggregator "
                f"{cfg.aggregator}, lr_schedule {cfg.lr_schedule}, server_optimizer "
                f"{cfg.server_optimizer}, partition {cfg.partition}): remove them, or select it",
            )
    if "relay_clients" in cfg.section(cfg.aggregator):
        raise ConfigError(
            f"{cfg.aggregator}.relay_clients",
            "in a run the Byzantine clients are the relays: choose them with --byzantine and byzantine_select",
        )


def check_participation(cfg: Config) -> None:
    """Client sampling's settings (``docs/training.md``)."""
    from .participation import check_settings

    check_settings(cfg.participation, cfg.availability, cfg.availability_file, cfg.cohort_f, cfg.rounds, cfg.n_clients)


@TASKS.register
class TrainTask(Task):
    """Federated training over the ring or with a server (:mod:`fedring.train`)."""

    name = "train"

    def __init__(self, cfg: Config, world_size: int):
        super().__init__(cfg, world_size)
        check.choice("topology", cfg.topology, TOPOLOGIES)
        DATASETS.get(cfg.dataset, "dataset")
        check.choice("partition", cfg.partition, PARTITIONS)
        if cfg.clients is None:
            cfg.clients = world_size
        check.integer("clients", cfg.clients, lo=1)
        samples = DATASETS[cfg.dataset].train_samples
        if samples is not None and cfg.clients > samples:
            raise ConfigError(
                "clients",
                f"{cfg.clients} clients but {cfg.dataset} has {samples:,} training samples: "
                "every client needs at least one",
            )
        check.integer("threads", cfg.threads, lo=1, hi=MAX_THREADS)
        check.choice("device", cfg.device, DEVICES)
        if cfg.device == "cuda":  # no GPU: one message on every rank, before any work (imports torch)
            from .device import check_visible

            check_visible(cfg.device)
        if cfg.batched_clients is not None:
            check.integer("batched_clients", cfg.batched_clients, lo=1, hi=cfg.clients)
            if cfg.local_epochs is not None:
                raise ConfigError(
                    "batched_clients",
                    "local_epochs' last batch of a pass is shorter: use local_steps, or the per-client loop",
                )
        if cfg.model == "cnn":  # the default model: the one that fits the data set's images
            cfg.model = DATASETS[cfg.dataset].model
        check.fills_ranks("clients", cfg.clients, world_size)
        for key in ("rounds", "batch_size", "local_steps", "eval_every", "checkpoint_every", "server_samples"):
            check.integer(key, getattr(cfg, key), lo=1)
        check.choice("byzantine_select", cfg.byzantine_select, ("random", "first"))
        if cfg.byzantine < 0 or (cfg.byzantine >= 1 and not float(cfg.byzantine).is_integer()):
            raise ConfigError("byzantine", f"a fraction in [0, 1) or a whole count of clients, got {cfg.byzantine}")
        if byzantine_count(cfg) >= cfg.clients:
            raise ConfigError(
                "byzantine", f"{byzantine_count(cfg)} Byzantine of {cfg.clients} clients leaves no honest client"
            )
        if cfg.declared_f is not None:
            check.integer("declared_f", cfg.declared_f, lo=0, hi=cfg.clients - 1)
        check.real("lr", cfg.lr, lo=0, lo_open=True)
        if cfg.local_epochs is not None:
            check.integer("local_epochs", cfg.local_epochs, lo=1)
            if cfg.local_steps != 1:
                raise ConfigError(
                    "local_epochs",
                    f"local_epochs ({cfg.local_epochs}) and local_steps "
                    f"({cfg.local_steps}) both set the local work: give one of them",
                )
        check.real("validation", cfg.validation, lo=0, hi=1, hi_open=True)
        check.choice("bn_stats", cfg.bn_stats, ("aggregate", "local"))
        if cfg.partition == "fang":
            check.real("noniid", cfg.noniid, lo=0, hi=1)
        if cfg.partition == "dirichlet" and not cfg.noniid > 0:
            raise ConfigError("noniid", f"Dirichlet alpha must be > 0, got {cfg.noniid}")
        check_components(cfg)
        check_participation(cfg)

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
        rule = cfg.aggregator + (
            f" ({cfg.section('brace').get('rule', 'paper')} rule)" if cfg.aggregator == "brace" else ""
        )
        if cfg.pre_aggregators:
            rule = "+".join([*cfg.pre_aggregators, rule])
        attack = (
            f", {b} Byzantine ({100 * b / cfg.n_clients:.0f} %) "
            f"{'attacking: ' + cfg.attack if cfg.attack != 'none' else 'behaving honestly'}"
            if b
            else ", no Byzantine clients"
        )
        schedule = "" if cfg.lr_schedule == "constant" else f" ({cfg.lr_schedule} schedule)"
        return (
            f"fedring: train: {cfg.topology} topology, {rule}; {cfg.clients} clients on {world_size} rank"
            f"{'s' if world_size > 1 else ''}{attack}; {cfg.dataset}, {cfg.rounds} rounds, lr {cfg.lr:g}{schedule}, "
            f"seed {cfg.seed} -> {cfg.out}"
        ) + (f"\n{self.device_line}" if getattr(self, "device_line", "") else "")

    def prepare(self, comm):
        from fedring.job import Driver

        from .loop import TrainJob  # torch is imported only now
        from .trainer import Trainer

        trainer = Trainer(self.cfg, comm)
        self.device_line = trainer.device_line
        return Driver(TrainJob(trainer), self.cfg, comm)
