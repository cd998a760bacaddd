"""Figures as PNG (matplotlib, Agg backend: no display needed).

- ``plot-accuracy``: test accuracy vs round, one line per defence (mean over seeds), one
  panel per attack when the runs cover several.
- ``plot-bytes``: bytes a client sends per round vs the number of clients, one line per ring
  method (RAR, BRACE, ...) and one for the server architecture, whose server node's traffic
  (dashed) grows with the clients: the bandwidth-optimality picture of the BRACE paper.
- ``plot-conformal``: coverage (with the 1 - alpha target) and width per method.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import AGGREGATOR_LABELS, ATTACK_LABELS  # noqa: E402
from .load import load_runs, report_skipped  # noqa: E402
from .tables import _order, apply_where, conformal_columns, load_conformal, method_labels, text  # noqa: E402


def _save(fig, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")


def plot_accuracy(df: pd.DataFrame, out: str) -> None:
    df = df.assign(method=method_labels(df))
    attacks = _order(df["attack"].map(lambda a: ATTACK_LABELS.get(a, a)).unique(), ATTACK_LABELS) if "attack" in df else [None]
    methods = _order(df["method"].unique(), {v: v for v in AGGREGATOR_LABELS.values()})
    ncols = min(3, len(attacks))
    nrows = math.ceil(len(attacks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), sharex=True, sharey=True, squeeze=False)
    for ax, attack in zip(axes.flat, attacks):
        part = df if attack is None else df[df["attack"].map(lambda a: ATTACK_LABELS.get(a, a)) == attack]
        for m in methods:
            curve = part[part["method"] == m].groupby("round")["test_accuracy"].mean()
            if len(curve):
                ax.plot(curve.index, curve.values, label=m, marker="." if len(curve) < 30 else None)
        ax.set_title(attack or "test accuracy")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(attacks):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.08 / nrows, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7))
    _save(fig, out)


def traffic(df: pd.DataFrame) -> pd.DataFrame:
    """Per (architecture, clients): bytes per client per round and, for the server, the server's."""
    runs = df.drop_duplicates("run").assign(method=lambda r: method_labels(r))
    runs["architecture"] = runs["method"].where(runs["topology"] == "ring", "Server")
    return (runs.groupby(["architecture", "n_clients"])[["bytes_per_client_round", "server_bytes_per_round"]]
            .median().reset_index())


def plot_bytes(df: pd.DataFrame, out: str) -> None:
    t = traffic(df)
    fig, ax = plt.subplots(figsize=(6, 4))
    order = _order(t["architecture"].unique(), {v: v for v in [*AGGREGATOR_LABELS.values(), "Server"]})
    for arch in order:
        part = t[t["architecture"] == arch].sort_values("n_clients")
        line, = ax.plot(part["n_clients"], part["bytes_per_client_round"], marker="o",
                        label=f"{arch}: each client" if arch == "Server" else arch)
        if arch == "Server":
            ax.plot(part["n_clients"], part["server_bytes_per_round"], marker="s", linestyle="--",
                    color=line.get_color(), label="Server: the server node")
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
    columns = conformal_columns(df)
    labels = [", ".join(text(r[c]) if c == "method" else f"{c}={text(r[c])}" for c in columns if text(r[c]))
              for _, r in df.iterrows()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.35 * len(df) + 1.5), sharey=True)
    y = range(len(df))
    a.barh(y, 100 * df["coverage"], xerr=100 * df["coverage_sd"], color="tab:blue", alpha=0.8)
    for alpha in (df["alpha"].unique() if "alpha" in df else []):
        a.axvline(100 * (1 - alpha), color="k", linestyle="--", label=f"target {100 * (1 - alpha):g}%")
    a.set_xlabel("coverage (%)")
    a.set_yticks(list(y), labels)
    a.invert_yaxis()
    if "alpha" in df:
        a.legend(loc="lower left")
    b.barh(y, df["width"], xerr=df["width_sd"], color="tab:orange", alpha=0.8)
    b.set_xlabel("width (interval width or set size)")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    _save(fig, out)


def _parser(prog: str, what: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m analysis {prog}", description=what)
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="keep only runs with this setting")
    return p


def _runs(args) -> pd.DataFrame | None:
    df, skipped = load_runs(args.paths)
    report_skipped(skipped)
    df = apply_where(df, args.where)
    if df.empty:
        print("no complete training runs to plot", file=sys.stderr)
        return None
    return df


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


def main_conformal(argv: list[str]) -> int:
    p = _parser("plot-conformal", "Coverage and width per conformal method.")
    args = p.parse_args(argv)
    df, skipped = load_conformal(args.paths)
    report_skipped(skipped)
    df = apply_where(df, args.where) if len(df) else df
    if df.empty:
        print("no complete conformal runs to plot", file=sys.stderr)
        return 1
    plot_conformal(df, args.out)
    return 0
