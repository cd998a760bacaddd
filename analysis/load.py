"""Many results files -> one tidy table: one row per run and evaluated round.

Columns: the run (``file``, ``run`` = file name without ``.h5``, ``status``,
``rounds_completed``, ``world_size``, ``n_clients``, ``n_parameters``), every config setting
(``attack``, ``lr``, ... and ``section.key`` for component parameters; a list is joined with
commas), every ``/metrics/<name>`` (``round``, ``test_accuracy``, ...), ``test_error`` =
1 - test_accuracy, and the run's mean traffic: ``bytes_per_client_round`` (mean of
``/comm/bytes_sent`` over rounds and clients) and ``server_bytes_per_round``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from fedring.names import BYTES_SENT, METRICS, RING, RING_BEFORE_0_3, SERVER_BYTES_SENT
from fedring.results import FileStatus

RUN_COLUMNS = ["file", "run", "status", "rounds_completed", "world_size", "n_clients", "n_parameters"]


def h5_files(paths: list[str | Path]) -> list[Path]:
    """The files named, and every ``*.h5`` under the directories named, sorted and unique."""
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.h5")) if p.is_dir() else [p]
    return list(dict.fromkeys(out))


def open_results(path: Path) -> tuple[h5py.File | None, str | None]:
    """The file open for reading, or None and why it cannot be read."""
    try:
        return h5py.File(path, "r"), None
    except BlockingIOError:
        return None, "being written (another process holds its HDF5 file lock)"
    except FileNotFoundError:
        return None, "no such file"
    except OSError as e:
        return None, f"unreadable ({e})"


def flat_config(config: dict) -> dict:
    """Config JSON -> flat columns: sections as ``section.key``; lists and tables as text."""

    def cell(v):
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return ",".join(v)
        return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v

    out = {k: cell(v) for k, v in config.items() if k != "sections"}
    for section, table in (config.get("sections") or {}).items():
        out.update({f"{section}.{k}": cell(v) for k, v in table.items()})
    return out


def read_run(path: Path, include_incomplete: bool = False) -> tuple[pd.DataFrame | None, str | None]:
    """One run's rows, or None and why it is skipped."""
    f, why = open_results(path)
    if f is None:
        return None, why
    with f:
        status = str(f.attrs.get("status", "unknown"))
        if status == FileStatus.RUNNING:
            return None, "still running (status = running)"
        if status != FileStatus.COMPLETE and not include_incomplete:
            return None, f"not complete (status = {status}, {int(f.attrs.get('rounds_completed', 0))} rounds)"
        if METRICS not in f or "round" not in f[METRICS]:
            return None, "no /metrics (not a training run)"
        try:
            config = json.loads(f.attrs["config"])
        except (KeyError, ValueError) as e:
            return None, f"no readable config attribute ({e})"
        metrics = {name: ds[:] for name, ds in f[METRICS].items() if isinstance(ds, h5py.Dataset) and ds.ndim == 1}
        n = len(metrics["round"])
        frame = pd.DataFrame({k: v if len(v) == n else np.full(n, np.nan) for k, v in metrics.items()})
        if "test_accuracy" in frame:
            frame["test_error"] = 1.0 - frame["test_accuracy"]
        run = {
            "file": str(path),
            "run": path.stem,
            "status": status,
            **{k: int(f.attrs[k]) for k in RUN_COLUMNS[3:] if k in f.attrs},
            **flat_config(config),
        }
        sent = f.get(BYTES_SENT)
        run["bytes_per_client_round"] = float(sent[:].mean()) if sent is not None and sent.size else np.nan
        server = f.get(SERVER_BYTES_SENT)
        run["server_bytes_per_round"] = float(server[:].mean()) if server is not None and server.size else np.nan
    # a metric named like a setting (the lr applied in a round vs the lr setting) keeps its HDF5 path
    frame = frame.rename(columns={k: f"{METRICS}/{k}" for k in frame.columns if k in run})
    for key, value in reversed(run.items()):
        frame.insert(0, key, value)
    return frame, None


def load_runs(paths: list[str | Path], include_incomplete: bool = False) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """The tidy table of every readable run, and ``(file, reason)`` of every file skipped. A
    ``.csv`` path is a table written by ``load --out`` and is read back as it is, so a committed
    CSV regenerates its tables without the HDF5 files."""
    frames, skipped = [], []
    for path in h5_files(paths):
        if path.suffix == ".csv":
            frames.append(pd.read_csv(path))
            continue
        frame, why = read_run(path, include_incomplete)
        if frame is None:
            skipped.append((str(path), why))
        else:
            frames.append(frame)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RUN_COLUMNS)
    return df, skipped


#: where the ring rules' per-round figures are: ``/ring`` in files written after 0.2.0, ``/brace`` in files of 0.2.0
RING_GROUPS = (RING, RING_BEFORE_0_3)


def ring_rows(path: str | Path) -> pd.DataFrame:
    """:func:`round_rows` of the ring rule's figures (``/ring/plus_fraction`` ...), also from a 0.2.0 file."""
    return round_rows(path, *RING_GROUPS)


def round_rows(path: str | Path, group: str, *older: str) -> pd.DataFrame:
    """The 1-D per-round datasets of ``/<group>`` of one run (``/ring/plus_fraction`` ...), with
    ``round`` = 1, 2, ...; the first of the ``older`` names the file has stands in for a missing
    ``group``; empty when the file has none of them (or cannot be read)."""
    f, _ = open_results(Path(path))
    if f is None:
        return pd.DataFrame()
    with f:
        g = next((f[name] for name in (group, *older) if name in f), None)
        if not isinstance(g, h5py.Group):
            return pd.DataFrame()
        cols = {name: ds[:] for name, ds in g.items() if isinstance(ds, h5py.Dataset) and ds.ndim == 1}
    if not cols:
        return pd.DataFrame()
    n = min(map(len, cols.values()))  # a run killed mid-append may leave one dataset a row longer
    return pd.DataFrame({"round": np.arange(1, n + 1), **{k: v[:n] for k, v in cols.items()}})


def report_skipped(skipped: list[tuple[str, str]]) -> None:
    for path, why in skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis load", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", metavar="runs.csv", help="write the table as CSV")
    p.add_argument("--all", action="store_true", help="keep runs that did not complete (preempted, failed)")
    args = p.parse_args(argv)
    df, skipped = load_runs(args.paths, args.all)
    report_skipped(skipped)
    n_runs = df["run"].nunique() if len(df) else 0
    print(f"{n_runs} runs, {len(df)} rows, {len(df.columns)} columns; {len(skipped)} files skipped")
    if args.out:
        df.to_csv(args.out, index=False)
        print(f"wrote {args.out}")
    elif len(df):
        shown = [c for c in ("run", "topology", "aggregator", "attack", "round", "test_accuracy") if c in df]
        print(df[shown].to_string(index=False, max_rows=20))
    return 0 if n_runs else 1
