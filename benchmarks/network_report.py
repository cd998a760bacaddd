"""Tables and the scalability plot of ``python -m fedring bench network`` records (benchmarks/network.sh).

    python benchmarks/network_report.py docs/measured/network/*.json --csv docs/measured/network.csv \\
        --plot docs/measured/network-scaling.png

Prints, as markdown: per cluster and size, each op's time over its bound and the ring's time
over BRACE's; the link bytes over the ledger's; and, at the largest size measured on every
node count, the server's and the ring's seconds against the number of nodes (the plot).
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

SIGN_OPS = ["brace", "brace_symmetric", "signsgd", "rlr"]


def load(paths: list[str]) -> pd.DataFrame:
    records = []
    for path in paths:
        with open(path) as f:
            records += json.load(f)
    df = pd.DataFrame(records)
    df["ledger_bytes"] = df["ledger_bytes"].astype("Int64")  # exact counts; None for native
    df["ratio"] = df["seconds"] / df["bound_seconds"]
    df["rate"] = df["rate_bps"].map(lambda b: f"{b / 1e9:g} Gbit/s")
    return df.sort_values(["rate_bps", "wait", "ranks_per_node", "nodes", "elements"])


def ratio_table(df: pd.DataFrame) -> str:
    """x bound per op; ring seconds / BRACE seconds."""
    rows = [
        "| rate | nodes x ranks | wait | elements | "
        + " | ".join(f"{op} / bound" for op in ["ring", "native", *SIGN_OPS, "server"])
        + " | ring s / brace s |",
        "|" + "---|" * 12,
    ]
    for key, g in df.groupby(["rate_bps", "nodes", "ranks_per_node", "wait", "elements"], sort=False):
        by = g.set_index("op")
        cells = [
            f"{by.at[op, 'ratio']:.2f}" if op in by.index else "" for op in ["ring", "native", *SIGN_OPS, "server"]
        ]
        speed = (
            f"{by.at['ring', 'seconds'] / by.at['brace', 'seconds']:.1f}" if {"ring", "brace"} <= set(by.index) else ""
        )
        rows.append(
            f"| {g['rate'].iat[0]} | {key[1]} x {key[2]} | {key[3]} | 2^{int(key[4]).bit_length() - 1} | "
            + " | ".join(cells)
            + f" | {speed} |"
        )
    return "\n".join(rows)


def wire_table(df: pd.DataFrame) -> str:
    """The kernel's bytes on the links over the ledger's, per op (range over clusters and sizes)."""
    d = df[df["ledger_bytes"].notna()].copy()
    d["wire"] = d["link_bytes"] / d["ledger_bytes"]
    g = d.groupby("op", sort=False)["wire"].agg(["min", "max"])
    return "\n".join(
        ["| op | link bytes / ledger bytes |", "|---|---|"]
        + [f"| {op} | {r['min']:.4f} – {r['max']:.4f} |" for op, r in g.iterrows()]
    )


def scaling(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Seconds of server, ring and BRACE against nodes, at 1 Gbit/s (or the lowest rate) and the
    largest size measured at every node count, with the wait policy measured on the most clusters
    (the matrix measures the default on all)."""
    clusters = df.groupby("wait")[["nodes", "ranks_per_node", "rate_bps"]].apply(lambda g: len(g.drop_duplicates()))
    rate = 1e9 if (df["rate_bps"] == 1e9).any() else df["rate_bps"].min()
    d = df[(df["wait"] == clusters.idxmax()) & (df["rate_bps"] == rate)]
    counts = d.groupby("elements")["nodes"].nunique()
    size = counts[counts == counts.max()].index.max()
    d = d[(d["elements"] == size) & d["op"].isin(["server", "ring", "brace"])]
    return d.pivot_table(index=["ranks_per_node", "nodes"], columns="op", values=["seconds", "bound_seconds"]), int(
        size
    )


def plot(table: pd.DataFrame, size: int, path: str, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {"server": "tab:red", "ring": "tab:blue", "brace": "tab:green"}
    for ppn, g in table.groupby(level="ranks_per_node"):
        nodes = g.index.get_level_values("nodes")
        style, marker = ("-", "o") if ppn == 1 else ("--", "s")
        for op, colour in colours.items():
            if ("seconds", op) in g:
                ax.plot(nodes, g[("seconds", op)], style, marker=marker, color=colour, label=f"{op}, {ppn} rank/node")
                ax.plot(nodes, g[("bound_seconds", op)], ":", color=colour, alpha=0.5)
    ax.set_xlabel("nodes (1 Gbit/s link each)")
    ax.set_ylabel("seconds per round exchange")
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(table.index.get_level_values("nodes"))))
    ax.set_title(f"{size:,} float32 values per client{note}; dotted: bytes on the busiest link / rate", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--csv", help="write every record as one tidy CSV")
    p.add_argument("--plot", help="write the scalability plot (PNG)")
    p.add_argument("--note", default="", help="added to the plot's title (e.g. ', measured under load')")
    args = p.parse_args()
    df = load(args.json)
    if args.csv:
        df.drop(columns=["rate"]).to_csv(args.csv, index=False, float_format="%.6g")
    print(ratio_table(df), "\n")
    print(wire_table(df), "\n")
    table, size = scaling(df)
    print(f"seconds at {size:,} elements\n{table.round(3).to_string()}")
    if args.plot:
        plot(table, size, args.plot, args.note)


if __name__ == "__main__":
    main()
