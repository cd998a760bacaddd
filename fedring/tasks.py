"""What a run does: the tasks, registered like every other component (``task = "train"`` ...).

A task validates its settings (training's top-level keys, or its own section ``[prism]``,
``[labelshift]``), names its default results file, prints one banner line, and prepares a
job on every rank; the job's ``run(watchdog)`` writes the results file and returns the exit
code. :func:`fedring.cli.run.run` drives every task the same way: settings errors agreed on
every rank (exit 2), then the job under the :class:`~fedring.runtime.Watchdog`.
"""

from __future__ import annotations

import importlib

from mpi4py import MPI

from .config import Config
from .registry import Registry

TASKS = Registry("task")


@TASKS.base
class Task:
    """Base of the tasks; subclasses set ``name`` and implement the four steps."""

    name = ""
    params: tuple[str, ...] = ()

    @staticmethod
    def validate(cfg: Config, world_size: int) -> None:
        """Raise ConfigError for a bad setting; fill the task's derived defaults into ``cfg``."""
        raise NotImplementedError

    @staticmethod
    def default_out(cfg: Config) -> str:
        raise NotImplementedError

    @staticmethod
    def steps(cfg: Config) -> tuple[int, str]:
        """How many steps the run has and what they are (``(300, "rounds")``, ``(100, "trials")``)."""
        raise NotImplementedError

    @staticmethod
    def banner(cfg: Config, world_size: int) -> str:
        """One line saying what runs (printed by rank 0 before any work)."""
        raise NotImplementedError

    @staticmethod
    def prepare(cfg: Config, comm: MPI.Comm):
        """Collective: load data, build the job (ConfigError here is still agreed on every rank)."""
        raise NotImplementedError


def _register_all() -> None:
    """Import the task modules (each registers its task); the conformal ones import no torch."""
    for module in ("fedring.train.task", "fedring.conformal.prism.task", "fedring.conformal.labelshift.task"):
        importlib.import_module(module)


_register_all()
