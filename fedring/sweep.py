"""Sweeps: a TOML grid of run settings, expanded into configs and run as one SLURM array job.

The command is ``python -m fedring sweep GRID.toml [--dry-run | --submit | --local] [--set KEY=VALUE ...]``
(:mod:`fedring.cli.sweep`); this module expands grids, names configs and reads file states.

The grid file
-------------
A grid is a run config file (the keys of ``python -m fedring run --config``) in which any
value may be a list; the sweep is the cartesian product of all lists::

    dataset = "fashion-mnist"
    rounds = 300
    attack = ["none", "labelflip", "gaussian"]   # an axis: 3 values
    seed = [0, 1]                                # another: 3 x 2 = 6 configs
    [krum]
    variant = ["paper", "byzfl"]                 # section parameters are axes too

    # An array of tables is one more axis whose values are groups of settings that go
    # together (its name is only a label). Lists inside a group expand within the group,
    # and a group's settings override the same settings outside it.
    [[defence]]
    topology = "ring"
    aggregator = ["mean", "brace"]
    lr = 0.001
    [[defence]]
    topology = "server"
    aggregator = ["krum", "median"]

    [sweep]                    # how to run it (not a run setting)
    ranks = 4                  # MPI ranks per run (sbatch --ntasks)
    out_dir = "results/demo"   # default: results/<grid file name without .toml>
    time = "02:00:00"          # sbatch --time (optional)
    max_parallel = 8           # at most 8 array tasks at once (optional)
    launcher = "srun"          # srun (--mpi=pmi2) or mpiexec inside the job (optional)
    sbatch = ["--partition=cpu", "--account=me"]   # more sbatch options (optional)

A setting whose value is itself a list (``pre_aggregators``) takes a list of lists as an
axis; to give a section parameter a literal list value, wrap it: ``weights = [[1, 2]]``.
``--set KEY=VALUE`` on the command line replaces a setting everywhere (a list value is an
axis); ``--ranks``, ``--out-dir`` etc. replace ``[sweep]`` entries.

Files
-----
Every config is resolved with fedring's own defaults and validation (a bad value stops the
sweep before anything is submitted) and named by a hash: the first 12 hex digits of the
SHA-256 of the canonical JSON (sorted keys) of its result-changing settings that differ from
fedring's defaults, sections included; run-control settings (``out``, ``resume``,
``checkpoint_every``, ...) are left out. So key order, spelling a default out, or a new
fedring setting with a default never changes a name. The run control a grid sets
(:data:`PASSED_ON`: ``log`` and the trackers' ``tensorboard_dir`` and ``mlflow_uri``,
``checkpoint_every``, ``stop_grace``, ``quiet``) is written into every config file, so every run
gets it; being in no name, it must be the same in every config of a grid. ``out``,
``overwrite`` and ``resume`` are the sweep's own (each run's file is ``<hash>.h5``, and
:func:`plan` resumes or overwrites it): a grid that sets them is refused. Changing a default value in fedring
does not either: a file whose stored config then differs is reported as a conflict, never
silently counted as complete. Under ``out_dir``::

    configs/<hash>.toml    the config (non-default settings), as given to --config
    <hash>.h5              its results
    tasks-<id>.txt         one hash per line: array task i runs line i (id: hash of the list)
    logs/<job>_<task>.out  SLURM output, appended across requeues

``--submit`` submits only configs that are not complete and not being written (HDF5 file
lock held) to ``jobs/sweep.sbatch``; each array task hands its config to
``jobs/run.sbatch``, which asks :func:`plan` what to do: skip a complete file, resume one
with a checkpoint, start afresh otherwise. Submitting the same grid again is therefore
always safe; it picks up whatever did not finish. (A run in progress is recognised by its
HDF5 file lock; with ``HDF5_USE_FILE_LOCKING=FALSE``, as on some parallel file systems, do
not resubmit while the first submission is still running.)
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import (
    FIELDS,
    RUN_CONTROL,
    Config,
    canonical,
    config_differences,
    load_toml,
    merge,
    parse_setting,
    split_key,
)
from .errors import ConfigError
from .results import FileStatus, read_checkpoint
from .tasks import Task, make_task

#: the job scripts and the grids shipped with fedring (the repository's jobs/, installed as package data)
JOBS_DIR = Path(__file__).parent / "jobs"
HASH_DIGITS = 12
LAUNCHERS = ("srun", "mpiexec")
#: run control that a sweep decides for each run: the results file and whether to resume or overwrite it
SWEEP_OWN = ("out", "overwrite", "resume")
#: the other run control (``fedring.config.RUN_CONTROL``): steers a run without changing its
#: results, so it is in no config's name, and a grid's value reaches every run through its config file
PASSED_ON = tuple(key for key in RUN_CONTROL if key not in SWEEP_OWN)


# ---------------------------------------------------------------------------------------------
# Grid expansion
# ---------------------------------------------------------------------------------------------


@dataclass
class SweepSettings:
    """The ``[sweep]`` table: how the configs are run, not what they compute."""

    out_dir: str | None = None
    ranks: int = 1
    time: str | None = None
    max_parallel: int | None = None
    launcher: str | None = None
    sbatch: list[str] = field(default_factory=list)

    def update(self, items: dict[str, Any]) -> None:
        kinds: dict[str, type[Any]] = {
            "out_dir": str,
            "ranks": int,
            "time": str,
            "max_parallel": int,
            "launcher": str,
            "sbatch": list,
        }
        for key, value in items.items():
            if key not in kinds:
                raise ConfigError(f"sweep.{key}", f"unknown; allowed: {', '.join(kinds)}")
            kind = kinds[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"sweep.{key}", f"expected {kind.__name__}, got {value!r}")
            if kind is int and value < 1:
                raise ConfigError(f"sweep.{key}", f"must be >= 1, got {value}")
            if key == "launcher" and value not in LAUNCHERS:
                raise ConfigError("sweep.launcher", f"{value!r} is not allowed; allowed: {', '.join(LAUNCHERS)}")
            if key == "sbatch" and not all(isinstance(a, str) for a in value):
                raise ConfigError("sweep.sbatch", f"expected a list of strings, got {value!r}")
            setattr(self, key, value)


def _is_group_axis(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _axis(key: str, value: Any) -> list[Any]:
    """The values a setting takes: a list is an axis, except a plain value of a list setting."""
    if not isinstance(value, list):
        return [value]
    list_setting = key in FIELDS and FIELDS[key].type == "list"
    if list_setting and not (value and all(isinstance(v, list) for v in value)):
        return [value]
    if not value:
        raise ConfigError(key, "an empty list gives no value to sweep over")
    return value


def expand(table: dict[str, Any]) -> list[dict[str, Any]]:
    """All combinations of a grid table, as ``{setting: value}`` dicts (``section.key`` for sections).

    Plain settings vary slowest-first in file order; the groups of each array of tables are
    applied on top, so a group's settings override the same settings outside it.

    >>> expand({"a": [1, 2], "g": [{"b": 0}, {"b": [5, 6], "a": 9}]})
    [{'a': 1, 'b': 0}, {'a': 9, 'b': 5}, {'a': 9, 'b': 6}, {'a': 2, 'b': 0}, {'a': 9, 'b': 5}, {'a': 9, 'b': 6}]
    """
    plain: list[tuple[str, list[Any]]] = []
    groups: list[list[dict[str, Any]]] = []
    for key, value in table.items():
        if _is_group_axis(value):
            groups.append([combo for group in value for combo in expand(group)])
        elif isinstance(value, dict) and key in FIELDS:
            raise ConfigError(
                key, f'is a setting, not a section: give its parameters as quoted keys, e.g. "{key}.name" = value'
            )
        elif isinstance(value, dict):
            plain.extend((f"{key}.{name}", _axis(f"{key}.{name}", v)) for name, v in value.items())
        else:
            plain.append((key, _axis(key, value)))
    keys = [key for key, _ in plain]
    combos = []
    for values in itertools.product(*(options for _, options in plain)):
        for picks in itertools.product(*groups):
            combo = dict(zip(keys, values))
            for pick in picks:
                combo.update(pick)
            combos.append(combo)
    return combos


def resolve(settings: dict[str, Any], ranks: int, origin: str) -> Config:
    """A config from grid settings, with fedring's defaults and validation for ``ranks`` ranks."""
    top = {k: v for k, v in settings.items() if "." not in k}
    cfg = merge(Config(), top, origin)
    for key, value in settings.items():  # section.key: values may themselves be tables
        if key not in top:
            section, name = split_key(key)
            cfg.sections.setdefault(section, {})[name] = value
    cfg.clients = task_of(cfg, ranks).cfg.clients
    return cfg


def task_of(cfg: Config, ranks: int) -> Task:
    """The task of ``cfg`` on ``ranks`` ranks, its settings checked on a copy (files are not checked)."""
    probe = copy.deepcopy(cfg)
    probe.out, probe.overwrite, probe.resume = os.devnull, True, False
    return make_task(probe, ranks)


def config_hash(cfg: Config) -> str:
    """Stable name of a config: independent of key order and of how defaults were spelled."""
    text = json.dumps(canonical(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_DIGITS]


@dataclass
class Sweep:
    grid: Path
    settings: SweepSettings
    configs: list[Config]
    hashes: list[str]

    @property
    def out_dir(self) -> Path:
        return Path(self.settings.out_dir or f"results/{self.grid.stem}")

    def config_path(self, h: str) -> Path:
        return self.out_dir / "configs" / f"{h}.toml"

    def results_path(self, h: str) -> Path:
        return self.out_dir / f"{h}.h5"

    def varying(self) -> list[str]:
        """Settings that differ between configs: fedring's order, then section keys."""
        rows = [canonical(c) for c in self.configs]
        flat = [
            {
                **{k: v for k, v in r.items() if k != "sections"},
                **{f"{s}.{k}": v for s, t in r.get("sections", {}).items() for k, v in t.items()},
            }
            for r in rows
        ]
        seen = {k for r in flat for k in r}
        keys = [k for k in FIELDS if k in seen] + sorted(seen - FIELDS.keys())
        return [k for k in keys if len({json.dumps(r.get(k), sort_keys=True) for r in flat}) > 1]


def load_sweep(grid: str | Path, overrides: Sequence[str] = (), sweep_overrides: dict[str, Any] | None = None) -> Sweep:
    """Read, expand and resolve a grid; ``overrides`` are ``KEY=VALUE`` strings applied last.

    A grid that is not a file here but is the name of a shipped grid (``table2.toml``) is that one.
    """
    grid = Path(grid)
    if not grid.exists() and (JOBS_DIR / grid.name).is_file():
        grid = JOBS_DIR / grid.name
    table = load_toml(str(grid))
    settings = SweepSettings()
    sweep_table = table.pop("sweep", {})
    if not isinstance(sweep_table, dict):
        raise ConfigError("sweep", "must be a table ([sweep])")
    settings.update(sweep_table)
    settings.update({k: v for k, v in (sweep_overrides or {}).items() if v is not None})
    extra: dict[str, Any] = {}
    for item in overrides:
        extra.update(parse_setting(item))
    configs: list[Config] = []
    hashes: list[str] = []
    for base in expand(table):
        for over in expand(extra):
            combo = {**base, **over}
            own = [key for key in SWEEP_OWN if key in combo]
            if own:
                raise ConfigError(
                    own[0],
                    f"a sweep sets it for each run (results in <out_dir>/<hash>.h5, resumed or started afresh "
                    f"as their state says): leave it out of {grid.name} (set [sweep] out_dir)",
                )
            try:
                cfg = resolve(combo, settings.ranks, str(grid))
            except ConfigError as e:
                shown = ", ".join(f"{k}={v!r}" for k, v in combo.items())
                raise ConfigError(e.key, f"{e.message} (in the config {shown})") from None
            if configs:
                _same_run_control(configs[0], cfg)
            h = config_hash(cfg)
            if h not in hashes:  # two spellings of one config run once
                configs.append(cfg)
                hashes.append(h)
    if not configs:
        raise ConfigError("grid", f"{grid} expands to no config")
    return Sweep(grid, settings, configs, hashes)


def _same_run_control(first: Config, cfg: Config) -> None:
    """Refuse run control that differs between two configs of a grid: it is in neither name, so the
    two would share one results file (or one of them be dropped as a second spelling)."""
    for key in PASSED_ON:
        a, b = getattr(first, key), getattr(cfg, key)
        if a != b:
            raise ConfigError(
                key,
                f"is run control, passed to every run of a sweep alike and in no config's name, so it cannot "
                f"differ between configs: {a!r} and {b!r} (run two sweeps, with two out_dir)",
            )


# ---------------------------------------------------------------------------------------------
# Config files (TOML writer for the values a config holds)
# ---------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def config_toml(cfg: Config) -> str:
    """The config's non-default settings as a ``--config`` file: those that name it, then its run
    control (:data:`PASSED_ON`) that differs from the defaults."""
    settings = canonical(cfg)
    sections = settings.pop("sections", {})
    defaults = Config()
    control = {key: getattr(cfg, key) for key in PASSED_ON if getattr(cfg, key) != getattr(defaults, key)}
    lines = [f"# fedring config {config_hash(cfg)}"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in {**settings, **control}.items()]
    # A section named like a setting (attack = "x" and attack.sigma) cannot be a TOML table.
    lines += [
        f"{_toml_key(f'{name}.{k}')} = {_toml_value(v)}"
        for name, t in sections.items()
        if name in FIELDS
        for k, v in t.items()
    ]
    for name, table in sections.items():
        if name not in FIELDS:
            lines += ["", f"[{_toml_key(name)}]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# State of a results file
# ---------------------------------------------------------------------------------------------


@dataclass
class FileState:
    """``missing``, ``live`` (another process holds the HDF5 write lock), ``unreadable``, or the
    stored ``status`` (``complete``, ``preempted``, ``failed``, ``running`` = its writer died)."""

    kind: str
    config: dict | None = None
    checkpoint: bool = False
    rounds_completed: int = 0
    detail: str = ""


def file_state(path: str | Path) -> FileState:
    import h5py

    path = Path(path)
    if not path.exists():
        return FileState("missing")
    try:
        with h5py.File(path, "r") as f:
            attrs = f.attrs
            status = attrs.get("status", "unknown")
            config = json.loads(attrs["config"]) if "config" in attrs else None
            return FileState(str(status), config, read_checkpoint(f) is not None, int(attrs.get("rounds_completed", 0)))
    except BlockingIOError:
        return FileState("live", detail="another process holds its HDF5 file lock")
    except (OSError, ValueError, KeyError) as e:
        return FileState("unreadable", detail=f"{type(e).__name__}: {e}")


def differences(stored: dict, cfg: Config) -> list[str]:
    """``key: stored -> current`` for result-changing settings that differ (see config_differences)."""
    return config_differences(stored, dataclasses.asdict(cfg))


# ---------------------------------------------------------------------------------------------
# Dry run, submission, local runs
# ---------------------------------------------------------------------------------------------


def states(sweep: Sweep) -> list[tuple[str, str]]:
    """(state, note) of every config's results file; a differing stored config is ``conflict``."""
    out = []
    for cfg, h in zip(sweep.configs, sweep.hashes):
        st = file_state(sweep.results_path(h))
        diff = differences(st.config, cfg) if st.config is not None else []
        if diff:
            out.append(("conflict", "; ".join(diff)))
        elif st.kind in (FileStatus.PREEMPTED, FileStatus.FAILED, FileStatus.RUNNING):
            total, unit = task_of(cfg, sweep.settings.ranks).steps()
            out.append((st.kind, f"{st.rounds_completed}/{total} {unit}" + (", checkpoint" if st.checkpoint else "")))
        else:
            out.append((st.kind, st.detail))
    return out


def write_configs(sweep: Sweep) -> None:
    (sweep.out_dir / "configs").mkdir(parents=True, exist_ok=True)
    for cfg, h in zip(sweep.configs, sweep.hashes):
        path = sweep.config_path(h)
        text = config_toml(cfg)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def tasks_file(sweep: Sweep, pending: list[int], write: bool = False) -> Path:
    text = "".join(f"{sweep.hashes[i]}\n" for i in pending)
    path = sweep.out_dir / f"tasks-{hashlib.sha256(text.encode()).hexdigest()[:8]}.txt"
    if write and not path.exists():  # content-addressed: running jobs may be reading it
        path.write_text(text)
    return path


def sbatch_command(sweep: Sweep, tasks: Path, n_tasks: int, jobs_dir: Path) -> list[str]:
    s = sweep.settings
    array = f"0-{n_tasks - 1}" + (f"%{s.max_parallel}" if s.max_parallel else "")
    cmd = [
        "sbatch",
        "--parsable",
        f"--array={array}",
        f"--ntasks={s.ranks}",
        f"--job-name=fedring-{sweep.grid.stem}",
        f"--output={(sweep.out_dir / 'logs').resolve()}/%A_%a.out",
    ]
    if s.time:
        cmd.append(f"--time={s.time}")
    cmd += s.sbatch
    return [*cmd, str(jobs_dir / "sweep.sbatch"), str(tasks.resolve()), str(jobs_dir / "run.sbatch")]
