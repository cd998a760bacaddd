"""Paper-layout tables of training runs, as Markdown and CSV: ``python -m analysis table``.

Rows attacks, columns defences (the BRACE paper's Table 2; ``--rows``/``--cols`` for other
layouts). Each run contributes one number: its ``--metric`` (default ``test_error``;
``test_accuracy`` or any other ``/metrics`` column) at its last evaluation, or the mean over
its last K evaluations with ``--final-window K``. Runs that differ only by ``seed`` share a
cell, shown as ``mean ± sd (n)`` over its n runs (the value alone when n = 1); where the runs
measured an attack success rate (backdoor) the cell reads ``metric / success rate``. A cell
whose runs differ in any other setting is an error naming the setting (narrow the runs with
``--where KEY=VALUE``). BRACE with ``brace.rule = symmetric`` is its own column, ``BRACE-sym``.

``--beside FILE.csv`` puts another table's value in parentheses after each cell, e.g. the
paper's own (``docs/reference/brace_table2a.csv``): its first column holds the row labels,
its header the column labels, lines starting with ``#`` are comments. Its labels that match no
row or column of the runs are named on stderr (``--where`` may have dropped them; a typo shows
there); a file that shares no row or no column with the table is an error.

``--diff-to COLUMN`` (e.g. ``BRACE``): that column keeps its values; every other cell shows
the difference (cell - COLUMN) paired per seed: within a row, each run is matched with the
COLUMN run of the same ``seed`` (every other setting is fixed within a cell), and the cell is
``mean ± sd (n)`` over the n paired differences. Settings in which the paired cells differ
besides the column itself (a per-defence ``lr``, ``brace.lambda``) are named in the caption.

The CSV carries the same numbers: per column the mean (named by the column, or ``X - COLUMN``
for differences), ``<name> sd`` and ``<name> n``; attack success rates are extra rows
``<row> (attack success rate)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from fedring.config import FIELDS, RUN_CONTROL
from fedring.names import METRICS

from . import (
    AGGREGATOR_LABELS,
    ATTACK_LABELS,
    BRACE_SYMMETRIC,
    DP_LABELS,
    METHOD_ORDER,
    PRE_AGGREGATOR_LABELS,
)
from .load import RUN_COLUMNS, load_runs, report_skipped

SUCCESS = "attack_success_rate"
#: the settings that make up the ``method`` column's label
METHOD_KEYS = ("topology", "aggregator", "pre_aggregators", "brace.rule")


def text(value) -> str:
    """A table cell: blank for missing, ``%g`` for floats."""
    if isinstance(value, (list, dict, tuple)):
        return str(value)
    return "" if pd.isna(value) else f"{value:g}" if isinstance(value, float) else str(value)


def method_labels(runs: pd.DataFrame) -> pd.Series:
    """The paper's defence names (RAR = mean on the ring; BRACE-sym = BRACE's symmetric rule);
    a rule run on both topologies gets the topology appended."""
    agg = runs["aggregator"].astype(str)
    topo = runs["topology"].astype(str) if "topology" in runs else pd.Series("", index=runs.index)
    label = agg.map(lambda a: AGGREGATOR_LABELS.get(a, a)).where(~((agg == "mean") & (topo == "server")), "Mean")
    if "brace.rule" in runs:
        label = label.where(~((agg == "brace") & (runs["brace.rule"].map(text) == "symmetric")), BRACE_SYMMETRIC)
    if "pre_aggregators" in runs:
        pre = runs["pre_aggregators"].map(text)
        named = pre.map(lambda p: "+".join(PRE_AGGREGATOR_LABELS.get(x, x) for x in p.split(",")))
        label = label.where(pre == "", named + "+" + label)
    if "dp" in runs:
        dp = runs["dp"].map(text)
        label = label.where(~dp.isin(list(DP_LABELS)), label + "+" + dp.map(lambda m: DP_LABELS.get(m, "")))
    if "topology" not in runs:
        return label
    both = runs.assign(_l=label).groupby("_l")["topology"].transform("nunique") > 1
    return label.where(~both, label + " (" + topo + ")")


def config_columns(df: pd.DataFrame) -> list[str]:
    """Columns that are result-changing run settings (fedring's keys and ``section.key``)."""
    return [c for c in df.columns if (c in FIELDS or "." in c) and c not in RUN_CONTROL]


def metric_columns(df: pd.DataFrame) -> list[str]:
    """Columns that are measurements (``test_accuracy``, ``test_error``, ``metrics/lr`` ...)."""
    settings = set(config_columns(df)) | set(RUN_COLUMNS) | set(RUN_CONTROL) | {"round"}
    return [c for c in df.columns if c not in settings and pd.api.types.is_numeric_dtype(df[c])]


def metric_column(df: pd.DataFrame, metric: str) -> str:
    """The column of ``--metric``: a measurement, or ``metrics/<name>`` when a setting has the name (``lr``)."""
    if metric in metric_columns(df):
        return metric
    if f"{METRICS}/{metric}" in df:
        return f"{METRICS}/{metric}"
    raise SystemExit(f"--metric {metric!r}: not a metric of these runs; metrics: {', '.join(metric_columns(df))}")


def final_rows(df: pd.DataFrame, metric: str = "test_error", window: int = 1) -> pd.DataFrame:
    """One row per run: its settings, and ``metric`` (and the attack success rate) averaged over
    its last ``window`` evaluations that measured ``metric``; ``first_round``, ``last_round`` and
    ``evaluations`` say which were used."""
    df = df.sort_values("round", kind="stable")
    last = df.groupby("run", sort=False).tail(1).set_index("run")
    used = df[df[metric].notna()].groupby("run", sort=False).tail(window).groupby("run", sort=False)
    for column in dict.fromkeys([metric, SUCCESS]):
        if column in df:
            last[column] = used[column].mean()
    last["first_round"], last["last_round"] = used["round"].min(), used["round"].max()
    last["evaluations"] = used.size()
    last["evaluations"] = last["evaluations"].fillna(0).astype(int)
    return last.reset_index()


def apply_where(df: pd.DataFrame, where: list[str]) -> pd.DataFrame:
    """The rows that match every key of ``where``'s ``KEY=VALUE`` items: a row matches a key when its
    column KEY reads one of the values given for it (``--where seed=0 --where seed=1``: seeds 0 and 1).

    >>> df = pd.DataFrame({"seed": [0, 1, 2, 0], "lr": [0.1, 0.1, 0.1, 0.3]})
    >>> apply_where(df, ["seed=0", "seed=1", "lr=0.1"]).index.tolist()
    [0, 1]
    """
    wanted: dict[str, set[str]] = {}
    for item in where:
        key, sep, value = item.partition("=")
        if not sep or key not in df:
            raise SystemExit(
                f"--where {item!r}: expected KEY=VALUE with KEY a column ({', '.join(config_columns(df) or df.columns)})"
            )
        wanted.setdefault(key, set()).add(value)
    for key, values in wanted.items():
        df = df[df[key].map(text).isin(values)]
    return df


def add_where(p: argparse.ArgumentParser, what: str = "runs with this setting") -> None:
    """The ``--where KEY=VALUE`` option that :func:`apply_where` reads (repeatable)."""
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"keep only {what} (repeat a key for any of its values)",
    )


def _order(values, labels) -> list:
    """``values`` in the order of ``labels`` (a dict's values or a list), the rest sorted after."""
    labels = list(labels.values()) if isinstance(labels, dict) else list(labels)
    present = set(values)
    known = [v for v in labels if v in present]
    return known + sorted(present - set(known), key=str)


#: settings that make runs incomparable: one figure or table shows one of each, unless it is an axis
ONE_PER_TABLE = ("dataset", "clients")


def varying_settings(runs: pd.DataFrame) -> dict[str, list[str]]:
    """The result-changing settings (not ``seed``) whose values differ across ``runs`` (one row
    per run), with their values."""
    values = {
        c: sorted(runs[c].map(lambda v: text(v) or "unset").unique()) for c in config_columns(runs) if c != "seed"
    }
    return {c: v for c, v in values.items() if len(v) > 1}


def say_varying(runs: pd.DataFrame) -> None:
    """Name on stderr the settings that vary across the runs (what a table or plot compares)."""
    varying = varying_settings(runs)
    n = runs["run"].nunique()
    what = "; ".join(f"{k} ({', '.join(v[:6])}{', ...' if len(v) > 6 else ''})" for k, v in varying.items())
    print(
        f"{n} run{'' if n == 1 else 's'}; "
        + (f"settings that vary across them: {what}" if varying else "they differ in nothing but the seed"),
        file=sys.stderr,
    )


def check_comparable(runs: pd.DataFrame, axes: set) -> None:
    """Refuse runs on several data sets or client counts, unless that setting is one of ``axes``."""
    for key in ONE_PER_TABLE:
        if key in runs and key not in axes and runs[key].map(text).nunique() > 1:
            values = ", ".join(sorted(runs[key].map(text).unique()))
            raise SystemExit(
                f"the runs differ in {key} ({values}), which one table or figure does not mix: "
                f"choose with --where {key}=VALUE"
            )


def check_cells(final: pd.DataFrame, rows: str, cols: str, fixed: set, *more: str) -> None:
    """Refuse a cell (its ``rows``, ``cols`` and ``more`` values) whose runs differ in a setting other than ``fixed``."""
    mixed = {}
    keys = [rows, cols, *more]
    for key, cell in final.groupby(keys):
        for c in config_columns(final):
            if c not in fixed and cell[c].map(text).nunique() > 1:
                mixed.setdefault(c, (key, sorted(cell[c].map(text).unique())))
    if mixed:
        c, (key, values) = next(iter(mixed.items()))
        raise SystemExit(
            f"the runs of cell {', '.join(f'{k}={v!r}' for k, v in zip(keys, key))} differ in {c} ({', '.join(values)})"
            f"{' and in ' + ', '.join(list(mixed)[1:]) if len(mixed) > 1 else ''}: choose with --where KEY=VALUE"
        )


def paired_differences(
    final: pd.DataFrame, rows: str, cols: str, ref, measures: list[str], fixed: set
) -> tuple[pd.DataFrame, list[str]]:
    """Per-run values of column ``ref`` and, for every other column, the per-seed differences
    to ``ref`` in the same row; and the settings in which paired cells differ besides ``cols``."""
    per_seed = final.groupby([rows, cols, "seed"], sort=False)[measures].mean().reset_index()
    reference = per_seed[per_seed[cols] == ref].drop(columns=cols)
    paired = per_seed[per_seed[cols] != ref].merge(reference, on=[rows, "seed"], suffixes=("", " ref"))
    for m in measures:
        paired[m] = paired[m] - paired[f"{m} ref"]
    values = pd.concat([final.loc[final[cols] == ref, [rows, cols, *measures]], paired[[rows, cols, *measures]]])
    keys = [k for k in config_columns(final) if k not in fixed]
    settings = final[[rows, cols]].assign(**{k: final[k].map(text) for k in keys}).groupby([rows, cols]).first()
    differ = set()
    for r, c in paired[[rows, cols]].drop_duplicates().itertuples(index=False):
        a, b = settings.loc[(r, c)], settings.loc[(r, ref)]
        differ |= {k for k in keys if a[k] != b[k]}
    return values, sorted(differ)


def _rounds(final: pd.DataFrame, window: int) -> str:
    if window == 1:
        return "round " + ", ".join(str(int(r)) for r in sorted(final["last_round"].dropna().unique()))
    spans = sorted({(int(a), int(b)) for a, b in zip(final["first_round"], final["last_round"]) if pd.notna(a)})
    return "rounds " + ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in spans)


def read_beside(path: str) -> pd.DataFrame:
    """The ``--beside`` table: row labels in the first column, column labels in the header;
    ``attrs["source"]`` (the file name) goes into the caption."""
    try:
        beside = pd.read_csv(path, index_col=0, comment="#")
    except (OSError, ValueError) as e:
        raise SystemExit(f"--beside {path}: cannot read it as a CSV table ({e})") from None
    beside.attrs["source"] = Path(path).name
    return beside


def _align_beside(beside: pd.DataFrame, row_order: list, col_order: list) -> pd.DataFrame:
    """``beside`` on the table's row and column labels (NaN where it has no value). No shared row
    or column is an error (a wrong file); labels the table lacks are named on stderr, since
    ``--where`` may have dropped them, or they may be typos."""
    beside = beside.rename(index=str, columns=str)
    for axis, labels, ours in (("row", beside.index, row_order), ("column", beside.columns, col_order)):
        known = set(map(text, ours))
        unknown = [x for x in labels if x not in known]
        if len(unknown) == len(labels):
            raise SystemExit(
                f"--beside: none of its {axis}s ({', '.join(map(repr, unknown))}) is a {axis} of the "
                f"table; {axis}s: {', '.join(map(text, ours))}"
            )
        if unknown:
            print(f"--beside: {axis}s not in the table, left out: {', '.join(map(repr, unknown))}", file=sys.stderr)
    return beside.reindex(index=[text(r) for r in row_order], columns=[text(c) for c in col_order])


def paper_table(
    df: pd.DataFrame,
    rows: str = "attack",
    cols: str = "method",
    metric: str = "test_error",
    digits: int = 2,
    window: int = 1,
    diff_to: str | None = None,
    beside: pd.DataFrame | None = None,
) -> tuple[str, pd.DataFrame]:
    """(Markdown, numeric CSV frame) of ``metric`` over each run's last ``window`` evaluations,
    rows x cols; with ``diff_to``, the other columns as per-seed differences to that column;
    with ``beside`` (rows x cols, labelled as the table), its values in parentheses."""
    if window < 1:
        raise SystemExit(f"--final-window must be at least 1, got {window}")
    if beside is not None and diff_to is not None:
        raise SystemExit("--beside and --diff-to cannot be combined: the values beside are not differences")
    metric = metric_column(df, metric)
    final = final_rows(df, metric, window)
    final["method"] = method_labels(final)
    if rows == "attack":
        final["attack"] = final["attack"].map(lambda a: ATTACK_LABELS.get(a, a))
    for axis in (rows, cols):
        if axis not in final:
            raise SystemExit(f"no column {axis!r} in the runs; columns: {', '.join(final.columns)}")
    fixed = {rows, cols, "seed", *METHOD_KEYS} if cols == "method" else {rows, cols, "seed"}
    check_comparable(final, {rows, cols})
    check_cells(final, rows, cols, fixed)
    has_success = metric != SUCCESS and SUCCESS in final and final[SUCCESS].notna().any()
    measures = [metric, SUCCESS] if has_success else [metric]
    row_order = _order(final[rows].unique(), ATTACK_LABELS if rows == "attack" else [])
    col_order = _order(final[cols].unique(), METHOD_ORDER if cols == "method" else [])
    if beside is not None:
        source = beside.attrs.get("source", "the table beside")
        beside = _align_beside(beside, row_order, col_order)
    ref, differ = None, []
    values = final[[rows, cols, *measures]]
    if diff_to is not None:
        ref = next((c for c in col_order if text(c) == diff_to), None)
        if ref is None:
            raise SystemExit(f"--diff-to {diff_to!r}: no such column; columns: {', '.join(map(text, col_order))}")
        values, differ = paired_differences(final, rows, cols, ref, measures, fixed)
    grouped = values.groupby([rows, cols])
    stats = {
        m: {
            s: getattr(grouped[m], s)().unstack(cols).reindex(index=row_order, columns=col_order)
            for s in ("mean", "std", "count")
        }
        for m in measures
    }

    def number(c, x) -> str:
        return f"{x:+.{digits}f}" if ref is not None and c != ref else f"{x:.{digits}f}"

    def cell(r, c) -> str:
        mean, sd, n = (stats[metric][s].at[r, c] for s in ("mean", "std", "count"))
        if pd.isna(mean):
            out = "-"
        else:
            out = number(c, mean) + (f" ± {sd:.{digits}f} ({int(n)})" if n > 1 else "")
            if has_success and pd.notna(stats[SUCCESS]["mean"].at[r, c]):
                out += " / " + number(c, stats[SUCCESS]["mean"].at[r, c])
        other = beside.at[text(r), text(c)] if beside is not None else None
        return out + (f" ({other:.{digits}f})" if pd.notna(other) else "")

    what = metric.removeprefix(f"{METRICS}/").replace("_", " ")
    seeds = final["seed"].nunique() if "seed" in final else 1
    short = int((final["evaluations"] < window).sum())
    caption = (
        (f"Final {what}" if window == 1 else f"{what[:1].upper() + what[1:]}, mean of the last {window} evaluations")
        + f" ({_rounds(final, window)})"
        + (f"; {short} runs have fewer evaluations: all of theirs are used" if short else "")
        + (f"; where measured: {what} / attack success rate" if has_success else "")
        + f". {len(final)} run{'' if len(final) == 1 else 's'}"
        + (f", mean ± sd (n runs) over {seeds} seeds" if seeds > 1 else "")
        + "."
    )
    if beside is not None:
        caption += f" In parentheses: {source}."
    if ref is not None:
        caption += (
            f" Columns other than {text(ref)}: difference to {text(ref)} in the same row, paired by seed, "
            "mean ± sd (n pairs)" + (f"; the paired runs also differ in {', '.join(differ)}" if differ else "") + "."
        )
    head = [rows.capitalize() if rows != "attack" else "Attack", *map(text, col_order)]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([text(r), *(cell(r, c) for c in col_order)]) + " |" for r in row_order]
    return "\n".join(lines) + "\n", _csv(stats, measures, rows, col_order, ref)


def _csv(stats: dict, measures: list[str], rows: str, col_order: list, ref) -> pd.DataFrame:
    """Per column: mean, ``sd``, ``n``; success rates as extra rows."""
    parts = []
    for m in measures:
        frame = pd.DataFrame(index=stats[m]["mean"].index)
        for c in col_order:
            name = text(c) if ref is None or c == ref else f"{text(c)} - {text(ref)}"
            frame[name] = stats[m]["mean"][c]
            frame[f"{name} sd"] = stats[m]["std"][c]
            frame[f"{name} n"] = stats[m]["count"][c].astype("Int64")
        if m == SUCCESS:
            frame = frame[stats[m]["mean"].notna().any(axis=1)]
            frame.index = [f"{r} ({SUCCESS.replace('_', ' ')})" for r in frame.index]
        parts.append(frame)
    csv = pd.concat(parts)
    csv.index.name = rows
    return csv


def write_outputs(markdown: str, csv: pd.DataFrame, prefix: str | None) -> None:
    """Print the Markdown; with ``prefix``, also write ``PREFIX.md`` and ``PREFIX.csv``."""
    print(markdown)
    if prefix:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.md").write_text(markdown)
        csv.to_csv(f"{prefix}.csv")
        print(f"wrote {prefix}.md, {prefix}.csv")


def selected_runs(paths: list[str], where: list[str], nothing: str) -> pd.DataFrame | None:
    """The complete training runs under ``paths`` that ``where`` keeps, skipped files reported
    and the settings that vary named on stderr; None, after printing ``nothing``, if none is left."""
    df, skipped = load_runs(paths)
    report_skipped(skipped)
    df = apply_where(df, where)
    if df.empty:
        print(nothing, file=sys.stderr)
        return None
    say_varying(df.drop_duplicates("run"))
    return df


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_final_window(p: argparse.ArgumentParser) -> None:
    """``--final-window K``: a run's value is the mean of its last K evaluations."""
    p.add_argument(
        "--final-window",
        type=_positive,
        default=1,
        metavar="K",
        help="a run's value is the mean of its last K evaluations (default 1: the final one)",
    )


def main_table(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis table",
        description="Paper-layout table of training runs: a final metric, rows x columns, "
        "mean ± sd (n) over seeds, or paired differences to one column.",
    )
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.csv")
    p.add_argument("--rows", default="attack", help="column for the rows (default attack)")
    p.add_argument("--cols", default="method", help="column for the columns (default method: the defence)")
    p.add_argument(
        "--metric",
        default="test_error",
        help="metric in the cells: test_error (default), test_accuracy or any /metrics column",
    )
    add_final_window(p)
    p.add_argument(
        "--diff-to",
        metavar="COLUMN",
        help="show every other column as the per-seed paired difference to this column (e.g. BRACE)",
    )
    p.add_argument(
        "--beside",
        metavar="FILE.csv",
        help="show this table's values (same row and column labels) in parentheses, e.g. the paper's",
    )
    p.add_argument("--digits", type=int, default=2)
    add_where(p)
    args = p.parse_args(argv)
    beside = read_beside(args.beside) if args.beside else None
    df = selected_runs(args.paths, args.where, "no complete training runs to tabulate")
    if df is None:
        return 1
    write_outputs(
        *paper_table(df, args.rows, args.cols, args.metric, args.digits, args.final_window, args.diff_to, beside),
        args.out,
    )
    return 0
