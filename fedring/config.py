"""Run configuration for every task: defaults, TOML files, ``--set key=value``, validation.

Precedence: defaults < ``--config FILE.toml`` < ``--set key=value`` < named command-line
options. The key ``task`` picks what runs: ``train`` (federated training, the default),
``prism`` (PRISM-FCP, Rob-FCP, FCP) or ``labelshift`` (DP-FedCP). Top-level keys are the
settings every task has (``seed``, ``out`` ...) and training's settings; a dotted key
``section.name`` is a parameter of the component or task called ``section``
(``krum.variant``, ``brace.lambda``, ``attack.sigma``, ``prism.trials``), validated when the
component is built or the task checks its settings. ``docs/cli.md`` lists every key.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
from dataclasses import dataclass, field
from typing import Any

from . import validate
from .errors import ConfigError

#: the experiment trackers' settings (fedring.tracking): run control that ``--resume`` takes from
#: the file unless given, so that a resumed run goes on logging where it did
TRACKING = ("log", "tensorboard_dir", "mlflow_uri")
#: settings of every task; the other top-level settings belong to training
GENERAL = ("task", "plugins", "seed", "out", "overwrite", "resume", "quiet", "stop_grace", *TRACKING)
#: settings that steer a run without changing its results: --resume and sweeps ignore them
RUN_CONTROL = ("out", "overwrite", "resume", "quiet", "checkpoint_every", "stop_grace", *TRACKING)


@dataclass
class Config:
    """Every setting of a run; the resolved copy is stored in its HDF5 file (``config``)."""

    task: str = "train"
    plugins: list = field(default_factory=list)  # the user's modules, imported first (fedring.plugins)
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
    validation: float = 0.0  # fraction of every client's training data held out for validation
    model: str = "cnn"
    bn_stats: str = "aggregate"
    rounds: int = 100  # a forgotten --rounds costs seconds, not an hour (docs/cli.md)
    lr: float = 0.1
    lr_schedule: str = "constant"
    batch_size: int = 32
    local_steps: int = 1
    local_epochs: int | None = None  # passes over the shard instead of local_steps
    momentum: float = 0.0
    nesterov: bool = False
    dampening: bool = False  # m = beta m + (1 - beta) u (ByzFL's form) instead of heavy ball m = beta m + u
    weight_decay: float = 0.0
    clip_norm: float | None = None
    dp: str = "none"  # client-level differential privacy: none, central or local (fedring.train.privacy)
    server_optimizer: str = "sgd"
    seed: int = 0
    eval_every: int = 50
    threads: int = 1
    device: str = "cpu"
    batched_clients: int | None = None  # clients per vmap call; unset: one client at a time
    participation: float = 1.0  # clients per round: a fraction in (0, 1] or a count (fedring.train.participation)
    availability: float = 1.0  # the probability that a client is available in a round
    availability_file: str | None = None  # a rounds x clients 0/1 table of who is available
    cohort_f: str = "scaled"  # the f a server rule is told for a cohort: scaled or declared
    checkpoint_every: int = 10
    stop_grace: float = 30.0
    out: str | None = None
    overwrite: bool = False
    resume: bool = False
    quiet: bool = False
    log: list = field(default_factory=list)  # experiment trackers rank 0 also logs to: tensorboard, mlflow
    tensorboard_dir: str = "runs"  # the run's event files go to <tensorboard_dir>/<results file stem>
    mlflow_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else MLflow's own (sqlite:///mlflow.db)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name, {}))

    @property
    def n_clients(self) -> int:
        """``clients`` once the task's checks have filled its default (one client per rank)."""
        assert self.clients is not None, "clients is read before the task resolved it"
        return self.clients


FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "sections"}
validate.TOP_LEVEL_KEYS.update(FIELDS)
DEFAULTS = Config()
#: DEFAULTS as a dict, made once: a sweep compares thousands of configs with it
DEFAULT_VALUES = types.MappingProxyType(dataclasses.asdict(DEFAULTS))


def parse_value(text: str) -> Any:
    """A ``--set`` value: a TOML literal (``5``, ``0.1``, ``true``, ``[1, 2]``, ``"x"``) or a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):  # ValueError: an integer of > 4300 digits
        return text


def parse_setting(item: str, key: str = "set") -> dict[str, Any]:
    """A ``--set`` item ``KEY=VALUE`` as ``{KEY: value}`` (:func:`parse_value`); an item without ``=``
    is a :class:`ConfigError` named ``key``.

    >>> parse_setting("momentum=0.9")
    {'momentum': 0.9}
    """
    name, sep, value = item.partition("=")
    if not sep:
        raise ConfigError(key, f"expected KEY=VALUE, got {item!r}")
    return {name.strip(): parse_value(value.strip())}


def coerce(key: str, kind: str, value: Any) -> Any:
    """``value`` as the type ``kind`` names (``"int"``, ``"float | None"``, ``"list"`` ...)."""
    if value is None and "None" in kind:
        return None
    base = kind.replace(" | None", "")
    if base == "int":
        return validate.integer(key, value)
    if base == "float":
        return validate.real(key, value)
    if base == "bool":
        return validate.boolean(key, value)
    if base == "str":
        return validate.text(key, value)
    if base in ("list", "list[str]"):
        return validate.names(key, value)
    if base == "list[float]":
        items = value if isinstance(value, list) else [value]
        return [validate.real(key, v) for v in items]
    if base == "list[int]":
        items = value if isinstance(value, list) else [value]
        return [validate.integer(key, v) for v in items]
    raise TypeError(f"setting {key} has a type fedring cannot read: {kind}")


def split_key(key: str) -> tuple[str, str]:
    """``section.name`` -> (section, name); a section named by an import path keeps its dots.

    >>> split_key("krum.variant"), split_key("lab.rules:Trim.beta")
    (('krum', 'variant'), ('lab.rules:Trim', 'beta'))
    """
    colon = key.find(":")
    dot = key.find(".", colon + 1) if colon >= 0 else key.find(".")
    return (key[:dot], key[dot + 1 :]) if dot >= 0 else (key, "")


def merge(cfg: Config, items: dict[str, Any], origin: str) -> Config:
    """Apply ``{key: value}`` (top-level names, dotted section keys, or TOML tables)."""
    for key, value in items.items():
        section, name = split_key(key)
        if name:
            cfg.sections.setdefault(section, {})[name] = value
        elif isinstance(value, dict):  # a table is a section (no setting takes a table), even [attack]
            cfg.sections.setdefault(key, {}).update(value)
        elif key in FIELDS:
            setattr(cfg, key, coerce(key, str(FIELDS[key].type), value))
        else:
            raise ConfigError(
                key,
                f"unknown setting (from {origin}); {validate.suggestion(key, FIELDS)}"
                f"allowed: {', '.join(FIELDS)}, or section.key",
            )
    return cfg


#: a settings file is a few lines; anything larger is refused before it is parsed
MAX_CONFIG_BYTES = 1 << 20


def load_toml(path: str) -> dict[str, Any]:
    """The settings file ``path``: UTF-8 TOML (a leading byte-order mark is allowed), at most 1 MiB."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("config", f"file {path} does not exist") from None
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a settings file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError: an integer of > 4300 digits
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError("config", f"{path} nests its values too deeply to be a settings file") from None


def section_settings(schema: type, name: str, values: dict[str, Any]):
    """The settings section ``[name]`` as an instance of the dataclass ``schema``.

    Unknown keys are refused with the allowed list; values are read as the fields' types;
    the schema's ``validate()`` (if any) checks ranges and fills derived defaults.
    """
    kinds = {f.name: str(f.type) for f in dataclasses.fields(schema)}  # annotations as text (PEP 563)
    validate.known_keys(name, f"task {name}", values, kinds)
    settings = schema(**{k: coerce(f"{name}.{k}", kinds[k], v) for k, v in values.items()})
    if hasattr(settings, "validate"):
        settings.validate()
    return settings


def byzantine_count(cfg: Config) -> int:
    """Actual number of Byzantine clients: a fraction of ``clients`` (rounded) or a count."""
    return round(cfg.byzantine * cfg.n_clients) if cfg.byzantine < 1 else int(cfg.byzantine)


def defence_f(cfg: Config) -> int:
    """The Byzantine count the defence is told: ``declared_f``, else the actual count."""
    return byzantine_count(cfg) if cfg.declared_f is None else cfg.declared_f


def canonical(settings: Config | dict) -> dict[str, Any]:
    """The one canonical form of a config (a :class:`Config`, or its stored JSON as a dict): the
    result-changing settings that differ from the defaults, in fedring's order, then the
    non-empty sections, sorted. A key missing counts as its default, so a file written before
    a setting existed stays valid. The sweep hashes it; ``--resume`` compares it."""
    values = dataclasses.asdict(settings) if isinstance(settings, Config) else settings
    defaults = DEFAULT_VALUES
    out = {
        key: value
        for key, value in values.items()
        if key not in RUN_CONTROL and key != "sections" and value != defaults.get(key)
    }
    sections = {name: table for name, table in sorted((values.get("sections") or {}).items()) if table}
    if sections:
        out["sections"] = sections
    return out


def config_differences(stored: dict, current: dict) -> list[str]:
    """``key: stored -> current`` for every setting in which the :func:`canonical` forms differ."""
    a, b = canonical(stored), canonical(current)
    defaults = {**DEFAULT_VALUES, "sections": {}}
    return [
        f"{key}: {a.get(key, defaults.get(key))!r} -> {b.get(key, defaults.get(key))!r}"
        for key in sorted(set(a) | set(b))
        if a.get(key, defaults.get(key)) != b.get(key, defaults.get(key))
    ]
