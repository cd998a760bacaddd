"""Results streamed to one HDF5 file per run, written by rank 0.

The layout is ``docs/hdf5.md``; the names of its groups and datasets are :mod:`fedring.names`.
The root attributes are ``config`` (JSON), ``fedring_version``, ``status`` (a :class:`FileStatus`),
``rounds_completed``, ``world_size``, ``n_clients`` and the task's own. ``/checkpoint`` has two
slots, ``a`` and ``b``; its attr ``current`` names the one holding the last checkpoint (arrays,
and attrs ``round``, ``wall_seconds`` ...), where ``--resume`` starts.

Every append is followed by a flush, so a reader (or a killed job) finds every completed
round. Before each write the file system must have room for it plus a reserve (so the final
``status`` can always be written); without room the write is refused with a
:class:`ResultsError` and the file keeps every earlier round. A write that fails anyway leaves
the file as of its last flush: it is never flushed again, since HDF5 would then record space
it could not write and the whole file would become unreadable. A checkpoint is written into
the slot that is not current, flushed, and only then made current: a job killed while
checkpointing leaves the previous checkpoint intact. A new file is first written as
``<out>.part`` and renamed once it has a valid header, so a failed start never leaves a half-written file under the final name. The file
keeps HDF5's default (oldest compatible) format on purpose: the newer superblock marks a
file "open for write" until a clean close, and a killed job's file would then refuse to
open without ``h5clear``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import resource
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from . import __version__
from .errors import ConfigError, ResultsError
from .names import CHECKPOINT, METRICS, MODEL_FINAL


@dataclasses.dataclass(frozen=True)
class Entry:
    """What one step adds to the results file: ``/metrics/<name>`` entries (evaluated steps
    only), one row of each dataset in ``rows``, and the progress line (None: no line)."""

    done: int
    metrics: dict
    rows: dict
    line: str | None = None


class FileStatus(enum.StrEnum):
    """The ``status`` attribute of a results file (the strings files of 0.2.0 hold)."""

    RUNNING = "running"  # being written, or its writer died
    COMPLETE = "complete"
    PREEMPTED = "preempted"  # stopped by a signal; --resume continues it
    FAILED = "failed"


#: free space kept in the file system beyond each write, for the final status
RESERVE = 1 << 20
#: allowance for the metadata and chunk rounding of one write
SLACK = 64 << 10


def read_checkpoint(h5: h5py.File, skip: tuple[str, ...] = ()) -> tuple[dict[str, np.ndarray], dict] | None:
    """The current checkpoint of an open results file: (arrays, attrs), or None if it has none;
    arrays whose names start with one of ``skip`` are left in the file (read by the caller in parts)."""
    root = h5.get(CHECKPOINT)
    if root is None or "current" not in root.attrs:
        return None
    slot = root[root.attrs["current"]]
    return (
        {name: ds[()] for name, ds in slot.items() if not name.startswith(skip)},
        {k: v.item() for k, v in slot.attrs.items()},
    )


def resume_point(cfg, skip: tuple[str, ...] = ()) -> tuple[dict[str, np.ndarray], dict]:
    """The checkpoint ``--resume`` of run ``cfg`` continues from: (arrays, attrs).

    Raises ConfigError (the agreed exit 2, nothing written) unless ``cfg.out`` is a readable
    fedring results file of the same settings that is not complete and has a checkpoint.
    """
    from .config import config_differences

    try:
        with h5py.File(cfg.out, "r") as f:
            diff = config_differences(json.loads(f.attrs["config"]), json.loads(cfg.to_json()))
            if diff:
                raise ConfigError("resume", f"{cfg.out} was written with other settings: {'; '.join(diff)}")
            if f.attrs["status"] == FileStatus.COMPLETE:
                raise ConfigError("resume", f"{cfg.out} is already complete: nothing to resume")
            found = read_checkpoint(f, skip)
    except ConfigError:
        raise
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(
            "resume",
            f"{cfg.out} is not a readable fedring results file ({type(e).__name__}: {e}); "
            "it is left as it is: remove it, or start afresh with --overwrite",
        ) from None
    if found is None:
        raise ConfigError("resume", f"{cfg.out} has no checkpoint: start it again with --overwrite")
    return found


class BlockArray(Protocol):
    """An array the file writes one block at a time (:class:`fedring.train.state.CheckpointRows`)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int

    def write_into(self, ds: Any) -> None: ...


class ResultsFile:
    """Appendable per-round results; open only on rank 0."""

    @classmethod
    def reopen(cls, path: str, rounds_completed: int) -> ResultsFile:
        """Open an existing run to resume it after ``rounds_completed`` rounds.

        Entries of later rounds (written after the checkpoint) are cut off, so the resumed
        run appends exactly what an uninterrupted run would have.
        """
        self = cls.__new__(cls)
        self.path = Path(path)
        self.h5 = h5py.File(self.path, "r+")
        evaluated = f"{METRICS}/round"
        rounds = self.h5[evaluated][:] if evaluated in self.h5 else np.zeros(0)
        keep_metrics = int(np.searchsorted(rounds, rounds_completed, side="right"))
        # only appended datasets can grow (those written once, checkpoints included, have a fixed
        # shape, maybe none): /metrics has one entry per evaluated round, every other one per round
        for name, group in self.h5.items():
            if not isinstance(group, h5py.Group):
                continue
            keep = keep_metrics if name == METRICS else rounds_completed
            for ds in group.values():
                if isinstance(ds, h5py.Dataset) and ds.maxshape[:1] == (None,):
                    ds.resize(min(keep, ds.shape[0]), axis=0)
        if MODEL_FINAL in self.h5:
            del self.h5[MODEL_FINAL]
        self.h5.attrs["rounds_completed"] = rounds_completed
        self.h5.attrs["status"] = FileStatus.RUNNING.value
        self.h5.flush()
        return self

    @classmethod
    def create(cls, cfg, world_size: int, attrs: dict | None = None) -> ResultsFile:
        """A new results file for run ``cfg`` (a :class:`fedring.config.Config`), with the root
        attributes every task writes (``config``, ``task``, ``world_size``) and ``attrs``."""
        root = {"config": cfg.to_json(), "task": cfg.task, "world_size": world_size, **(attrs or {})}
        return cls(cfg.out, root, overwrite=cfg.overwrite)

    def __init__(self, path: str, attrs: dict, overwrite: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        with h5py.File(part, "w") as f:
            f.attrs["fedring_version"] = __version__
            f.attrs["status"] = FileStatus.RUNNING.value
            f.attrs["rounds_completed"] = 0
            for key, value in attrs.items():
                f.attrs[key] = value
        if self.path.exists() and not overwrite:
            part.unlink()
            raise FileExistsError(f"{self.path} exists")
        os.replace(part, self.path)
        self.h5 = h5py.File(self.path, "r+")

    broken = False

    @contextlib.contextmanager
    def _writing(self, nbytes: int):
        """Refuse a write of about ``nbytes`` without room for it; never flush again after a failed one."""
        if self.broken:
            raise ResultsError(f"{self.path} could not be written earlier; nothing more is written to it")
        room = os.statvfs(self.path.parent)
        free = room.f_bavail * room.f_frsize
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            free = min(free, limit - self.path.stat().st_size)
        if free < nbytes + SLACK + RESERVE:
            raise ResultsError(
                f"{self.path} cannot grow: {free / 2**20:.1f} MiB left for it, the next write needs "
                f"{(nbytes + SLACK) / 2**20:.1f} MiB plus {RESERVE >> 20} MiB in reserve; the file keeps every "
                "round so far; make room, then --resume continues from its last checkpoint"
            )
        try:
            yield
        except OSError as e:
            self.broken = True
            raise ResultsError(
                f"{self.path} could not be written ({e.strerror or e}); it keeps every round up to "
                "the last one written; make room, then --resume continues from its last checkpoint"
            ) from e

    def _append(self, name: str, value, dtype=None) -> None:
        value = np.asarray(value, dtype=dtype)
        if name not in self.h5:
            self.h5.create_dataset(
                name,
                shape=(0, *value.shape),
                maxshape=(None, *value.shape),
                dtype=value.dtype,
                chunks=(max(1, 4096 // max(1, value.size)), *value.shape),
            )
        ds = self.h5[name]
        ds.resize(ds.shape[0] + 1, axis=0)
        ds[-1] = value

    def append_round(self, metrics: dict, rows: dict | None = None, rounds_completed: int | None = None) -> None:
        """Append one entry to every ``/metrics/<name>`` and one row to each ``rows`` dataset, then flush."""
        rows = rows or {}
        with self._writing(sum(np.asarray(v).nbytes for v in [*metrics.values(), *rows.values()])):
            for name, value in metrics.items():
                self._append(f"{METRICS}/{name}", value)
            for name, value in rows.items():
                self._append(name, value)
            if rounds_completed is not None:
                self.h5.attrs["rounds_completed"] = rounds_completed
            self.h5.flush()

    def write_checkpoint(self, arrays: dict, attrs: dict) -> None:
        """Write ``arrays`` and ``attrs`` into the spare checkpoint slot, flush, then make it current.

        An array may also be an object with ``shape``, ``dtype``, ``nbytes`` and ``write_into(dataset)``
        (:class:`fedring.train.state.CheckpointRows`: every client's rows, written one rank's block at a time).
        """
        with self._writing(
            sum(v.nbytes if hasattr(v, "write_into") else np.asarray(v).nbytes for v in arrays.values())
        ):
            self._write_checkpoint(arrays, attrs)

    def _write_checkpoint(self, arrays: dict[str, np.ndarray | BlockArray], attrs: dict) -> None:
        root = self.h5.require_group(CHECKPOINT)
        slot = root.require_group("b" if root.attrs.get("current") == "a" else "a")
        for name in set(slot) - set(arrays):
            del slot[name]
        for name, given in arrays.items():
            blocks = given if hasattr(given, "write_into") else None
            value = given if blocks is not None else np.asarray(given)
            if name in slot and (slot[name].shape, slot[name].dtype) == (value.shape, value.dtype):
                if blocks is None:
                    slot[name][...] = value  # in place: the file does not grow
            else:
                if name in slot:
                    del slot[name]
                if blocks is not None:
                    slot.create_dataset(name, shape=value.shape, dtype=value.dtype)
                else:
                    slot.create_dataset(name, data=value)
            if blocks is not None:
                blocks.write_into(slot[name])
        slot.attrs.clear()
        for key, value in attrs.items():
            slot.attrs[key] = value
        self.h5.flush()
        root.attrs["current"] = slot.name.rsplit("/", 1)[1]
        self.h5.flush()

    def write(self, name: str, data) -> None:
        with self._writing(np.asarray(data).nbytes):
            if name in self.h5:
                del self.h5[name]
            self.h5.create_dataset(name, data=data)
            self.h5.flush()

    def set_attrs(self, group: str, values: dict) -> None:
        with self._writing(sum(len(str(v)) for v in values.values())):
            g = self.h5.require_group(group)
            for key, value in values.items():
                g.attrs[key] = value
            self.h5.flush()

    def close(self, status: FileStatus | None = None) -> None:
        """Set ``status`` and close; a file whose write failed is left as of its last flush."""
        if self.broken or not self.h5.id.valid:
            return
        if status is not None:
            self.h5.attrs["status"] = FileStatus(status).value
        self.h5.close()
