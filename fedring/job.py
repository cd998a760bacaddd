"""The job of every task, written once: a :class:`Driver` runs a :class:`Job` step by step.

A task supplies its steps (training: rounds; the conformal tasks: batches of trials) and its
checkpoint state; the :class:`Driver` does the rest, the same way for every task:

- opens the results file on rank 0, or reopens it at the checkpoint ``--resume`` continues
  from (read on rank 0, its verdict and contents broadcast: :func:`fedring.runtime.on_rank0`);
- after each step, agrees on every rank whether a stop signal arrived, checkpoints every
  ``checkpoint_every`` steps and before stopping, and on a stop marks the file ``preempted``
  and returns exit code 75 (:data:`fedring.runtime.EXIT_PREEMPTED`);
- at the end lets the job write its final data, marks the file ``complete`` and names it.

What rank 0 writes and prints goes through a :class:`Recorder`; every other rank holds a
:class:`NullRecorder`, which does nothing, so a job's step records unconditionally and the
loop has no rank branches. The recorder also hands each entry to the experiment trackers of
``log`` (:mod:`fedring.tracking`), once it is in the file. The watchdog marks the file
``failed`` or ``preempted`` through the recorder if the job is aborted (:mod:`fedring.runtime`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Protocol

import h5py
import numpy as np
from mpi4py import MPI

from .config import Config
from .errors import ResultsError
from .results import Entry, FileStatus, ResultsFile, resume_point
from .runtime import EXIT_PREEMPTED, Progress, Watchdog, on_rank0
from .tracking import Tracker, open_trackers, scalars


class Job(Protocol):
    """What a task supplies to the :class:`Driver`."""

    #: what one step is called in progress lines and the stop message ("round", "trial")
    unit: str

    @property
    def total(self) -> int:
        """Steps of the whole run."""

    #: steps between checkpoints (and one before stopping)
    checkpoint_every: int
    #: prefixes of the checkpoint arrays that :meth:`restore` reads for this rank itself (rows of
    #: every client, too large to pass through rank 0); the others are read on rank 0 and broadcast
    per_rank: tuple[str, ...]

    def file_attrs(self) -> dict:
        """Root attributes of a new results file beyond those of every task (``n_clients`` ...)."""

    def begin(self, recorder: Recorder) -> None:
        """Write what a new file holds once, before its first step (the Byzantine clients ...)."""

    def restore(self, arrays: dict[str, np.ndarray], attrs: dict) -> None:
        """Continue from a stored checkpoint (``--resume``; not called for a fresh run)."""

    def step(self, done: int, recorder: Recorder) -> int:
        """Collective: run the step(s) after ``done`` completed ones, record them, return the new count."""

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        """Collective: the state a resumed run needs, on rank 0: arrays, and attributes beyond
        ``round`` and ``wall_seconds``."""

    def finish(self, recorder: Recorder) -> None:
        """Collective: write the run's final data and print its summary, after the last step."""


class Recorder:
    """Rank 0's side of a job: the results file, its trackers, progress lines, messages."""

    def __init__(self, results: ResultsFile, progress: Progress, quiet: bool):
        self.results, self.progress, self.quiet = results, progress, quiet
        self.trackers: list[Tracker] = []

    @classmethod
    def open(
        cls, job: Job, cfg: Config, world_size: int, done: int, progress: Progress, first: tuple[dict, dict] | None
    ) -> Recorder:
        """A new results file with its header and ``first``, the checkpoint of step 0, or the
        resumed one cut at ``done``; then the trackers of ``cfg.log``."""
        if cfg.resume:
            assert cfg.out is not None, "the task's checks name the results file"
            results = ResultsFile.reopen(cfg.out, done)
            results.h5.attrs["world_size"] = world_size
            recorder = cls(results, progress, cfg.quiet)
        else:
            recorder = cls(ResultsFile.create(cfg, world_size, job.file_attrs()), progress, cfg.quiet)
            job.begin(recorder)
            if first is not None:  # a run that dies before its first checkpoint still resumes
                arrays, attrs = first
                recorder.results.write_checkpoint(arrays, {"round": 0, **attrs, "wall_seconds": 0.0})
        try:
            open_trackers(cfg, recorder.results, done, recorder.trackers)
        except BaseException:  # the watchdog does not know this recorder yet: the file is marked here
            with contextlib.suppress(ResultsError):  # a tracker that fails to close too: the first error tells
                recorder.close(FileStatus.FAILED)
            raise
        return recorder

    def record(self, entries: Iterable[Entry]) -> None:
        """Append ``entries``, each then handed to the trackers and printed as its progress line.

        Rank 0 alone reads ``entries``: a job passes a lazy iterable (a generator), which formats
        figures that only rank 0 holds (what :meth:`fedring.comm.Network.gather_ledger` gathers,
        the server's choices) as it is read, so the other ranks' :class:`NullRecorder` never runs it.
        """
        for entry in entries:
            self.results.append_round(entry.metrics, entry.rows, rounds_completed=entry.done)
            if self.trackers:
                values = scalars(entry)
                for tracker in self.trackers:
                    tracker.log(entry.done, values)
            if entry.line is not None:
                self.progress.line(entry.done, entry.line)

    def write(self, name: str, data) -> None:
        self.results.write(name, data)

    def attrs(self, group: str, values: dict) -> None:
        """Set attributes of ``/group`` (created if missing)."""
        self.results.set_attrs(group, values)

    def elapsed(self) -> float:
        """Seconds the run has taken so far, resumed parts included."""
        return self.progress.elapsed()

    def checkpoint(self, done: int, arrays: dict[str, np.ndarray], attrs: dict) -> None:
        self.results.write_checkpoint(arrays, {"round": done, **attrs, "wall_seconds": self.progress.elapsed()})

    def summarize(self, group: str, summary: Callable[[dict[str, np.ndarray]], str]) -> None:
        """Print ``summary`` of every dataset of ``/group`` as stored (a resumed run prints the same)."""
        print(
            summary({name: ds[()] for name, ds in self.results.h5[group].items() if isinstance(ds, h5py.Dataset)}),
            flush=True,
        )

    def say(self, text: str, always: bool = False) -> None:
        """A message on stdout (unless quiet, or ``always``)."""
        if always or not self.quiet:
            print(text, file=sys.stdout, flush=True)

    def close(self, status: FileStatus) -> None:
        """Mark and close the file first (the watchdog's abort waits only so long), then end the
        trackers' runs; raises the first tracker's failure once every one was closed."""
        self.results.close(status)
        failures: list[ResultsError] = []
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except ResultsError as e:
                failures.append(e)
        if failures:
            raise failures[0]


class NullRecorder(Recorder):
    """The recorder of every rank but 0: records nothing, prints nothing."""

    def __init__(self):
        pass

    def record(self, entries):
        pass

    def write(self, name, data):
        pass

    def attrs(self, group, values):
        pass

    def elapsed(self):
        return 0.0

    def checkpoint(self, done, arrays, attrs):
        pass

    def summarize(self, group, summary):
        pass

    def say(self, text, always=False):
        pass

    def close(self, status):
        pass


class Driver:
    """A job ready to run on every rank: :meth:`run` drives it (a task's ``prepare`` returns one).

    With ``--resume`` the stored checkpoint is read here, during the task's preparation, so a
    file that cannot be resumed is a settings error agreed on every rank before any work.
    """

    def __init__(self, job: Job, cfg: Config, comm: MPI.Comm):
        self.job, self.cfg, self.comm = job, cfg, comm
        self.done, self.stored = 0, {}
        if cfg.resume:
            arrays, self.stored = on_rank0(comm, lambda: resume_point(cfg, skip=job.per_rank))
            job.restore(arrays, self.stored)
            self.done = int(self.stored["round"])

    def run(self, watchdog: Watchdog) -> int:
        """Collective: run the job to its end or a stop signal; rank 0 writes ``cfg.out``. Returns the exit code."""
        job, cfg, comm, done = self.job, self.cfg, self.comm, self.done
        progress = Progress(
            job.unit, job.total, cfg.quiet or comm.rank != 0, self.stored.get("wall_seconds", 0.0), done
        )
        first = None if cfg.resume else job.checkpoint()  # collective
        recorder = Recorder.open(job, cfg, comm.size, done, progress, first) if comm.rank == 0 else NullRecorder()
        watchdog.on_abort.append(recorder.close)
        while done < job.total:
            done = job.step(done, recorder)
            stopping = watchdog.stop_requested() and done < job.total
            if done % job.checkpoint_every == 0 or stopping:
                recorder.checkpoint(done, *job.checkpoint())
            if stopping:
                recorder.close(FileStatus.PREEMPTED)
                recorder.say(
                    f"stopped by signal after {job.unit} {done}; resume with --resume (results: {cfg.out})", always=True
                )
                return EXIT_PREEMPTED
        job.finish(recorder)
        recorder.close(FileStatus.COMPLETE)
        recorder.say(f"results: {cfg.out}")
        return 0
