"""analysis/: ``table --final-window/--diff-to/--metric``, BRACE-sym, ``plot-drift``, the
command list and the message when the ``analysis`` extra is missing.

The training files are written by hand with h5py in fedring's layout (attrs ``config`` and
``status``; ``/metrics``, ``/comm/bytes_sent``, ``/brace/*_fraction``) with binary-fraction
accuracies, so every cell below is computed by hand. The commands run in this process
(``analysis_cli``) from ``tmp_path``, not the repository; those without an extra in a fresh
interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
from conftest import mpi_env

from analysis import COMMANDS
from analysis.load import load_runs
from analysis.tables import paper_table

ROUNDS = [10, 20, 30, 40]  # the evaluated rounds of every run below
CLIENTS = 4


def train_file(
    path,
    accuracy,
    aggregator,
    seed,
    attack="none",
    topology="ring",
    lr=0.1,
    lr_schedule="constant",
    sections=None,
    metrics=None,
    rows=None,
):
    """A complete training run's results file in fedring's layout, written with h5py."""
    config = {
        "task": "train",
        "topology": topology,
        "aggregator": aggregator,
        "attack": attack,
        "seed": seed,
        "lr": lr,
        "lr_schedule": lr_schedule,
        "noniid": 0.5,
        "rounds": ROUNDS[-1],
        "eval_every": 10,
        "clients": CLIENTS,
        "sections": sections or {},
    }
    with h5py.File(path, "w") as f:
        f.attrs.update(
            config=json.dumps(config, sort_keys=True),
            status="complete",
            rounds_completed=ROUNDS[-1],
            world_size=1,
            n_clients=CLIENTS,
            n_parameters=10,
        )
        f["metrics/round"] = np.array(ROUNDS, np.int64)
        f["metrics/test_accuracy"] = np.array(accuracy, float)
        for name, values in (metrics or {}).items():
            f[f"metrics/{name}"] = np.array(values, float)
        f["comm/bytes_sent"] = np.full((ROUNDS[-1], CLIENTS), 80, np.int64)
        for name, values in (rows or {}).items():
            f[name] = np.array(values, float)
    return path


BRACE = {"brace": {"lambda": 1}}
SYMMETRIC = {"brace": {"lambda": 1, "rule": "symmetric"}}


@pytest.fixture
def grid(tmp_path):
    """Two attacks; RAR and BRACE on seeds 0 and 1, BRACE-sym on seed 0 without attack."""
    d = tmp_path / "grid"
    d.mkdir()
    runs = [
        ("none", "mean", 0, [0.5, 0.5, 0.625, 0.75], None),  # last: 0.75, last two: 0.6875
        ("none", "mean", 1, [0.5, 0.5, 0.75, 0.875], None),  # 0.875, 0.8125
        ("none", "brace", 0, [0.5, 0.5, 0.75, 0.75], BRACE),  # 0.75, 0.75
        ("none", "brace", 1, [0.5, 0.5, 0.8125, 1.0], BRACE),  # 1.0, 0.90625
        ("none", "brace-sym", 0, [0.25, 0.25, 0.25, 0.5], SYMMETRIC),  # 0.5, 0.375
        ("gaussian", "mean", 0, [0.25] * 4, None),
        ("gaussian", "mean", 1, [0.375] * 4, None),
        ("gaussian", "brace", 0, [0.5] * 4, BRACE),
        ("gaussian", "brace", 1, [0.5] * 4, BRACE),
    ]
    for attack, name, seed, acc, sections in runs:
        aggregator = name.partition("-")[0]
        lr = 0.1 if aggregator == "mean" else 0.003
        train_file(
            d / f"{attack}-{name}-{seed}.h5",
            acc,
            aggregator,
            seed,
            attack=attack,
            lr=lr,
            sections=sections,
            metrics={"lr": [lr, lr, lr / 10, lr / 10]},
        )
    return d


def test_brace_rules_get_their_own_columns_and_n_is_shown(grid):
    markdown, csv = paper_table(load_runs([grid])[0], metric="test_accuracy", digits=4)
    # RAR: 0.75, 0.875 -> 0.8125 ± 0.125/sqrt(2); BRACE: 0.75, 1.0 -> 0.875 ± 0.25/sqrt(2); BRACE-sym: one run
    assert markdown == (
        "Final test accuracy (round 40). 9 runs, mean ± sd (n runs) over 2 seeds.\n\n"
        "| Attack | RAR | BRACE | BRACE-sym |\n"
        "|---|---|---|---|\n"
        "| no attack | 0.8125 ± 0.0884 (2) | 0.8750 ± 0.1768 (2) | 0.5000 |\n"
        "| Gaussian attack | 0.3125 ± 0.0884 (2) | 0.5000 ± 0.0000 (2) | - |\n"
    )
    assert csv.loc["no attack", "BRACE-sym"] == 0.5 and csv.loc["no attack", "BRACE-sym n"] == 1
    assert pd.isna(csv.loc["no attack", "BRACE-sym sd"]) and pd.isna(csv.loc["Gaussian attack", "BRACE-sym"])
    assert csv.loc["no attack", "BRACE sd"] == pytest.approx(0.25 / 2**0.5)


def test_final_window_averages_the_last_k_evaluations(grid):
    df = load_runs([grid])[0]
    markdown, csv = paper_table(df, metric="test_accuracy", digits=4, window=2)
    # RAR: 0.6875, 0.8125 -> 0.75; BRACE: 0.75, 0.90625 -> 0.828125 ± 0.15625/sqrt(2); BRACE-sym 0.375
    assert markdown == (
        "Test accuracy, mean of the last 2 evaluations (rounds 30–40). 9 runs, mean ± sd (n runs) over 2 seeds.\n\n"
        "| Attack | RAR | BRACE | BRACE-sym |\n"
        "|---|---|---|---|\n"
        "| no attack | 0.7500 ± 0.0884 (2) | 0.8281 ± 0.1105 (2) | 0.3750 |\n"
        "| Gaussian attack | 0.3125 ± 0.0884 (2) | 0.5000 ± 0.0000 (2) | - |\n"
    )
    assert csv.loc["no attack", "BRACE"] == 0.828125 and csv.loc["no attack", "BRACE n"] == 2
    # the error is 1 - accuracy, window or not
    _, err = paper_table(df, window=2)
    assert err.loc["no attack", "RAR"] == 0.25
    # a window longer than the runs: all their evaluations, and the caption says so
    markdown, csv = paper_table(df, metric="test_accuracy", window=9)
    assert markdown.startswith(
        "Test accuracy, mean of the last 9 evaluations (rounds 10–40); "
        "9 runs have fewer evaluations: all of theirs are used. 9 runs"
    )
    assert csv.loc["no attack", "BRACE-sym"] == (0.25 * 3 + 0.5) / 4
    # any metric column: the lr applied in the round (stored as /metrics/lr, a setting is also called lr)
    markdown, csv = paper_table(df, metric="lr")
    assert markdown.startswith("Final lr (round 40).") and csv.loc["no attack", "BRACE"] == pytest.approx(0.0003)
    with pytest.raises(SystemExit, match=r"--metric 'nope': not a metric of these runs; metrics: .*test_accuracy"):
        paper_table(df, metric="nope")


def test_diff_to_pairs_runs_by_seed_within_a_row(grid):
    # a RAR run whose seed has no BRACE run: in the plain cell, not in the paired difference
    train_file(grid / "none-mean-2.h5", [0.0] * 4, "mean", 2, lr=0.1, metrics={"lr": [0.1] * 4})
    df = load_runs([grid])[0]
    markdown, csv = paper_table(df, metric="test_accuracy", digits=4, diff_to="BRACE")
    # None: RAR - BRACE per seed 0.75 - 0.75 = 0, 0.875 - 1 = -0.125 -> -0.0625 ± 0.0884 (2);
    # BRACE-sym - BRACE (seed 0 only) = 0.5 - 0.75. Gaussian: 0.25 - 0.5, 0.375 - 0.5 -> -0.1875 ± 0.0884 (2)
    assert markdown == (
        "Final test accuracy (round 40). 10 runs, mean ± sd (n runs) over 3 seeds. Columns other than BRACE: "
        "difference to BRACE in the same row, paired by seed, mean ± sd (n pairs); "
        "the paired runs also differ in brace.lambda, lr.\n\n"
        "| Attack | RAR | BRACE | BRACE-sym |\n"
        "|---|---|---|---|\n"
        "| no attack | -0.0625 ± 0.0884 (2) | 0.8750 ± 0.1768 (2) | -0.2500 |\n"
        "| Gaussian attack | -0.1875 ± 0.0884 (2) | 0.5000 ± 0.0000 (2) | - |\n"
    )
    assert list(csv.columns) == [
        "RAR - BRACE",
        "RAR - BRACE sd",
        "RAR - BRACE n",
        "BRACE",
        "BRACE sd",
        "BRACE n",
        "BRACE-sym - BRACE",
        "BRACE-sym - BRACE sd",
        "BRACE-sym - BRACE n",
    ]
    assert csv.loc["no attack", "RAR - BRACE"] == -0.0625 and csv.loc["no attack", "RAR - BRACE n"] == 2
    assert csv.loc["no attack", "RAR - BRACE sd"] == pytest.approx(0.125 / 2**0.5)
    assert csv.loc["Gaussian attack", "RAR - BRACE"] == -0.1875 and csv.loc["no attack", "BRACE-sym - BRACE"] == -0.25
    with pytest.raises(SystemExit, match=r"--diff-to 'Krum': no such column; columns: RAR, BRACE, BRACE-sym"):
        paper_table(df, diff_to="Krum")


def test_table_command_with_window_and_diff(grid, tmp_path, analysis_cli):
    proc = analysis_cli(
        "table",
        grid,
        "--metric",
        "test_accuracy",
        "--digits",
        "4",
        "--final-window",
        "2",
        "--diff-to",
        "BRACE",
        "--out",
        tmp_path / "out" / "t",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    # last two: RAR - BRACE = 0.6875 - 0.75, 0.8125 - 0.90625 -> -0.078125 ± 0.03125/sqrt(2); BRACE-sym 0.375 - 0.75
    assert (
        "| no attack | -0.0781 ± 0.0221 (2) | 0.8281 ± 0.1105 (2) | -0.3750 |"
        in (tmp_path / "out" / "t.md").read_text()
    )
    csv = pd.read_csv(tmp_path / "out" / "t.csv", index_col=0)
    assert csv.index.name == "attack"
    assert csv.loc["no attack", "RAR - BRACE"] == -0.078125 and csv.loc["no attack", "RAR - BRACE n"] == 2
    assert csv.loc["no attack", "BRACE-sym - BRACE"] == -0.375 and csv.loc["no attack", "BRACE-sym - BRACE n"] == 1
    assert csv.loc["Gaussian attack", "BRACE"] == 0.5 and csv.loc["Gaussian attack", "BRACE sd"] == 0.0
    bad = analysis_cli("table", grid, "--final-window", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "--final-window: must be at least 1, got 0" in bad.stderr


def test_table_from_the_tidy_csv_equals_the_table_from_the_files(grid, tmp_path):
    """A committed ``load --out`` CSV regenerates the paper table without the HDF5 files."""
    df, _ = load_runs([grid])
    df.to_csv(tmp_path / "runs.csv", index=False)
    again, skipped = load_runs([tmp_path / "runs.csv"])
    assert skipped == []
    kw = dict(metric="test_accuracy", digits=4, window=2, diff_to="BRACE")
    assert paper_table(again, **kw)[0] == paper_table(df, **kw)[0]
    assert "| no attack | -0.0781 ± 0.0221 (2) | 0.8281 ± 0.1105 (2) | -0.3750 |" in paper_table(again, **kw)[0]


def test_beside_puts_another_tables_values_in_parentheses(grid, tmp_path, analysis_cli):
    paper = tmp_path / "paper.csv"
    # a comment line, an empty cell (None/RAR) and a value beside a cell the runs lack (Gaussian/BRACE-sym)
    paper.write_text("# a paper's table\nattack,RAR,BRACE-sym\nno attack,,0.25\nGaussian attack,0.3,0.125\n")
    proc = analysis_cli("table", grid, "--metric", "test_accuracy", "--digits", "4", "--beside", paper, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "Final test accuracy (round 40). 9 runs, mean ± sd (n runs) over 2 seeds. In parentheses: paper.csv.\n\n"
    )
    assert "| no attack | 0.8125 ± 0.0884 (2) | 0.8750 ± 0.1768 (2) | 0.5000 (0.2500) |\n" in proc.stdout
    assert "| Gaussian attack | 0.3125 ± 0.0884 (2) (0.3000) | 0.5000 ± 0.0000 (2) | - (0.1250) |\n" in proc.stdout
    # rows the runs lack (a typo, or dropped by --where) are named on stderr and left out
    paper.write_text("attack,RAR,Krum\nGaussian attack,0.3,0.2\nKrum atack,0.1,0.2\n")
    proc = analysis_cli("table", grid, "--where", "attack=gaussian", "--beside", paper, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| Gaussian attack | 0.69 ± 0.09 (2) (0.30) | 0.50 ± 0.00 (2) |\n" in proc.stdout
    assert proc.stderr.splitlines() == [
        "4 runs; settings that vary across them: aggregator (brace, mean); lr (0.003, 0.1); brace.lambda (1, unset)",
        "--beside: rows not in the table, left out: 'Krum atack'",
        "--beside: columns not in the table, left out: 'Krum'",
    ]
    df = load_runs([grid])[0]
    typo = pd.DataFrame({"BRACE": [0.1]}, index=["Krum atack"])
    with pytest.raises(
        SystemExit,
        match=r"--beside: none of its rows \('Krum atack'\) is a row of the table; "
        r"rows: no attack, Gaussian attack",
    ):
        paper_table(df, beside=typo)
    with pytest.raises(SystemExit, match=r"--beside: none of its columns \('Krum'\) is a column"):
        paper_table(df, beside=pd.DataFrame({"Krum": [0.1]}, index=["no attack"]))
    with pytest.raises(SystemExit, match="--beside and --diff-to cannot be combined"):
        paper_table(df, diff_to="BRACE", beside=typo)
    # an unreadable file is refused before any run is loaded
    bad = analysis_cli("table", tmp_path / "nowhere", "--beside", tmp_path / "missing.csv", cwd=tmp_path)
    assert bad.returncode == 1 and f"--beside {tmp_path / 'missing.csv'}: cannot read it as a CSV table" in bad.stderr


def test_plot_drift(tmp_path, analysis_cli):
    d = tmp_path / "drift"
    d.mkdir()
    r = np.arange(1, ROUNDS[-1] + 1)
    for schedule, slope in (("constant", 0.01), ("step", 0.002)):
        plus = 0.25 + 0.1 * (r % 2)
        fractions = {
            "brace/plus_fraction": plus,
            "brace/minus_fraction": 0.7 - 0.1 * (r % 2),
            "brace/zero_fraction": np.full(len(r), 0.05),
        }
        train_file(
            d / f"brace-{schedule}.h5",
            [0.5] * 4,
            "brace",
            0,
            lr=0.003,
            lr_schedule=schedule,
            sections=BRACE,
            metrics={"weight_mean_change": slope * np.array(ROUNDS)},
            rows=fractions,
        )
    train_file(d / "rar.h5", [0.5] * 4, "mean", 0, metrics={"weight_mean_change": [0.0] * 4})  # no /brace
    out = tmp_path / "figs" / "drift.png"
    proc = analysis_cli("plot-drift", d, "--out", out, "--smooth", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # a line per run, labelled by method and (the runs differ in it) lr schedule
    assert proc.stdout.splitlines() == [
        f"wrote {out}",
        "BRACE, lr constant: brace-constant",
        "BRACE, lr step: brace-step",
        "RAR, lr constant: rar",
    ]
    from analysis.load import round_rows

    rows = round_rows(d / "brace-step.h5", "brace")
    assert list(rows["round"][:3]) == [1, 2, 3] and rows["plus_fraction"].iloc[0] == 0.35
    assert round_rows(d / "rar.h5", "brace").empty


def test_help_lists_every_command(tmp_path, analysis_cli):
    proc = analysis_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS) and "plot-drift" in listed
    for name in COMMANDS:
        sub = analysis_cli(name, "--help", cwd=tmp_path)
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: python -m analysis {name}"), sub.stderr
    unknown = analysis_cli("tabel", cwd=tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("python -m analysis: unknown command 'tabel'")


#: run ``python -m analysis ARGS`` with the module named in argv[1] impossible to import
WITHOUT = """
import importlib.abc, runpy, sys
missing = sys.argv[1]
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == missing or name.startswith(missing + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = ["analysis", *sys.argv[2:]]
runpy.run_module("analysis", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "missing, command",
    [("pandas", "table"), ("pandas", "conformal-table"), ("matplotlib", "plot-drift"), ("pandas", "load")],
)
def test_a_missing_extra_is_one_line_and_exit_2(tmp_path, missing, command):
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT, missing, command, str(tmp_path), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=60,
        env=mpi_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr
        == f"python -m analysis {command} needs {missing}, which is not installed: pip install 'fedring[analysis]'\n"
    )
    assert proc.stdout == ""
    # the command list needs neither
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT, missing, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=mpi_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "plot-drift" in proc.stdout


def test_sys_modules_none_is_a_missing_extra_too(tmp_path):
    code = (
        "import runpy, sys; sys.modules['pandas'] = None; sys.argv = ['analysis', 'load', '.']; "
        "runpy.run_module('analysis', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=tmp_path
    )
    assert (proc.returncode, proc.stderr) == (
        2,
        "python -m analysis load needs pandas, which is not installed: pip install 'fedring[analysis]'\n",
    )


def test_ring_rows_reads_ring_and_the_brace_group_of_0_2_0(tmp_path):
    """The ring rules' figures are under /ring; files of 0.2.0 hold them under /brace."""
    from analysis.load import ring_rows

    for group, plus in (("ring", [0.25, 0.5]), ("brace", [0.75, 1.0])):
        with h5py.File(tmp_path / f"{group}.h5", "w") as f:
            f[f"{group}/plus_fraction"] = np.array(plus)
            f[f"{group}/detections"] = np.zeros((2, 3), np.int64)  # per client: not a column
        rows = ring_rows(tmp_path / f"{group}.h5")
        assert list(rows.columns) == ["round", "plus_fraction"]
        assert rows["round"].tolist() == [1, 2] and rows["plus_fraction"].tolist() == plus
    with h5py.File(tmp_path / "neither.h5", "w") as f:
        f["metrics/round"] = np.array([1])
    assert ring_rows(tmp_path / "neither.h5").empty
