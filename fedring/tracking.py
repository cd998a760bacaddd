"""Experiment trackers: rank 0 also logs what it appends to the results file to TensorBoard or MLflow.

``log = ["tensorboard", "mlflow"]`` (``--log tensorboard,mlflow``) opens one tracker of each kind
named on rank 0 when the results file opens; the :class:`fedring.job.Recorder` then passes every
entry it has appended to the file (one per round, or per trial) to each tracker, as the scalars
of :func:`scalars`, at step ``Entry.done``. The trackers are the recorder's sinks, so every task
logs alike. Each is an optional extra (``pip install 'fedring[tensorboard]'``, ``[mlflow]``):
:func:`check` refuses a tracker whose packages are missing on every rank, before any work.

- **TensorBoard** (:class:`TensorBoard`): event files in ``<tensorboard_dir>/<stem>``, ``stem``
  being the results file's (``<stem>-2`` ... where that folder exists: a new run never writes
  into an earlier one's); the settings as hyperparameters (the HPARAMS tab). Written with the
  ``tensorboard`` package's own event writer, which imports neither TensorFlow nor torch.
- **MLflow** (:class:`MLflow`): a run named ``stem`` in the experiment ``$MLFLOW_EXPERIMENT_NAME``
  (default ``fedring``) at ``mlflow_uri`` (default ``$MLFLOW_TRACKING_URI``, else MLflow's own
  default, ``sqlite:///mlflow.db`` in the working directory); the settings as its parameters;
  its status ``FINISHED``, ``KILLED`` (stopped by a signal) or ``FAILED`` as the file's.

``--resume`` goes on with the same TensorBoard folder and MLflow run: their names are root
attributes of the results file (``tensorboard_dir``, ``mlflow_run_id``, ``mlflow_tracking_uri``).
A resumed run recomputes the steps after its checkpoint; each tracker, asked for the last step it
has, logs only those after it, so each step is logged once, whatever ended the run before (a
signal, a crash, ``kill -9``, a write of one tracker that failed).

A tracker that cannot write (a full disk, a tracking server gone) ends the run as a results file
that cannot be written does: one message (:class:`fedring.errors.ResultsError`), exit code 1, the
file marked ``failed`` with every step so far, ``--resume`` to continue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from . import validate
from .config import FIELDS, GENERAL, RUN_CONTROL, Config
from .errors import ConfigError, ResultsError
from .names import BYTES_SENT, CALIBRATION, CALIBRATION_TRIAL, COHORT, METRICS, NONFINITE, RING
from .results import Entry, FileStatus, ResultsFile

#: per-client rows whose sum over the clients is a figure of the step, logged as ``<name>/sum``
#: (bytes sent, non-finite uploads, cohort size, convictions); the other per-client rows are not logged
SUMMED = (BYTES_SENT, NONFINITE, COHORT, f"{RING}/detections")


def scalars(entry: Entry) -> dict[str, float]:
    """What the trackers log of ``entry``, by name (its path in the results file, without the ``/``).

    Every metric (``metrics/<name>``) but ``round``, which is the step; every 0-d row; the sum
    of each row of :data:`SUMMED` (``<name>/sum``); one value per case of each ``(cases,)`` row
    of ``/calibration`` (``calibration/<field>/<case index>``). ``calibration/trial`` (the step
    less one) and every other array are left out.

    Examples
    --------
    >>> from fedring.results import Entry
    >>> rows = {"comm/bytes_sent": np.array([3, 4]), "comm/server_bytes_sent": np.int64(5),
    ...         "aggregation/selected": np.array([1.0, 0.0]), "calibration/coverage": np.array([0.5, 1.0])}
    >>> scalars(Entry(2, {"round": 2, "test_accuracy": 0.25}, rows))
    ... # doctest: +NORMALIZE_WHITESPACE
    {'metrics/test_accuracy': 0.25, 'comm/bytes_sent/sum': 7.0, 'comm/server_bytes_sent': 5.0,
     'calibration/coverage/0': 0.5, 'calibration/coverage/1': 1.0}
    """
    out = {f"{METRICS}/{name}": float(value) for name, value in entry.metrics.items() if name != "round"}
    for name, row in entry.rows.items():
        value = np.asarray(row)
        if name == CALIBRATION_TRIAL:
            continue
        if value.ndim == 0:
            out[name] = float(value)
        elif name in SUMMED:
            out[f"{name}/sum"] = float(value.sum())
        elif name.startswith(f"{CALIBRATION}/") and value.ndim == 1:
            out.update({f"{name}/{case}": float(v) for case, v in enumerate(value)})
    return out


def parameters(cfg: Config) -> dict[str, bool | int | float | str]:
    """The run's settings as the trackers' parameters: the top-level settings of its task (every
    one for training, the general ones for the others) but the run-control ones, then each
    section's as ``section.key``. A value that is not a bool, number or string (a list, an
    unset optional setting) is its JSON text, and so is every value of an optional setting, so
    that a parameter has one type in every run.

    >>> parameters(Config(task="prism", sections={"prism": {"trials": 5}}))
    {'task': 'prism', 'plugins': '[]', 'seed': 0, 'prism.trials': 5}
    """
    values = dataclasses.asdict(cfg)
    out: dict[str, Any] = {
        key: values[key] if str(FIELDS[key].type) in ("bool", "int", "float", "str") else json.dumps(values[key])
        for key in FIELDS
        if key not in RUN_CONTROL and (cfg.task == "train" or key in GENERAL)
    }
    for section, table in sorted(cfg.sections.items()):
        for key, value in sorted(table.items()):
            out[f"{section}.{key}"] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out


class Tracker(Protocol):
    """One tracker of a run, open on rank 0 (the :class:`fedring.job.Recorder`'s sink)."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` (:func:`scalars`) at ``step``, unless the tracker has it from before a resume."""

    def close(self, status: FileStatus) -> None:
        """End the run as ``status`` (the results file's); does nothing after the first call or a failed write."""


def failed(tracker: str, where: str, error: Exception) -> ResultsError:
    """The one-line error of a tracker that could not write to ``where``."""
    why = " ".join(str(error).split()) or type(error).__name__
    return ResultsError(
        f"{tracker}: could not write to {where} ({why}); the results file keeps every step so far: "
        "--resume continues the run and its log"
    )


class TensorBoard:
    """Event files in one folder per run (``tensorboard --logdir <tensorboard_dir>`` shows them).

    Scalars are stored as float32 (TensorBoard's ``simple_value``). Every step is flushed, as the
    results file is, so a killed job's folder has every step logged.
    """

    name = "tensorboard"
    #: what the extra installs (checked before any work)
    modules = ("tensorboard",)
    #: the root attribute of the results file that names the folder
    ATTR = "tensorboard_dir"

    def __init__(self, folder: Path, after: int, params: dict[str, bool | int | float | str] | None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.folder, self.after, self.done = folder, after, False
        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        try:
            self.writer = EventFileWriter(str(folder))
            if params is not None:
                self.writer.add_event(self.event(wall_time=time.time(), summary=summary_v2.hparams_pb(params)))
                self.writer.flush()
        except Exception as e:
            raise failed(self.name, str(folder), e) from e

    @classmethod
    def open(cls, cfg: Config, results: ResultsFile, done: int) -> TensorBoard:
        """The folder the results file names (a resumed run), else a new one, named in the file."""
        stored = results.h5.attrs.get(cls.ATTR)
        if stored is not None:
            folder = Path(stored)
            try:
                last = cls.last_step(folder)
            except Exception as e:
                raise failed(cls.name, stored, e) from e
            return cls(folder, last, None)
        try:
            folder = new_folder(Path(cfg.tensorboard_dir), results.path.stem).resolve()
        except OSError as e:
            raise failed(cls.name, cfg.tensorboard_dir, e) from e
        tracker = cls(folder, done, parameters(cfg))
        results.set_attrs("/", {cls.ATTR: str(folder)})
        return tracker

    @staticmethod
    def last_step(folder: Path) -> int:
        """The last step of the event files in ``folder`` (0: none), read with TensorBoard's own loader."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        files = sorted(folder.glob("events.out.tfevents.*"))
        return max((event.step for path in files for event in EventFileLoader(str(path)).Load()), default=0)

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.after:
            return
        value = self.summary.Value
        try:
            self.writer.add_event(
                self.event(
                    wall_time=time.time(),
                    step=step,
                    summary=self.summary(value=[value(tag=tag, simple_value=v) for tag, v in values.items()]),
                )
            )
            self.writer.flush()
        except Exception as e:
            self.done = True
            raise failed(self.name, str(self.folder), e) from e

    def close(self, status: FileStatus) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.writer.close()
        except Exception as e:
            raise failed(self.name, str(self.folder), e) from e


def new_folder(root: Path, stem: str) -> Path:
    """``root/stem``, created, or ``root/stem-2`` ... where it exists."""
    folder, n = root / stem, 1
    while True:
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            n += 1
            folder = root / f"{stem}-{n}"


class MLflow:
    """A run of an MLflow tracking store, through :class:`mlflow.tracking.MlflowClient` (no global
    state: several runs may share a process). Metrics are float64, as in the results file."""

    name = "mlflow"
    #: what the extra installs: the client, and what its default local store (SQLite) needs
    modules = ("mlflow", "sqlalchemy", "alembic")
    #: the root attributes of the results file that name the run
    RUN_ID, URI = "mlflow_run_id", "mlflow_tracking_uri"
    #: MLflow's run status for a results file's
    STATUS: ClassVar[dict[FileStatus, str]] = {
        FileStatus.COMPLETE: "FINISHED",
        FileStatus.PREEMPTED: "KILLED",
        FileStatus.FAILED: "FAILED",
    }
    #: MLflow takes at most this many metrics, and a tenth as many parameters, in one call
    BATCH = 1000

    def __init__(self, client, run_id: str, uri: str, after: int):
        self.client, self.run_id, self.uri, self.after, self.done = client, run_id, uri, after, False

    @classmethod
    def open(cls, cfg: Config, results: ResultsFile, done: int) -> MLflow:
        """The run the results file names (a resumed run, set running again), else a new one, named in the file."""
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        attrs = results.h5.attrs
        if cls.RUN_ID in attrs:
            uri, run_id = str(attrs[cls.URI]), str(attrs[cls.RUN_ID])
            try:
                client = MlflowClient(uri)
                client.update_run(run_id, status="RUNNING")
                keys = client.get_run(run_id).data.metrics
                last = max((m.step for key in keys for m in client.get_metric_history(run_id, key)), default=0)
            except Exception as e:
                raise failed(cls.name, f"run {run_id} at {uri}", e) from e
            return cls(client, run_id, uri, last)
        uri = cfg.mlflow_uri or mlflow.get_tracking_uri()
        try:
            client = MlflowClient(uri)
            tags = {"fedring.results": str(results.path.resolve()), "fedring.task": cfg.task}
            run_id = client.create_run(experiment(client), run_name=results.path.stem, tags=tags).info.run_id
            params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in parameters(cfg).items()]
            for start in range(0, len(params), cls.BATCH // 10):
                client.log_batch(run_id, params=params[start : start + cls.BATCH // 10])
        except Exception as e:
            raise failed(cls.name, uri, e) from e
        results.set_attrs("/", {cls.RUN_ID: run_id, cls.URI: uri})
        return cls(client, run_id, uri, done)

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.after:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        try:
            for start in range(0, len(metrics), self.BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[start : start + self.BATCH])
        except Exception as e:
            self.done = True
            raise failed(self.name, f"run {self.run_id} at {self.uri}", e) from e

    def close(self, status: FileStatus) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.client.set_terminated(self.run_id, self.STATUS[status])
        except Exception as e:
            raise failed(self.name, f"run {self.run_id} at {self.uri}", e) from e


def experiment(client) -> str:
    """The id of the experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``fedring``), created if missing."""
    from mlflow.exceptions import MlflowException

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fedring"
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another run created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


#: the trackers by the name ``log`` gives them
TRACKERS: dict[str, type[TensorBoard] | type[MLflow]] = {"tensorboard": TensorBoard, "mlflow": MLflow}


def require(cfg: Config) -> None:
    """Every rank, before any work: ``log`` names known trackers, each once, whose extras are installed."""
    for i, name in enumerate(cfg.log):
        if name not in TRACKERS:
            raise validate.unknown("log", "tracker", name, TRACKERS)
        if name in cfg.log[:i]:
            raise ConfigError("log", f"names {name} twice")
        validate.installed("log", TRACKERS[name].modules, f"{name} needs the {name} extra", name)
    if "tensorboard" in cfg.log and not cfg.tensorboard_dir:
        raise ConfigError("tensorboard_dir", "must name a folder (default runs)")


def open_trackers(cfg: Config, results: ResultsFile, done: int, opened: list[Tracker]) -> None:
    """Rank 0: open the trackers of ``cfg.log`` for ``results``, a run that starts after ``done``
    steps, into ``opened`` (so that those opened before one that fails can be closed)."""
    for name in cfg.log:
        opened.append(TRACKERS[name].open(cfg, results, done))
