"""What a run does: the tasks, registered like every other component (``task = "train"`` ...).

:func:`make_task` checks the settings every task has and builds the run's task, which reads
and checks its own settings once (training's top-level keys, or its section ``[prism]``,
``[labelshift]``), names its default results file, prints one banner line, and prepares a
:class:`fedring.job.Driver` on every rank; the driver's ``run(watchdog)`` writes the results
file and returns the exit code. :func:`fedring.cli.run.run` drives every task the same way:
settings errors agreed on every rank (exit 2), then the job under the
:class:`~fedring.runtime.Watchdog`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from mpi4py import MPI

from . import plugins, tracking, validate
from .config import DEFAULTS, FIELDS, GENERAL, Config
from .errors import ConfigError
from .registry import Registry

if TYPE_CHECKING:
    from .job import Driver

TASKS = Registry("task")


@TASKS.base
class Task:
    """Base of the tasks: a run's task, built from its config once the settings are known.

    ``__init__`` reads and checks the task's settings, once (a bad one raises ConfigError),
    and fills the derived defaults into ``cfg``; the methods use what it read.
    """

    name = ""
    params: tuple[str, ...] = ()

    def __init__(self, cfg: Config, world_size: int):
        self.cfg = cfg

    def default_out(self) -> str:
        raise NotImplementedError

    def steps(self) -> tuple[int, str]:
        """How many steps the run has and what they are (``(300, "rounds")``, ``(100, "trials")``)."""
        raise NotImplementedError

    def banner(self, world_size: int) -> str:
        """One line saying what runs (printed by rank 0 before any work)."""
        raise NotImplementedError

    def prepare(self, comm: MPI.Comm) -> Driver:
        """Collective: load data, build the job (ConfigError here is still agreed on every rank)."""
        raise NotImplementedError


def make_task(cfg: Config, world_size: int) -> Task:
    """Check every setting for ``world_size`` ranks; fills derived defaults (``clients``, ``out``); the run's task.

    The user's plugins are imported first (:mod:`fedring.plugins`), so that their components are known.
    """
    if cfg.resume and not cfg.plugins and cfg.out and Path(cfg.out).is_file():
        cfg.plugins = plugins.stored(cfg.out)  # the modules the run was started with
    plugins.load_entry_points()
    plugins.load(cfg.plugins)
    validate.integer("seed", cfg.seed, lo=0)
    validate.real("stop_grace", cfg.stop_grace, lo=0, lo_open=True)
    tracking.require(cfg)
    if cfg.task != "train":
        for key in FIELDS:
            if key not in GENERAL and getattr(cfg, key) != getattr(DEFAULTS, key):
                raise ConfigError(
                    key,
                    f"a training setting: task {cfg.task} takes its settings in the section "
                    f"[{cfg.task}] (python -m fedring conformal {cfg.task} --help lists them)",
                )
    task = TASKS.get(cfg.task, "task")(cfg, world_size)
    if cfg.out is None:
        cfg.out = task.default_out()
    if cfg.resume and cfg.overwrite:
        raise ConfigError("resume", "--resume continues the file that --overwrite would replace: give one of them")
    if cfg.resume and not Path(cfg.out).exists():
        raise ConfigError("resume", f"nothing to resume: {cfg.out} does not exist")
    if Path(cfg.out).exists() and not (cfg.overwrite or cfg.resume):
        raise ConfigError(
            "out", f"{cfg.out} exists; pass --overwrite to replace it, --resume to continue it, or choose another --out"
        )
    return task


def _register_all() -> None:
    """Import the task modules (each registers its task); the conformal ones import no torch."""
    for module in ("fedring.train.task", "fedring.conformal.prism.task", "fedring.conformal.labelshift.task"):
        importlib.import_module(module)


_register_all()
