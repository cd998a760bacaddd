"""Worst-case tuning (ByzFL's protocol): ``python -m analysis worst-case``.

For each defence (``--by``, default ``aggregator``: the defence's label as ``table`` names its
columns), every setting of the tuned keys (``--tune lr[,KEY...]``) is scored by its worst case
over the attacks present::

    score(setting) = min over attacks a of  mean over seeds s of  final_validation_accuracy(setting, a, s)

where a run's final value is the mean of its last K evaluations (``--final-window K``, default
1: the last one). The defence's chosen setting is the one with the highest score; ties go to
the higher mean over attacks of the same per-attack means, then to the smallest values of the
tuned keys (numbers compared as numbers, in the order the keys are given to ``--tune``). The
table reports, for every defence, the chosen setting, its score and the attack that attains it,
and its **test** accuracy under every attack, ``mean ± sd (n)`` over seeds.

When the runs have no validation split (``validation = 0``: no ``/metrics/validation_accuracy``)
the setting is chosen on test accuracy, with a one-line warning on stderr: then the reported
numbers are optimistic (chosen and reported on the same data). Runs of which only some have a
validation split are refused. A setting that lacks an attack its defence is run under is refused
(its minimum would be over fewer attacks), as is a cell (defence, setting, attack) whose runs
differ in anything but the seed, as ``table`` refuses it (``--where KEY=VALUE`` narrows).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from . import ATTACK_LABELS, METHOD_ORDER
from .tables import (
    METHOD_KEYS,
    _order,
    _rounds,
    add_final_window,
    add_where,
    check_cells,
    check_comparable,
    config_columns,
    final_rows,
    method_labels,
    selected_runs,
    text,
    write_outputs,
)

VALIDATION = "validation_accuracy"
TEST = "test_accuracy"


@dataclass
class WorstCase:
    """The outcome of :func:`worst_case`."""

    #: per defence (index, in table order): the tuned keys' chosen values (text), ``score``, ``worst attack``
    choice: pd.DataFrame
    #: test accuracy at the chosen setting, defence x attack: ``mean``, ``std``, ``count`` over seeds
    test: dict[str, pd.DataFrame]
    #: the metric the setting was chosen on: validation_accuracy, or test_accuracy (fallback)
    selected_on: str
    #: one row per run used (settings, final values, ``defence``, ``attack`` labels)
    final: pd.DataFrame


def _tie_key(value: str) -> tuple:
    """Numbers before words, numbers by value."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def selection_metric(df: pd.DataFrame) -> str:
    """validation_accuracy when every run has it, test_accuracy (warned on stderr) when none has."""
    has = df.groupby("run")[VALIDATION].apply(lambda v: v.notna().any()) if VALIDATION in df else None
    if has is not None and has.all():
        return VALIDATION
    if has is not None and has.any():
        raise SystemExit(
            f"{int(has.sum())} runs have a validation split and {int((~has).sum())} do not "
            f"(e.g. {has[~has].index[0]}): choose with --where validation=VALUE"
        )
    print(
        "warning: the runs have no validation split (/metrics/validation_accuracy): "
        "the setting is chosen on test accuracy, the data it is reported on",
        file=sys.stderr,
    )
    return TEST


def defence_rows(df: pd.DataFrame, by: str, metric: str, window: int, tune: Sequence[str] = ()) -> pd.DataFrame:
    """:func:`final_rows` of ``metric`` with the ``defence`` and ``attack`` labels (and the tuned keys) as
    text; refused (SystemExit) where a cell (defence, tuned values, attack) mixes runs that differ
    in anything but the seed."""
    final = final_rows(df, metric, window)
    final["defence"] = method_labels(final) if by == "aggregator" else final[by].map(text)
    final["attack"] = final["attack"].map(lambda a: ATTACK_LABELS.get(a, a))
    for key in tune:
        final[key] = final[key].map(lambda v: text(v) or "unset")
    fixed = {"defence", "attack", "seed", by, *tune, *(METHOD_KEYS if by == "aggregator" else ())}
    check_comparable(final, {by, "attack", *tune})
    check_cells(final, "defence", "attack", fixed, *tune)
    return final


def warn_uneven_seeds(final: pd.DataFrame, cell: list[str]) -> None:
    """A warning on stderr where some seeds are in only some cells (a grid's seed half run): those
    cells average other seeds than the rest, and a worst case compares them as if they did not."""
    if "seed" not in final:
        return
    seeds = final.groupby(cell)["seed"].agg(lambda v: frozenset(v.map(text)))
    partial = sorted(frozenset.union(*seeds) - frozenset.intersection(*seeds), key=_tie_key)
    if partial:
        every = sorted(frozenset.intersection(*seeds), key=_tie_key)
        have = {s: int(seeds.map(lambda c, s=s: s in c).sum()) for s in partial}
        print(
            f"warning: seed {', '.join(f'{s} in {have[s]}' for s in partial)} of the {len(seeds)} cells "
            f"({', '.join(cell)}): the cells average different seeds"
            + (f"; name the seeds in every cell with {' '.join(f'--where seed={s}' for s in every)}" if every else ""),
            file=sys.stderr,
        )


def defence_order(final: pd.DataFrame, by: str) -> list:
    return _order(final["defence"].unique(), METHOD_ORDER if by == "aggregator" else [])


def worst_case(df: pd.DataFrame, by: str = "aggregator", tune: Sequence[str] = ("lr",), window: int = 1) -> WorstCase:
    """Each defence's setting of ``tune`` with the best worst-case accuracy over the attacks (module docstring)."""
    tune = list(tune)
    if window < 1:
        raise SystemExit(f"--final-window must be at least 1, got {window}")
    settings = config_columns(df)
    for key in [by, *tune]:
        if key not in settings:
            raise SystemExit(f"{key!r}: not a setting of these runs; settings: {', '.join(settings)}")
    if by in tune or "attack" in [by, *tune]:
        raise SystemExit(f"--by {by} and --tune {','.join(tune)}: a key can be only one of defence, tuned, attack")
    select = selection_metric(df)
    final = defence_rows(df, by, TEST, window, tune)
    warn_uneven_seeds(final, ["defence", *tune, "attack"])
    if select != TEST:
        final[select] = final["run"].map(final_rows(df, select, window).set_index("run")[select])

    per_attack = final.groupby(["defence", *tune, "attack"])[select].mean()
    scores = per_attack.groupby(["defence", *tune]).agg(["min", "mean", "idxmin", "count"])
    attacks_of = final.groupby("defence")["attack"].unique()
    rows = []
    for defence in defence_order(final, by):
        candidates = scores.loc[[defence]].reset_index()
        short = candidates[candidates["count"] < len(attacks_of[defence])]
        if len(short):
            setting = ", ".join(f"{k}={short[k].iloc[0]}" for k in tune)
            ran = set(per_attack.loc[tuple([defence, *short[tune].iloc[0]])].index)
            missing = sorted(set(attacks_of[defence]) - ran)
            raise SystemExit(
                f"{defence} at {setting} has no runs under {', '.join(missing)}, which its other settings have: "
                "its worst case would be over fewer attacks"
            )
        candidates["tie"] = candidates[tune].apply(lambda r: tuple(_tie_key(v) for v in r), axis=1)
        best = candidates.sort_values("tie").sort_values(["min", "mean"], ascending=False, kind="stable").iloc[0]
        rows.append(
            {"defence": defence, **{k: best[k] for k in tune}, "score": best["min"], "worst attack": best["idxmin"][-1]}
        )
    choice = pd.DataFrame(rows).set_index("defence")
    chosen = final.merge(choice[tune].reset_index(), on=["defence", *tune])
    grouped = chosen.groupby(["defence", "attack"])[TEST]
    attacks = _order(final["attack"].unique(), ATTACK_LABELS)
    test = {
        s: getattr(grouped, s)().unstack("attack").reindex(index=choice.index, columns=attacks)
        for s in ("mean", "std", "count")
    }
    return WorstCase(choice, test, select, final)


def worst_case_table(result: WorstCase, tune: list[str], window: int, digits: int = 2) -> tuple[str, pd.DataFrame]:
    """(Markdown, CSV frame) of :func:`worst_case`'s outcome: a row per defence."""
    choice, test, final = result.choice, result.test, result.final
    on = result.selected_on.replace("_", " ")
    attacks = list(test["mean"].columns)

    def cell(d, a) -> str:
        mean, sd, n = (test[s].at[d, a] for s in ("mean", "std", "count"))
        if pd.isna(mean):
            return "-"
        return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f} ({int(n)})" if n > 1 else "")

    seeds = final["seed"].nunique() if "seed" in final else 1
    value = "final value" if window == 1 else f"mean of the last {window} evaluations"
    caption = (
        f"Test accuracy at each defence's {', '.join(tune)} with the best worst-case {on} over the "
        f"{len(attacks)} attacks (score: the lowest over attacks of the mean over seeds of each run's {value}, "
        f"{_rounds(final, window)}; ties: higher mean over attacks, then smaller {', '.join(tune)}). "
        f"{len(final)} runs" + (f"; cells: mean ± sd (n runs) over {seeds} seeds" if seeds > 1 else "") + "."
    )
    head = ["Defence", *tune, f"worst-case {on}", "worst attack", *attacks]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, r in choice.iterrows():
        row = [text(d), *(r[k] for k in tune), f"{r['score']:.{digits}f}", r["worst attack"]]
        lines.append("| " + " | ".join([*row, *(cell(d, a) for a in attacks)]) + " |")
    csv = choice.rename(columns={"score": f"worst-case {result.selected_on}"})
    for a in attacks:
        csv[a] = test["mean"][a]
        csv[f"{a} sd"] = test["std"][a]
        csv[f"{a} n"] = test["count"][a].astype("Int64")
    return "\n".join(lines) + "\n", csv


def tune_keys(value: str) -> list[str]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    if not keys:
        raise argparse.ArgumentTypeError("expected KEY[,KEY...], e.g. lr or lr,momentum")
    return keys


def add_protocol_options(p: argparse.ArgumentParser, tune_required: bool) -> None:
    """The options ``worst-case`` and ``heatmap`` share."""
    p.add_argument(
        "paths", nargs="+", metavar="FILE|DIR", help="results files, directories, or a tidy CSV (load --out)"
    )
    p.add_argument(
        "--by", default="aggregator", help="the defence: aggregator (default; the label table uses) or any setting"
    )
    p.add_argument(
        "--tune",
        type=tune_keys,
        required=tune_required,
        metavar="KEY[,KEY...]",
        help="the settings chosen per defence by their worst case over the attacks, e.g. lr",
    )
    add_final_window(p)
    add_where(p)


def load_selected(args) -> pd.DataFrame | None:
    return selected_runs(args.paths, args.where, "no complete training runs")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis worst-case",
        description="Per defence, the setting of the tuned keys with the best worst-case validation accuracy "
        "over the attacks, and its test accuracy under every attack (ByzFL's protocol).",
    )
    add_protocol_options(p, tune_required=True)
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.md and PREFIX.csv")
    p.add_argument("--digits", type=int, default=2)
    args = p.parse_args(argv)
    df = load_selected(args)
    if df is None:
        return 1
    result = worst_case(df, args.by, args.tune, args.final_window)
    write_outputs(*worst_case_table(result, args.tune, args.final_window, args.digits), args.out)
    return 0
