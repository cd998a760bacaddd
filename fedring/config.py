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
    clients: int | None = None  # default: one client per MPI rank
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    partition: str = "fang"
    noniid: float = 0.5
    model: str = "cnn"
    rounds: int = 300
    lr: float = 0.1
    batch_size: int = 32
    local_steps: int = 1
    seed: int = 0
    eval_every: int = 10
    threads: int = 1
    out: str | None = None
    overwrite: bool = False
    quiet: bool = False
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name, {}))

    def default_out(self) -> str:
        return f"results/{self.topology}-{self.aggregator}-{self.dataset}-n{self.clients}-seed{self.seed}.h5"


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
    except (TypeError, ValueError):
        pass
    raise ConfigError(key, f"expected {kind.replace(' | None', '')}, got {value!r}")


def merge(cfg: Config, items: dict[str, Any], origin: str) -> Config:
    """Apply ``{key: value}`` (top-level names, dotted section keys, or TOML tables)."""
    for key, value in items.items():
        if isinstance(value, dict) and key not in FIELDS:
            cfg.sections.setdefault(key, {}).update(value)
        elif "." in key:
            section, name = key.split(".", 1)
            cfg.sections.setdefault(section, {})[name] = value
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
    for key in ("rounds", "batch_size", "local_steps", "eval_every", "threads"):
        positive(key)
    positive("seed", 0)
    if not cfg.lr > 0:
        raise ConfigError("lr", f"must be > 0, got {cfg.lr}")
    if cfg.partition == "fang" and not 0.0 <= cfg.noniid <= 1.0:
        raise ConfigError("noniid", f"Fang's degree q must be in [0, 1], got {cfg.noniid}")
    if cfg.partition == "dirichlet" and not cfg.noniid > 0:
        raise ConfigError("noniid", f"Dirichlet alpha must be > 0, got {cfg.noniid}")
    if cfg.out is None:
        cfg.out = cfg.default_out()
    if Path(cfg.out).exists() and not cfg.overwrite:
        raise ConfigError("out", f"{cfg.out} exists; pass --overwrite to replace it or choose another --out")
    return cfg
