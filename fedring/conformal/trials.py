"""The job of a conformal task: independent trials, each one row of the results file.

Every random draw of trial ``t`` is keyed by ``t`` (:mod:`fedring.rng`), so trials are
independent of each other and of how they are batched or spread over ranks. After each batch
of trials, rank 0 appends one row per trial to ``/calibration`` (and the protocol bytes to
``/comm``), flushes and checkpoints the number of trials done; ``--resume`` continues with the
next trial and ends with the same file as an uninterrupted run; a stop signal ends the job
after the current batch (exit 75). The table printed at the end is computed from the rows in
the file, so a resumed run prints the same table.

The ``/calibration`` layout (the same for every conformal method; ``docs/hdf5.md``)::

    /calibration              attrs: cases (JSON list, one dict per case with at least "label"
                              and "method"), size_kind ("interval width" | "set size"), alpha,
                              settings (JSON of the task's resolved settings)
    /calibration/trial        (trials,) the trial index
    /calibration/coverage     (trials, cases) empirical coverage of the trial's test points
    /calibration/size         (trials, cases) mean interval width, or mean prediction-set size
    /calibration/threshold    (trials, cases[, ...]) the conformal threshold(s)
    /calibration/<field>      (trials, cases[, ...]) what else the method measures
    /comm/bytes_sent          (trials, clients) protocol bytes each client sent in the trial
    /comm/server_bytes_sent   (trials,) protocol bytes the server sent in the trial
"""

from __future__ import annotations

import dataclasses
import json
import sys

import h5py
import numpy as np
from mpi4py import MPI

from fedring.comm import Network
from fedring.config import Config
from fedring.results import ResultsFile, resume_point
from fedring.runtime import EXIT_PREEMPTED, Progress, Watchdog, on_rank0


class TrialJob:
    """Base of the conformal tasks' jobs.

    A subclass sets ``cases`` (one dict per case: ``label``, ``method`` and what tells the
    case apart), ``size_kind``, ``alpha``, ``settings`` (the task's settings dataclass),
    ``trials`` (how many) and ``batch`` (trials solved together), and implements:

    - ``run_batch(trials)``: collective; on rank 0 one dict per trial, ``{field: array whose
      first axis is the cases}`` with at least ``coverage``, ``size`` and ``threshold``;
    - ``describe(row)``: the progress line of one trial (rank 0);
    - ``summary(rows)``: the table printed at the end, from ``{field: (trials, cases, ...)}``.
    """

    cases: list[dict]
    size_kind: str
    alpha: float
    settings: object
    trials: int
    batch: int = 1

    def __init__(self, cfg: Config, comm: MPI.Comm, net: Network):
        self.cfg, self.comm, self.net = cfg, comm, net

    def run_batch(self, trials: list[int]) -> list[dict] | None:
        raise NotImplementedError

    def describe(self, row: dict) -> str:
        raise NotImplementedError

    def summary(self, rows: dict[str, np.ndarray]) -> str:
        raise NotImplementedError

    def _open(self, done: int) -> ResultsFile:
        if self.cfg.resume:
            results = ResultsFile.reopen(self.cfg.out, done)
            results.h5.attrs["world_size"] = self.comm.size
            return results
        results = ResultsFile.create(self.cfg, self.comm.size, {"n_clients": self.net.n_clients})
        group = results.h5.require_group("calibration")
        group.attrs["cases"] = json.dumps(self.cases)
        group.attrs["size_kind"] = self.size_kind
        group.attrs["alpha"] = self.alpha
        group.attrs["settings"] = json.dumps(dataclasses.asdict(self.settings), sort_keys=True)
        results.write_checkpoint({}, {"round": 0, "wall_seconds": 0.0})
        return results

    def run(self, watchdog: Watchdog) -> int:
        cfg, rank0 = self.cfg, self.comm.rank == 0
        stored = on_rank0(self.comm, lambda: resume_point(cfg)[1]) if cfg.resume else {"round": 0}
        done = int(stored["round"])
        results = self._open(done) if rank0 else None
        if rank0:
            watchdog.on_abort.append(results.close)
        progress = Progress("trial", self.trials, cfg.quiet or not rank0, stored.get("wall_seconds", 0.0), done)
        while done < self.trials:
            batch = list(range(done, min(done + self.batch, self.trials)))
            self.net.ledger.reset()
            rows = self.run_batch(batch)
            client_bytes, server_bytes = self.net.gather_ledger()
            done = batch[-1] + 1
            if rank0:
                for t, row in zip(batch, rows):
                    results.append_round({}, {
                        "calibration/trial": np.int64(t), **{f"calibration/{k}": v for k, v in row.items()},
                        "comm/bytes_sent": client_bytes // len(batch),
                        "comm/server_bytes_sent": np.int64(server_bytes // len(batch)),
                    }, rounds_completed=t + 1)
                    progress.line(t + 1, self.describe(row))
                results.write_checkpoint({}, {"round": done, "wall_seconds": progress.elapsed()})
            if watchdog.stop_requested() and done < self.trials:
                if rank0:
                    results.close("preempted")
                    print(f"stopped by signal after trial {done}; resume with --resume (results: {cfg.out})", flush=True)
                return EXIT_PREEMPTED
        if rank0:
            stored_rows = {name: ds[()] for name, ds in results.h5["calibration"].items()}
            results.close("complete")
            print(self.summary(stored_rows), flush=True)
            if not cfg.quiet:
                print(f"results: {cfg.out}", file=sys.stdout, flush=True)
        return 0


def read_calibration(path) -> tuple[dict, dict[str, np.ndarray]]:
    """A conformal results file's ``/calibration``: (attrs with ``cases`` and ``settings`` decoded, rows)."""
    with h5py.File(path, "r") as f:
        group = f["calibration"]
        attrs = dict(group.attrs)
        for key in ("cases", "settings"):
            attrs[key] = json.loads(attrs[key])
        return attrs, {name: ds[()] for name, ds in group.items()}
