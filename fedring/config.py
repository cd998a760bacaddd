"""Run configuration: defaults, TOML files, ``--set key=value``, validation.

Precedence: defaults < ``--config FILE.toml`` < ``--set key=value`` < named command-line
options. Top-level keys are the run's settings; a dotted key ``section.name`` is a parameter
of the component called ``section`` (``krum.variant``, ``brace.lambda``, ``attack.sigma``),
validated by that component when it is built.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

TOPOLOGIES = ("ring", "server")
DATASETS = ("fashion-mnist", "synthetic")
PARTITIONS = ("iid", "fang", "dirichlet")


@dataclass
class Config:
    """Every setting of a training run; the resolved copy is stored in the HDF5 file."""

    topology: str = "ring"
    aggregator: str = "mean"
    pre_aggregators: list = field(default_factory=list)
    clients: int | None = None  # default: one client per MPI rank
    byzantine: float = 0.0  # a fraction (< 1) or a count of clients
    byzantine_select: str = "random"
    declared_f: int | None = None  # what the defence is told; default: the actual count
    attack: str = "none"
    server_samples: int = 100
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    partition: str = "fang"
    noniid: float = 0.5
    model: str = "cnn"
    rounds: int = 2000
    lr: float = 0.1
    lr_schedule: str = "constant"
    batch_size: int = 32
    local_steps: int = 1
    seed: int = 0
    eval_every: int = 50
    threads: int = 1
    checkpoint_every: int = 10
    stop_grace: float = 30.0
    out: str | None = None
    overwrite: bool = False
    resume: bool = False
    quiet: bool = False
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name, {}))

    def default_out(self) -> str:
        attack = "" if self.attack == "none" else f"-{self.attack}"
        return f"results/{self.topology}-{self.aggregator}{attack}-{self.dataset}-n{self.clients}-seed{self.seed}.h5"


FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "sections"}


def parse_value(text: str) -> Any:
    """A ``--set`` value: a TOML literal (``5``, ``0.1``, ``true``, ``[1, 2]``, ``"x"``) or a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value: Any) -> Any:
    kind = FIELDS[key].type
    if value is None and "None" in kind:
        return None
    try:
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind.startswith("str"):
            if not isinstance(value, str):
                raise ValueError
            return value
        if kind == "list":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ValueError
            return [v.strip() for v in items if v.strip()]
    except (TypeError, ValueError):
        pass
    expected = "a list of names" if kind == "list" else kind.replace(" | None", "")
    raise ConfigError(key, f"expected {expected}, got {value!r}")


def merge(cfg: Config, items: dict[str, Any], origin: str) -> Config:
    """Apply ``{key: value}`` (top-level names, dotted section keys, or TOML tables)."""
    for key, value in items.items():
        if "." in key:
            section, name = key.split(".", 1)
            cfg.sections.setdefault(section, {})[name] = value
        elif isinstance(value, dict) and key not in FIELDS:
            cfg.sections.setdefault(key, {}).update(value)
        elif key in FIELDS:
            setattr(cfg, key, _coerce(key, value))
        else:
            raise ConfigError(key, f"unknown setting (from {origin}); allowed: {', '.join(FIELDS)}, or section.key")
    return cfg


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config", f"file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None


def validate(cfg: Config, world_size: int) -> Config:
    """Check every top-level setting; fills ``clients`` and ``out`` defaults."""

    def choice(key, allowed):
        if getattr(cfg, key) not in allowed:
            raise ConfigError(key, f"{getattr(cfg, key)!r} is not allowed; allowed: {', '.join(allowed)}")

    def positive(key, minimum=1):
        if getattr(cfg, key) < minimum:
            raise ConfigError(key, f"must be >= {minimum}, got {getattr(cfg, key)}")

    choice("topology", TOPOLOGIES)
    choice("dataset", DATASETS)
    choice("partition", PARTITIONS)
    if cfg.clients is None:
        cfg.clients = world_size
    positive("clients")
    if cfg.clients < world_size:
        raise ConfigError(
            "clients", f"{cfg.clients} clients on {world_size} MPI ranks: need clients >= ranks (K >= N)"
        )
    for key in ("rounds", "batch_size", "local_steps", "eval_every", "threads", "checkpoint_every", "server_samples"):
        positive(key)
    choice("byzantine_select", ("random", "first"))
    if cfg.byzantine < 0 or (cfg.byzantine >= 1 and not float(cfg.byzantine).is_integer()):
        raise ConfigError("byzantine", f"a fraction in [0, 1) or a whole count of clients, got {cfg.byzantine}")
    if byzantine_count(cfg) >= cfg.clients:
        raise ConfigError("byzantine", f"{byzantine_count(cfg)} Byzantine of {cfg.clients} clients leaves no honest client")
    if cfg.declared_f is not None and not 0 <= cfg.declared_f < cfg.clients:
        raise ConfigError("declared_f", f"must be in [0, clients), got {cfg.declared_f}")
    positive("seed", 0)
    if not cfg.stop_grace > 0:
        raise ConfigError("stop_grace", f"must be > 0 seconds, got {cfg.stop_grace}")
    if not cfg.lr > 0:
        raise ConfigError("lr", f"must be > 0, got {cfg.lr}")
    from .train.schedules import SCHEDULES, make_schedule

    choice("lr_schedule", tuple(SCHEDULES))
    make_schedule(cfg.lr_schedule, cfg.section(cfg.lr_schedule))
    if cfg.partition == "fang" and not 0.0 <= cfg.noniid <= 1.0:
        raise ConfigError("noniid", f"Fang's degree q must be in [0, 1], got {cfg.noniid}")
    if cfg.partition == "dirichlet" and not cfg.noniid > 0:
        raise ConfigError("noniid", f"Dirichlet alpha must be > 0, got {cfg.noniid}")
    check_names(cfg)
    if cfg.out is None:
        cfg.out = cfg.default_out()
    if cfg.resume and cfg.overwrite:
        raise ConfigError("resume", "--resume continues the file that --overwrite would replace: give one of them")
    if cfg.resume and not Path(cfg.out).exists():
        raise ConfigError("resume", f"nothing to resume: {cfg.out} does not exist")
    if Path(cfg.out).exists() and not (cfg.overwrite or cfg.resume):
        raise ConfigError("out", f"{cfg.out} exists; pass --overwrite to replace it, --resume to continue it, or choose another --out")
    return cfg


def check_names(cfg: Config) -> None:
    """Components exist and fit the topology (their parameters are checked when they are built)."""
    from .aggregators import AGGREGATORS, PRE_AGGREGATORS
    from .attacks import ATTACKS
    from .comm.brace import RING_RULES

    if cfg.topology == "ring" and cfg.aggregator not in ("mean", *RING_RULES):
        hint = " (a server rule: add --topology server)" if cfg.aggregator in AGGREGATORS else ""
        raise ConfigError("aggregator", f"{cfg.aggregator!r} does not run on the ring{hint}; allowed: mean, {', '.join(RING_RULES)}")
    if cfg.topology == "server" and cfg.aggregator not in AGGREGATORS:
        raise ConfigError("aggregator", f"unknown server rule {cfg.aggregator!r}; allowed: {', '.join(sorted(AGGREGATORS))}")
    for name in cfg.pre_aggregators:
        if name not in PRE_AGGREGATORS or cfg.topology != "server":
            raise ConfigError("pre_aggregators", f"{name!r}: allowed with --topology server: {', '.join(sorted(PRE_AGGREGATORS))}")
    if cfg.attack != "none" and cfg.attack not in ATTACKS:
        raise ConfigError("attack", f"unknown attack {cfg.attack!r}; allowed: none, {', '.join(ATTACKS)}")
    if cfg.attack != "none" and byzantine_count(cfg) == 0:
        raise ConfigError("byzantine", f"--attack {cfg.attack} needs Byzantine clients: set --byzantine")
    from .train.schedules import SCHEDULES

    known = {*AGGREGATORS, *PRE_AGGREGATORS, *RING_RULES, *(s for s in SCHEDULES if s != "constant"), "attack"}
    for section in cfg.sections:
        if section not in known:
            raise ConfigError(section, f"unknown settings section; allowed: {', '.join(sorted(known))}")


def byzantine_count(cfg: Config) -> int:
    """Actual number of Byzantine clients: a fraction of ``clients`` (rounded) or a count."""
    return int(round(cfg.byzantine * cfg.clients)) if cfg.byzantine < 1 else int(cfg.byzantine)


def defence_f(cfg: Config) -> int:
    """The Byzantine count the defence is told: ``declared_f``, else the actual count."""
    return byzantine_count(cfg) if cfg.declared_f is None else cfg.declared_f


#: Settings that steer a run without changing its results; --resume ignores them.
RUN_CONTROL = ("out", "overwrite", "resume", "quiet", "checkpoint_every", "stop_grace")


def config_differences(stored: dict, current: dict) -> list[str]:
    """``key: stored -> current`` for every result-changing setting that differs.

    A key missing on one side counts as its default (files written before a setting
    existed stay valid), and an empty section is no section.
    """
    defaults = dataclasses.asdict(Config())
    out = []
    for key in sorted((set(stored) | set(current)) - set(RUN_CONTROL)):
        a, b = stored.get(key, defaults.get(key)), current.get(key, defaults.get(key))
        if key == "sections":
            a, b = ({k: v for k, v in (x or {}).items() if v} for x in (a, b))
        if a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out
