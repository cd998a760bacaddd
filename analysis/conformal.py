"""The conformal runs' results: ``python -m analysis conformal-table`` (and the data of
``plot-conformal``).

Every conformal task writes one layout, ``/calibration`` (:mod:`fedring.conformal.trials`):
attrs ``cases`` (one dict per case: ``label``, ``method`` and what tells the case apart:
``attack``, ``target``, ``epsilon`` ...), ``size_kind`` (``interval width`` or ``set size``),
``alpha``; datasets ``coverage`` and ``size`` of shape (trials, cases). It is read with
:func:`fedring.conformal.trials.read_calibration`. One row per (file, case): the case's keys as
columns, coverage (%) and size, mean ± sd over the trials, the number of trials and the target
coverage 1 - alpha.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from fedring.names import CALIBRATION
from fedring.results import FileStatus

from .load import h5_files, open_results, report_skipped
from .tables import add_where, apply_where, text, write_outputs

#: columns of a row that are not the case's own keys
RESULT_COLUMNS = ["coverage", "coverage_sd", "size", "size_sd", "size_kind", "trials", "alpha"]


def _sd(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def read_conformal(path: Path) -> tuple[list[dict] | None, str | None]:
    """One row per case of a complete conformal run's ``/calibration``, or None and why it is skipped."""
    f, why = open_results(path)
    if f is None:
        return None, why
    with f:
        status = str(f.attrs.get("status", "unknown"))
        if status != FileStatus.COMPLETE:
            return None, f"not complete (status = {status})"
        if CALIBRATION not in f:
            return None, "no /calibration (not a conformal run)"
        seed = json.loads(f.attrs.get("config", "{}")).get("seed")
    from fedring.conformal.trials import (
        read_calibration,  # imports mpi4py: only when needed
    )

    try:
        attrs, data = read_calibration(path)
        cases, coverage, size = attrs["cases"], np.asarray(data["coverage"], float), np.asarray(data["size"], float)
        kind, alpha = str(attrs["size_kind"]), float(attrs["alpha"])
    except BlockingIOError:
        return None, "being written (another process holds its HDF5 file lock)"
    except (OSError, KeyError, ValueError, TypeError) as e:
        return None, f"/calibration is not in the layout of fedring.conformal.trials ({type(e).__name__}: {e})"
    if coverage.ndim != 2 or coverage.shape != size.shape or coverage.shape[1] != len(cases):
        return None, (
            f"/calibration: coverage {coverage.shape} and size {size.shape} are not (trials, {len(cases)} cases)"
        )
    if coverage.shape[0] == 0:
        return None, "/calibration has no trials"
    base = {"file": str(path), "run": path.stem, "seed": seed}
    settings = json.dumps(attrs.get("settings", {}), sort_keys=True)
    rows = []
    for j, case in enumerate(cases):
        cov, sz = coverage[:, j], size[:, j]
        rows.append(
            {
                **base,
                **case,
                "coverage": float(cov.mean()),
                "coverage_sd": _sd(cov),
                "size": float(sz.mean()),
                "size_sd": _sd(sz),
                "size_kind": kind,
                "trials": len(cov),
                "alpha": alpha,
                "settings": settings,
            }
        )
    return rows, None


def load_conformal(paths) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """One row per (file, case) of every readable conformal run, and ``(file, reason)`` of every file skipped."""
    rows, skipped = [], []
    for path in h5_files(paths):
        got, why = read_conformal(path)
        if got is None:
            skipped.append((str(path), why))
        else:
            rows += got
    df = pd.DataFrame(rows)
    if len(df):  # the case keys first, in the order the files name them
        cases = [c for c in df.columns if c not in ("file", "run", *RESULT_COLUMNS, "settings")]
        df = df[["file", "run", *cases, *RESULT_COLUMNS, "settings"]]
    return df, skipped


def conformal_cases(paths, where: list[str]) -> pd.DataFrame:
    """The cases of ``load_conformal`` that match every ``KEY=VALUE`` of ``where``; skipped files reported."""
    df, skipped = load_conformal(paths)
    report_skipped(skipped)
    return apply_where(df, where) if len(df) else df


def case_columns(df: pd.DataFrame) -> list[str]:
    """The case keys that tell rows apart (``run`` when there are several files; ``label`` and
    ``method`` always), in the order the cases name them."""
    keys = [c for c in df.columns if c not in (*RESULT_COLUMNS, "file", "run", "settings")]
    varies = [c for c in keys if df[c].map(text).nunique() > 1 or c in ("label", "method")]
    return (["run"] if df["run"].nunique() > 1 else []) + varies


def size_label(df: pd.DataFrame) -> str:
    """``interval width`` / ``set size`` when every row has the same kind, else ``size``."""
    kinds = df["size_kind"].unique()
    return str(kinds[0]) if len(kinds) == 1 else "size"


def conformal_table(df: pd.DataFrame, digits: int = 2) -> tuple[str, pd.DataFrame]:
    """(Markdown, CSV frame): the case keys that vary, coverage (%), size, trials, target coverage."""
    describe = case_columns(df)
    mixed_kinds = df["size_kind"].nunique() > 1
    size = size_label(df)
    head = [
        *describe,
        "Coverage (%)",
        size[:1].upper() + size[1:],
        *(["Size kind"] if mixed_kinds else []),
        "Trials",
        "Target (%)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in df.iterrows():
        cells = [text(r[c]) for c in describe]
        cells += [
            f"{100 * r['coverage']:.1f} ± {100 * r['coverage_sd']:.1f}",
            f"{r['size']:.{digits}f} ± {r['size_sd']:.{digits}f}",
            *([r["size_kind"]] if mixed_kinds else []),
            str(r["trials"]),
            f"{100 * (1 - r['alpha']):g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    constant = [c for c in df.columns if c not in (*RESULT_COLUMNS, "file", "run", "settings", *describe)]
    same = "; ".join(f"{c} = {text(df[c].iloc[0])}" for c in constant if text(df[c].iloc[0]))
    caption = (
        f"Coverage (%) and {'size (interval width or set size: Size kind)' if mixed_kinds else size}, "
        "mean ± sd over the trials; Target = 100 (1 - alpha) %" + (f". Every row: {same}" if same else "") + "."
    )
    csv = df.drop(columns=["file"]).set_index("run")
    csv = csv.assign(
        **{
            c: csv[c].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
            for c in csv.columns
            if csv[c].map(lambda v: isinstance(v, (list, dict))).any()
        }
    )
    return caption + "\n\n" + "\n".join(lines) + "\n", csv


def main_table(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis conformal-table",
        description="Coverage and interval width / set size per case of conformal runs (/calibration).",
    )
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.csv")
    p.add_argument("--digits", type=int, default=2)
    add_where(p, "the cases with this value")
    args = p.parse_args(argv)
    df = conformal_cases(args.paths, args.where)
    if df.empty:
        print("no complete conformal runs to tabulate", file=sys.stderr)
        return 1
    write_outputs(*conformal_table(df, args.digits), args.out)
    return 0
