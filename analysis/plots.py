"""Figures as PNG (matplotlib, Agg backend: no display needed).

- ``plot-accuracy``: test accuracy vs round, a panel per attack, a line per defence (mean over
  seeds, the band from the lowest to the highest seed), one colour per defence in every panel;
  a line whose runs differ in anything but the seed is refused as ``table`` refuses its cell.
- ``plot-bytes``: bytes a client sends per round vs the number of clients, one line per ring
  method (RAR, BRACE, ...) and one for the server architecture, whose server node's traffic
  (dashed) grows with the clients: the bandwidth-optimality picture of the BRACE paper.
- ``plot-drift``: the sign rules' drift diagnostics, a line per run (labelled by method, and
  lr schedule when the runs differ in it): ``/metrics/weight_mean_change`` (mean of w_t - w_0)
  at each evaluation, and the +/-/0 consensus fractions of every round
  (``/ring/plus_fraction``, ``minus_fraction``, ``zero_fraction``; moving average of
  ``--smooth`` rounds) for the runs that have them.
- ``heatmap``: defence x attack heatmaps of the test accuracy at each defence's worst-case-tuned
  setting (:mod:`analysis.worst_case`) or of a final metric, one per Byzantine share, and a
  defence x Byzantine share heatmap of the worst case over attacks when the share varies.
- ``plot-conformal``: coverage (with the 1 - alpha target) and size (interval width or set
  size) per case of the conformal runs (:mod:`analysis.conformal`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib
import matplotlib.colors
import matplotlib.lines

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from . import ATTACK_LABELS, METHOD_ORDER
from .conformal import case_columns, conformal_cases, size_label
from .load import load_runs, report_skipped, ring_rows
from .tables import (
    METHOD_KEYS,
    ONE_PER_TABLE,
    _order,
    add_where,
    apply_where,
    check_cells,
    check_comparable,
    method_labels,
    metric_column,
    selected_runs,
    text,
)
from .worst_case import add_protocol_options, defence_order, defence_rows, load_selected, worst_case


def _save(fig, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")


def method_colors(methods: list[str]) -> dict[str, str]:
    """One colour per method, the same in every panel (tab10, then tab20 for more than 10)."""
    palette = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors
    return {m: matplotlib.colors.to_hex(palette[i % len(palette)]) for i, m in enumerate(methods)}


def plot_accuracy(df: pd.DataFrame, out: str) -> None:
    """A panel per attack, a line per defence: the mean over seeds, the band from the lowest to
    the highest seed; every run of a line shares every setting but the seed (else SystemExit)."""
    df = df.assign(method=method_labels(df), attack=df["attack"].map(lambda a: ATTACK_LABELS.get(a, a)))
    runs = df.drop_duplicates("run")
    check_comparable(runs, {"attack"})
    check_cells(runs, "attack", "method", {"attack", "method", "seed", *METHOD_KEYS})
    attacks = _order(df["attack"].unique(), ATTACK_LABELS)
    methods = _order(df["method"].unique(), METHOD_ORDER)
    colors = method_colors(methods)
    ncols = min(3, len(attacks))
    nrows = math.ceil(len(attacks) / ncols)
    legend_rows = math.ceil(len(methods) / 6)
    height = 3.2 * nrows + 0.3 + 0.3 * legend_rows  # inches: the panels, the title, the legend below
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, height), sharex=True, sharey=True, squeeze=False)
    seeds = 1
    for ax, attack in zip(axes.flat, attacks):
        part = df[df["attack"] == attack]
        for m in methods:
            runs_of = part[part["method"] == m].pivot_table(index="round", columns="run", values="test_accuracy")
            if runs_of.empty:
                continue
            seeds = max(seeds, runs_of.shape[1])
            mean = runs_of.mean(axis=1)
            ax.plot(mean.index, mean.values, color=colors[m], label=m, marker="." if len(mean) < 30 else None)
            if runs_of.shape[1] > 1:
                ax.fill_between(
                    runs_of.index, runs_of.min(axis=1), runs_of.max(axis=1), color=colors[m], alpha=0.2, linewidth=0
                )
        ax.set_title(attack)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(attacks) :]:
        ax.set_visible(False)
    for ax in axes.flat:
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.tick_params(labelbottom=True, labelleft=True)
    handles = [matplotlib.lines.Line2D([], [], color=colors[m], label=m) for m in methods]
    setting = ", ".join(f"{key} {text(runs[key].iloc[0])}" for key in ONE_PER_TABLE if key in runs)
    spread = (
        f"line: mean over seeds; band: lowest to highest of up to {seeds} seeds" if seeds > 1 else "one seed per line"
    )
    fig.suptitle(f"Test accuracy ({setting}; {spread})", fontsize=10)
    fig.tight_layout(rect=(0, (0.1 + 0.3 * legend_rows) / height, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(methods), 6))
    _save(fig, out)


def traffic(df: pd.DataFrame) -> pd.DataFrame:
    """Per (architecture, clients): bytes per client per round and, for the server, the server's."""
    runs = df.drop_duplicates("run").assign(method=lambda r: method_labels(r))
    runs["architecture"] = runs["method"].where(runs["topology"] == "ring", "Server")
    return (
        runs.groupby(["architecture", "n_clients"])[["bytes_per_client_round", "server_bytes_per_round"]]
        .median()
        .reset_index()
    )


def plot_bytes(df: pd.DataFrame, out: str) -> None:
    check_comparable(df.drop_duplicates("run"), {"clients"})
    t = traffic(df)
    fig, ax = plt.subplots(figsize=(6, 4))
    order = _order(t["architecture"].unique(), [*METHOD_ORDER, "Server"])
    for arch in order:
        part = t[t["architecture"] == arch].sort_values("n_clients")
        (line,) = ax.plot(
            part["n_clients"],
            part["bytes_per_client_round"],
            marker="o",
            label=f"{arch}: each client" if arch == "Server" else arch,
        )
        if arch == "Server":
            ax.plot(
                part["n_clients"],
                part["server_bytes_per_round"],
                marker="s",
                linestyle="--",
                color=line.get_color(),
                label="Server: the server node",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted(t["n_clients"].unique()), [str(n) for n in sorted(t["n_clients"].unique())])
    ax.minorticks_off()
    ax.set_xlabel("clients")
    ax.set_ylabel("bytes sent per round")
    ax.set_title("Traffic per round vs number of clients")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    _save(fig, out)


def plot_conformal(df: pd.DataFrame, out: str) -> None:
    columns = case_columns(df)
    labels = [
        ", ".join(text(r[c]) if c in ("label", "method", "run") else f"{c}={text(r[c])}" for c in columns if text(r[c]))
        for _, r in df.iterrows()
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.35 * len(df) + 1.5), sharey=True)
    y = range(len(df))
    a.barh(y, 100 * df["coverage"], xerr=100 * df["coverage_sd"], color="tab:blue", alpha=0.8)
    for alpha in df["alpha"].unique():
        a.axvline(100 * (1 - alpha), color="k", linestyle="--", label=f"target {100 * (1 - alpha):g}%")
    a.set_xlabel("coverage (%)")
    a.set_yticks(list(y), labels)
    a.invert_yaxis()
    a.legend(loc="lower left")
    b.barh(y, df["size"], xerr=df["size_sd"], color="tab:orange", alpha=0.8)
    size = size_label(df)
    b.set_xlabel(size if size != "size" else "size (interval width or set size)")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    _save(fig, out)


FRACTIONS = {"plus_fraction": ("+1", "-"), "minus_fraction": ("-1", "--"), "zero_fraction": ("0", ":")}


def drift_labels(runs: pd.DataFrame) -> pd.Series:
    """A label per run (one row each): the method, the lr schedule when the runs differ in it,
    and the run's name when that still leaves two runs alike."""
    label = method_labels(runs)
    if "lr_schedule" in runs and runs["lr_schedule"].map(text).nunique() > 1:
        label = label + ", lr " + runs["lr_schedule"].map(text)
    alike = label.duplicated(keep=False)
    return label.where(~alike, label + " [" + runs["run"] + "]")


def plot_drift(df: pd.DataFrame, out: str, smooth: int = 0) -> dict[str, str]:
    """The drift figure of the runs of ``df`` (load_runs rows); returns each run's label."""
    runs = df.drop_duplicates("run").reset_index(drop=True)
    labels = dict(zip(runs["run"], drift_labels(runs)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    with_fractions = 0
    for i, r in runs.iterrows():
        color, label = colors[i % len(colors)], labels[r["run"]]
        part = df[df["run"] == r["run"]].sort_values("round")
        if "weight_mean_change" in part and part["weight_mean_change"].notna().any():
            a.plot(
                part["round"],
                part["weight_mean_change"],
                color=color,
                label=label,
                marker="." if len(part) < 30 else None,
            )
        rows = ring_rows(r["file"])
        if not set(FRACTIONS) & set(rows.columns):
            continue
        with_fractions += 1
        window = smooth or max(1, min(25, len(rows) // 50))
        for name, (_, style) in FRACTIONS.items():
            if name in rows:
                b.plot(
                    rows["round"],
                    rows[name].rolling(window, min_periods=1).mean(),
                    color=color,
                    linestyle=style,
                    label=label if name == "plus_fraction" else None,
                )
    a.set_title("weight mean change (mean of $w_t - w_0$)")
    a.set_xlabel("round")
    a.axhline(0, color="k", linewidth=0.5)
    b.set_title("consensus fractions (+1 solid, -1 dashed, 0 dotted)")
    b.set_xlabel("round")
    b.set_ylim(-0.02, 1.02)
    if not with_fractions:
        b.text(
            0.5,
            0.5,
            "no /ring/*_fraction in these runs\n(only the sign rules record them)",
            ha="center",
            va="center",
            transform=b.transAxes,
        )
    for ax in (a, b):
        ax.grid(alpha=0.3)
    handles, names = a.get_legend_handles_labels()
    more = [(h, n) for h, n in zip(*b.get_legend_handles_labels()) if n not in names]
    handles, names = handles + [h for h, _ in more], names + [n for _, n in more]
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if names:
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 4))
    _save(fig, out)
    return labels


def _parser(prog: str, what: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m analysis {prog}", description=what)
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", required=True, metavar="FILE.png")
    add_where(p)
    return p


def _runs(args) -> pd.DataFrame | None:
    return selected_runs(args.paths, args.where, "no complete training runs to plot")


def main_accuracy(argv: list[str]) -> int:
    args = _parser("plot-accuracy", "Test accuracy vs round per defence (a panel per attack).").parse_args(argv)
    df = _runs(args)
    if df is None:
        return 1
    plot_accuracy(df, args.out)
    return 0


def main_bytes(argv: list[str]) -> int:
    args = _parser("plot-bytes", "Bytes per client per round vs number of clients.").parse_args(argv)
    df = _runs(args)
    if df is None:
        return 1
    plot_bytes(df, args.out)
    print(traffic(df).to_string(index=False))
    return 0


def main_drift(argv: list[str]) -> int:
    p = _parser("plot-drift", "Weight mean change and the +/-/0 consensus fractions vs round, a line per run.")
    p.add_argument(
        "--smooth",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="moving average of the per-round fractions (default: about 2%% of the rounds, at most 25)",
    )
    p.add_argument("--all", action="store_true", help="keep runs that did not complete (preempted, failed)")
    args = p.parse_args(argv)
    df, skipped = load_runs(args.paths, args.all)
    report_skipped(skipped)
    df = apply_where(df, args.where)
    if df.empty:
        print("no training runs to plot", file=sys.stderr)
        return 1
    for run, label in plot_drift(df, args.out, args.smooth).items():
        print(f"{label}: {run}")
    return 0


def main_conformal(argv: list[str]) -> int:
    p = _parser("plot-conformal", "Coverage and interval width / set size per conformal case (/calibration).")
    args = p.parse_args(argv)
    df = conformal_cases(args.paths, args.where)
    if df.empty:
        print("no complete conformal runs to plot", file=sys.stderr)
        return 1
    plot_conformal(df, args.out)
    return 0


def share_label(share) -> str:
    """A Byzantine share as a heatmap label: a fraction as a percentage, a count as it is."""
    return f"{100 * share:g} %" if share < 1 else f"{share:g} clients"


def heatmap_panels(
    df: pd.DataFrame,
    by: str = "aggregator",
    tune: list[str] | None = None,
    metric: str = "test_accuracy",
    window: int = 1,
) -> dict[str, pd.DataFrame]:
    """The heatmaps' values, title -> defence x column frame: per Byzantine share a defence x attack
    panel (test accuracy at the worst-case-tuned setting with ``tune``, else ``metric``'s mean over
    seeds), and with several shares a defence x share panel of each row's lowest value over attacks."""
    shares = sorted(df["byzantine"].unique()) if "byzantine" in df else [None]
    panels, worst = {}, {}
    for share in shares:
        part = df if share is None else df[df["byzantine"] == share]
        if tune:
            result = worst_case(part, by, tune, window)
            values = result.test["mean"]
            values.attrs["selected_on"] = result.selected_on.replace("_", " ")
            values.attrs["setting"] = {d: ", ".join(f"{k} {r[k]}" for k in tune) for d, r in result.choice.iterrows()}
        else:
            final = defence_rows(part, by, metric_column(part, metric), window)
            values = final.groupby(["defence", "attack"])[metric_column(part, metric)].mean().unstack("attack")
            values = values.reindex(
                index=defence_order(final, by), columns=_order(final["attack"].unique(), ATTACK_LABELS)
            )
            # an attack that does not measure the metric (no success rate without a backdoor) has no column
            values = values.dropna(axis=1, how="all")
        title = "defence x attack" + (f", Byzantine {share_label(share)}" if share is not None else "")
        panels[title] = values
        worst[share_label(share) if share is not None else ""] = values.min(axis=1)
    if len(shares) > 1:
        panels["defence x Byzantine share: worst case over attacks"] = pd.DataFrame(worst)
    return panels


def plot_heatmap(
    df: pd.DataFrame,
    out: str,
    by: str = "aggregator",
    tune: list[str] | None = None,
    metric: str = "test_accuracy",
    window: int = 1,
) -> dict[str, pd.DataFrame]:
    """Draw :func:`heatmap_panels` side by side, one colour scale, every cell annotated; returns the panels."""
    panels = heatmap_panels(df, by, tune, metric, window)
    widths = [max(2.0, 1.0 * frame.shape[1]) for frame in panels.values()]
    n_rows = max(frame.shape[0] for frame in panels.values())
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(sum(widths) + 2.6 * len(panels) + 1.0, 0.5 * n_rows + 2.4),
        gridspec_kw={"width_ratios": widths},
        squeeze=False,
        layout="constrained",
    )
    values = pd.concat([frame.stack() for frame in panels.values()])
    bounded = metric.endswith(("accuracy", "error", "rate")) or bool(tune)
    low, high = (0.0, 1.0) if bounded else (float(values.min()), float(values.max()))
    cmap = plt.get_cmap("viridis")
    for ax, (title, frame) in zip(axes.flat, panels.items()):
        image = ax.imshow(frame.to_numpy(dtype=float), cmap=cmap, vmin=low, vmax=high, aspect="auto")
        for (i, j), v in pd.DataFrame(frame.to_numpy(dtype=float)).stack().items():
            shade = (v - low) / (high - low) if high > low else 0.5
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9, color="black" if shade > 0.6 else "white")
        attacks = "Byzantine share" not in title
        ax.set_xticks(
            range(frame.shape[1]), [text(c).removesuffix(" attack") if c != "no attack" else c for c in frame.columns]
        )
        setting = frame.attrs.get("setting", {})
        ax.set_yticks(range(frame.shape[0]), [f"{r}\n({setting[r]})" if r in setting else text(r) for r in frame.index])
        ax.set_xlabel("attack" if attacks else "Byzantine share")
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.set_title(title, fontsize=10)
    what = metric.replace("_", " ") if not tune else "test accuracy"
    window_text = "final evaluation" if window == 1 else f"mean of the last {window} evaluations"
    seeds = df["seed"].nunique() if "seed" in df else 1
    if seeds > 1:
        window_text += f", mean over {seeds} seeds"
    fig.colorbar(image, ax=list(axes.flat), label=f"{what} ({window_text})", fraction=0.04, pad=0.02)
    if tune:
        fig.suptitle(
            f"Test accuracy at each defence's {', '.join(tune)} (in parentheses) with the best worst-case "
            f"{next(iter(panels.values())).attrs['selected_on']} over the attacks",
            fontsize=10,
        )
    _save(fig, out)
    return panels


def main_heatmap(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis heatmap",
        description="Defence x attack (and defence x Byzantine share) heatmaps: test accuracy at the "
        "worst-case-tuned setting (--tune), or a final metric's mean over seeds.",
    )
    add_protocol_options(p, tune_required=False)
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument(
        "--metric", default="test_accuracy", help="without --tune: the metric in the cells (default test_accuracy)"
    )
    args = p.parse_args(argv)
    df = load_selected(args)
    if df is None:
        return 1
    for title, frame in plot_heatmap(df, args.out, args.by, args.tune, args.metric, args.final_window).items():
        print(f"{title}:\n{frame.to_string(float_format=lambda v: f'{v:.4f}')}\n")
    return 0
