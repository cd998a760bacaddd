"""Paper-layout tables from many runs, as Markdown and CSV.

``table``: rows attacks, columns defences (the BRACE paper's Table 2), cells the final test
error; where the runs measured an attack success rate (backdoor) the cell reads
``error / success rate``. Runs that differ only by ``seed`` share a cell (mean, and ± the
standard deviation when there are several); a cell whose runs differ in any other setting
is an error naming the setting (narrow the runs with ``--where KEY=VALUE``).

``conformal-table``: one row per method (and attack, sharing ratio, target agent) of the
conformal runs' ``/calibration/`` results, cells coverage (%) and set size or interval
width, mean ± standard deviation over the trials.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from fedring.config import FIELDS, RUN_CONTROL

from . import AGGREGATOR_LABELS, ATTACK_LABELS, CONFORMAL_METHOD_LABELS
from .load import h5_files, load_runs, open_results, report_skipped

SUCCESS = "attack_success_rate"


def text(value) -> str:
    """A table cell: blank for missing, ``%g`` for floats."""
    return "" if pd.isna(value) else f"{value:g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# Training runs
# ---------------------------------------------------------------------------------------------


def method_labels(runs: pd.DataFrame) -> pd.Series:
    """The paper's defence names (RAR = mean on the ring); a rule on both topologies gets it appended."""
    agg = runs["aggregator"].astype(str)
    topo = runs["topology"].astype(str) if "topology" in runs else pd.Series("", index=runs.index)
    label = agg.map(lambda a: AGGREGATOR_LABELS.get(a, a)).where(~((agg == "mean") & (topo == "server")), "Mean")
    if "pre_aggregators" in runs:
        pre = runs["pre_aggregators"].map(text)
        label = label.where(pre == "", pre.str.replace(",", "+") + "+" + label)
    if "topology" not in runs:
        return label
    both = runs.assign(_l=label).groupby("_l")["topology"].transform("nunique") > 1
    return label.where(~both, label + " (" + topo + ")")


def config_columns(df: pd.DataFrame) -> list[str]:
    """Columns that are result-changing run settings (fedring's keys and ``section.key``)."""
    return [c for c in df.columns if (c in FIELDS or "." in c) and c not in RUN_CONTROL]


def final_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The last evaluated round of every run."""
    return df.sort_values("round").groupby("run", sort=False).tail(1).reset_index(drop=True)


def apply_where(df: pd.DataFrame, where: list[str]) -> pd.DataFrame:
    for item in where:
        key, sep, value = item.partition("=")
        if not sep or key not in df:
            raise SystemExit(f"--where {item!r}: expected KEY=VALUE with KEY a column ({', '.join(config_columns(df))})")
        df = df[df[key].map(text) == value]
    return df


def _order(values, labels: dict) -> list:
    known = [labels[k] for k in labels if labels[k] in set(values)]
    return known + sorted(set(values) - set(known), key=str)


def paper_table(df: pd.DataFrame, rows: str = "attack", cols: str = "method", metric: str = "test_error",
                digits: int = 2) -> tuple[str, pd.DataFrame]:
    """(Markdown, numeric CSV frame) of ``metric`` at each run's final round, rows x cols."""
    final = final_rows(df)
    final["method"] = method_labels(final)
    if rows == "attack":
        final["attack"] = final["attack"].map(lambda a: ATTACK_LABELS.get(a, a))
    for axis in (rows, cols):
        if axis not in final:
            raise SystemExit(f"no column {axis!r} in the runs; columns: {', '.join(final.columns)}")
    fixed = {rows, cols, "seed", "topology", "aggregator", "pre_aggregators"} if cols == "method" else {rows, cols, "seed"}
    mixed = {}
    for key, cell in final.groupby([rows, cols]):
        for c in config_columns(final):
            if c not in fixed and cell[c].map(text).nunique() > 1:
                mixed.setdefault(c, (key, sorted(cell[c].map(text).unique())))
    if mixed:
        c, (key, values) = next(iter(mixed.items()))
        raise SystemExit(f"the runs of cell {rows}={key[0]!r}, {cols}={key[1]!r} differ in {c} ({', '.join(values)})"
                         f"{' and in ' + ', '.join(list(mixed)[1:]) if len(mixed) > 1 else ''}: choose with --where KEY=VALUE")
    grouped = final.groupby([rows, cols])
    mean = grouped[metric].mean().unstack(cols)
    sd = grouped[metric].std().unstack(cols)
    count = grouped[metric].count().unstack(cols)
    has_success = SUCCESS in final and final[SUCCESS].notna().any()
    success = grouped[SUCCESS].mean().unstack(cols) if has_success else None
    row_order = _order(mean.index, ATTACK_LABELS if rows == "attack" else {})
    col_order = _order(mean.columns, {v: v for v in AGGREGATOR_LABELS.values()} if cols == "method" else {})

    def cell(r, c) -> str:
        if c not in mean.columns or pd.isna(mean.at[r, c]):
            return "-"
        text = f"{mean.at[r, c]:.{digits}f}"
        if count.at[r, c] > 1:
            text += f" ± {sd.at[r, c]:.{digits}f}"
        if success is not None and c in success.columns and pd.notna(success.at[r, c]):
            text += f" / {success.at[r, c]:.{digits}f}"
        return text

    seeds = final["seed"].nunique() if "seed" in final else 1
    rounds = sorted(final["round"].astype(int).unique())
    caption = (f"Final {metric.replace('_', ' ')} (round {', '.join(map(str, rounds))})"
               + ("; where measured: test error / attack success rate" if has_success else "")
               + f". {len(final)} runs" + (f", mean ± sd over {seeds} seeds" if seeds > 1 else "") + ".")
    head = [rows.capitalize() if rows != "attack" else "Attack", *col_order]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([str(r), *(cell(r, c) for c in col_order)]) + " |" for r in row_order]
    csv = mean.reindex(index=row_order, columns=col_order)
    if success is not None:
        extra = success.reindex(columns=col_order).dropna(how="all")
        extra.index = [f"{r} ({SUCCESS.replace('_', ' ')})" for r in extra.index]
        csv = pd.concat([csv, extra])
    csv.index.name = rows
    return "\n".join(lines) + "\n", csv


def write_outputs(markdown: str, csv: pd.DataFrame, prefix: str | None) -> None:
    print(markdown)
    if prefix:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.md").write_text(markdown)
        csv.to_csv(f"{prefix}.csv")
        print(f"wrote {prefix}.md, {prefix}.csv")


def main_table(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis table", description="Paper-layout table: final test error, rows x columns.")
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.csv")
    p.add_argument("--rows", default="attack", help="column for the rows (default attack)")
    p.add_argument("--cols", default="method", help="column for the columns (default method: the defence)")
    p.add_argument("--metric", default="test_error", help="metric in the cells (default test_error)")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="keep only runs with this setting")
    args = p.parse_args(argv)
    df, skipped = load_runs(args.paths)
    report_skipped(skipped)
    df = apply_where(df, args.where)
    if df.empty:
        print("no complete training runs to tabulate", file=sys.stderr)
        return 1
    write_outputs(*paper_table(df, args.rows, args.cols, args.metric, args.digits), args.out)
    return 0


# ---------------------------------------------------------------------------------------------
# Conformal runs
# ---------------------------------------------------------------------------------------------


def _stats(coverage: np.ndarray, width: np.ndarray) -> dict:
    def sd(x):
        return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0

    return {"trials": len(coverage), "coverage": float(np.mean(coverage)), "coverage_sd": sd(coverage),
            "width": float(np.mean(width)), "width_sd": sd(width)}


def read_conformal(path: Path) -> tuple[list[dict] | None, str | None]:
    """Rows of one conformal run's ``/calibration/`` group, or None and why it is skipped.

    Two layouts: ``coverage`` and ``width`` of shape (trials, cases) with the cases in the
    group's ``cases`` attribute (``conformal prism``); or one subgroup per method with
    ``coverage`` and ``set_size`` of shape (trials, targets), the targets in the group's
    ``targets`` attribute (``conformal labelshift``).
    """
    f, why = open_results(path)
    if f is None:
        return None, why
    with f:
        status = str(f.attrs.get("status", "unknown"))
        if status != "complete":
            return None, f"not complete (status = {status})"
        if "calibration" not in f:
            return None, "no /calibration (not a conformal run)"
        g = f["calibration"]
        config = json.loads(f.attrs.get("config", "{}"))
        base = {"run": path.stem, **{k: config[k] for k in ("dataset", "experiment", "alpha") if k in config}}
        rows = []
        if isinstance(g.get("coverage"), h5py.Dataset):
            cases = json.loads(g.attrs["cases"])
            cov, width = g["coverage"][:], g["width"][:]
            for j, case in enumerate(cases):
                shared = {"M/D": case["shared"] / config["dim"]} if "dim" in config else {"M": case["shared"]}
                rows.append({**base, "attack": case["attack"], "method": CONFORMAL_METHOD_LABELS.get(case["method"], case["method"]),
                             **shared, "filter": case["rule"] or "none", **_stats(cov[:, j], width[:, j])})
        targets = list(g.attrs.get("targets", []))
        for name, sub in g.items():
            if isinstance(sub, h5py.Group) and "coverage" in sub:
                cov = sub["coverage"][:].reshape(len(sub["coverage"]), -1)
                width = sub["width" if "width" in sub else "set_size"][:].reshape(cov.shape)
                for j in range(cov.shape[1]):
                    target = {"target": int(targets[j])} if j < len(targets) else {}
                    rows.append({**base, "method": name, **target, **_stats(cov[:, j], width[:, j])})
        if not rows:
            return None, "no coverage results under /calibration"
        return rows, None


def load_conformal(paths) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    rows, skipped = [], []
    for path in h5_files(paths):
        got, why = read_conformal(path)
        if got is None:
            skipped.append((str(path), why))
        else:
            rows += got
    return pd.DataFrame(rows), skipped


def conformal_columns(df: pd.DataFrame) -> list[str]:
    """The descriptive columns of conformal rows that tell them apart (``method`` always)."""
    return [c for c in ("dataset", "experiment", "alpha", "attack", "method", "M/D", "M", "filter", "target")
            if c in df and (df[c].map(text).nunique() > 1 or c == "method")]


def conformal_table(df: pd.DataFrame, digits: int = 2) -> tuple[str, pd.DataFrame]:
    """(Markdown, CSV frame): descriptive columns that vary, then coverage (%) and width."""
    describe = conformal_columns(df)
    head = [*describe, "Coverage (%)", "Width", "Trials"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in df.iterrows():
        cells = [text(r[c]) for c in describe]
        cells += [f"{100 * r['coverage']:.1f} ± {100 * r['coverage_sd']:.1f}",
                  f"{r['width']:.{digits}f} ± {r['width_sd']:.{digits}f}", str(r["trials"])]
        lines.append("| " + " | ".join(cells) + " |")
    alpha = sorted(df["alpha"].unique()) if "alpha" in df else []
    caption = ("Coverage and width (set size for classification), mean ± sd over trials"
               + (f"; target coverage {', '.join(f'{100 * (1 - a):g}%' for a in alpha)}" if alpha else "") + ".")
    return caption + "\n\n" + "\n".join(lines) + "\n", df.set_index("run")


def main_conformal(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis conformal-table",
                                description="Coverage and width of conformal runs (/calibration/).")
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.csv")
    p.add_argument("--digits", type=int, default=2)
    args = p.parse_args(argv)
    df, skipped = load_conformal(args.paths)
    report_skipped(skipped)
    if df.empty:
        print("no complete conformal runs to tabulate", file=sys.stderr)
        return 1
    write_outputs(*conformal_table(df, args.digits), args.out)
    return 0
