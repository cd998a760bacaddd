"""The job of a conformal task: independent trials, each one row of the results file.

Every random draw of trial ``t`` is keyed by ``t`` (:mod:`fedring.rng`), so trials are
independent of each other and of how they are batched or spread over ranks. After each batch
of trials, rank 0 appends one row per trial to ``/calibration`` (and the protocol bytes to
``/comm``), flushes and checkpoints the number of trials done (:class:`fedring.job.Driver`); ``--resume`` continues with the
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
from collections.abc import Iterator
from typing import TYPE_CHECKING

import h5py
import numpy as np
from mpi4py import MPI

from fedring.comm import Network
from fedring.config import Config
from fedring.job import Recorder
from fedring.names import BYTES_SENT, CALIBRATION, CALIBRATION_TRIAL, SERVER_BYTES_SENT
from fedring.results import Entry

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # what dataclasses.asdict takes


class TrialJob:
    """Base of the conformal tasks' jobs (a :class:`fedring.job.Job`: one step is a batch of trials).

    A subclass sets ``cases`` (one dict per case: ``label``, ``method`` and what tells the
    case apart), ``size_kind``, ``alpha``, ``settings`` (the task's settings dataclass),
    ``trials`` (how many) and ``batch`` (trials solved together), and implements:

    - ``run_batch(trials)``: collective; on rank 0 one dict per trial, ``{field: array whose
      first axis is the cases}`` with at least ``coverage``, ``size`` and ``threshold``;
    - ``describe(row)``: the progress line of one trial (rank 0);
    - ``summary(rows)``: the table printed at the end, from ``{field: (trials, cases, ...)}``.
    """

    unit = "trial"
    checkpoint_every = 1  # every batch
    per_rank: tuple[str, ...] = ()  # every array is read on rank 0
    cases: list[dict]
    size_kind: str
    alpha: float
    settings: DataclassInstance
    trials: int
    batch: int = 1

    def __init__(self, cfg: Config, comm: MPI.Comm, net: Network):
        self.cfg, self.comm, self.net = cfg, comm, net

    @property
    def total(self) -> int:
        return self.trials

    def run_batch(self, trials: list[int]) -> list[dict] | None:
        raise NotImplementedError

    def describe(self, row: dict) -> str:
        raise NotImplementedError

    def summary(self, rows: dict[str, np.ndarray]) -> str:
        raise NotImplementedError

    def file_attrs(self) -> dict:
        return {"n_clients": self.net.n_clients}

    def begin(self, recorder: Recorder) -> None:
        recorder.attrs(
            CALIBRATION,
            {
                "cases": json.dumps(self.cases),
                "size_kind": self.size_kind,
                "alpha": self.alpha,
                "settings": json.dumps(dataclasses.asdict(self.settings), sort_keys=True),
            },
        )

    def restore(self, arrays: dict[str, np.ndarray], attrs: dict) -> None:
        """Nothing to restore: trial ``t`` depends on ``t`` alone."""

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        return {}, {}

    def step(self, done: int, recorder: Recorder) -> int:
        batch = list(range(done, min(done + self.batch, self.trials)))
        self.net.ledger.reset()
        rows = self.run_batch(batch)
        client_bytes, server_bytes = self.net.gather_ledger()
        recorder.record(self.entries(batch, rows, client_bytes, server_bytes))
        return batch[-1] + 1

    def entries(
        self, batch: list[int], rows: list[dict] | None, client_bytes: np.ndarray | None, server_bytes: int
    ) -> Iterator[Entry]:
        """Rank 0 (a generator: it runs where the recorder reads it, so the rows and bytes gathered on
        rank 0 alone are there): one ``/calibration`` row per trial of ``batch``, the batch's bytes
        shared equally."""
        assert rows is not None and client_bytes is not None, "rank 0 holds the gathered rows"
        yield from (
            Entry(
                t + 1,
                {},
                {
                    CALIBRATION_TRIAL: np.int64(t),
                    **{f"{CALIBRATION}/{k}": v for k, v in row.items()},
                    BYTES_SENT: client_bytes // len(batch),
                    SERVER_BYTES_SENT: np.int64(server_bytes // len(batch)),
                },
                self.describe(row),
            )
            for t, row in zip(batch, rows)
        )

    def finish(self, recorder: Recorder) -> None:
        recorder.summarize(CALIBRATION, self.summary)


def read_calibration(path) -> tuple[dict, dict[str, np.ndarray]]:
    """A conformal results file's ``/calibration``: (attrs with ``cases`` and ``settings`` decoded, rows)."""
    with h5py.File(path, "r") as f:
        group = f[CALIBRATION]
        attrs = dict(group.attrs)
        for key in ("cases", "settings"):
            attrs[key] = json.loads(attrs[key])
        return attrs, {name: ds[()] for name, ds in group.items()}
