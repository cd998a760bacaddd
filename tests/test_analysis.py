"""analysis/: tidy loading, paper-layout tables and plots from results files.

The training files are written with fedring's own writer (:class:`fedring.results.ResultsFile`)
and chosen metrics, so every table cell is known exactly; the conformal files are written by
hand in the ``/calibration`` layout of :mod:`fedring.conformal.trials`; one test runs real
training run. The commands run in this process (``analysis_cli``), from a directory that is not the
repository (``cwd=tmp_path``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
from conftest import fedring

from analysis.conformal import conformal_table, load_conformal
from analysis.load import load_runs
from analysis.tables import paper_table
from fedring.config import Config
from fedring.results import ResultsFile

D = 10  # model size of the fake runs


def fake_run(
    path,
    status="complete",
    rounds=4,
    eval_every=2,
    accuracy=None,
    success=None,
    validation=None,
    clients=4,
    bytes_per_client=None,
    server_bytes=0,
    **settings,
):
    """A results file as fedring writes it; accuracy(round), success(round) and validation(round)
    (validation accuracy) give the metrics."""
    cfg = Config(dataset="synthetic", clients=clients, rounds=rounds, eval_every=eval_every)
    for k, v in settings.items():
        setattr(cfg, k, v)
    f = ResultsFile(str(path), {"config": cfg.to_json(), "world_size": 2, "n_clients": clients, "n_parameters": D})
    done = rounds if status == "complete" else rounds // 2
    for rnd in range(1, done + 1):
        rows = {
            "comm/bytes_sent": np.full(clients, bytes_per_client or 8 * D, np.int64),
            "comm/server_bytes_sent": np.int64(server_bytes),
        }
        metrics = {}
        if rnd % eval_every == 0:
            metrics = {"round": rnd, "test_accuracy": accuracy(rnd), "test_loss": 1.0, "train_loss": 1.0}
            if success is not None:
                metrics["attack_success_rate"] = success(rnd)
            if validation is not None:
                metrics["validation_accuracy"] = validation(rnd)
        f.append_round(metrics, rows, rounds_completed=rnd)
    if status == "running":
        f.h5.flush()
        f.h5.close()  # a writer that died: the status stays "running"
    else:
        f.close(status)
    return path


METHODS = [("ring", "mean"), ("ring", "brace"), ("server", "krum")]
ATTACKS = ["none", "gaussian", "backdoor"]


def final_accuracy(attack, aggregator, seed):
    # exact binary fractions: the expected cells below are exact
    base = {"mean": 0.75, "brace": 0.8125, "krum": 0.6875}[aggregator]
    return base - 0.0625 * ATTACKS.index(attack) + 0.125 * seed


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    for attack in ATTACKS:
        for topology, aggregator in METHODS:
            for seed in (0, 1):
                acc = final_accuracy(attack, aggregator, seed)
                fake_run(
                    d / f"{attack}-{aggregator}-{seed}.h5",
                    accuracy=lambda r, a=acc: a if r == 4 else 0.5,
                    success=(lambda r: 0.25) if attack == "backdoor" else None,
                    topology=topology,
                    aggregator=aggregator,
                    attack=attack,
                    seed=seed,
                    byzantine=0.25,
                    lr=0.001 if aggregator == "brace" else 0.1,
                )
    fake_run(d / "preempted.h5", status="preempted", accuracy=lambda r: 0.5, attack="none", aggregator="mean")
    fake_run(d / "dead.h5", status="running", accuracy=lambda r: 0.5, attack="none", aggregator="mean")
    (d / "junk.h5").write_bytes(b"junk")
    return d


def test_load_is_tidy_and_names_skipped_files(runs):
    df, skipped = load_runs([runs])
    assert df["run"].nunique() == 18 and len(df) == 36  # 2 evaluated rounds each
    assert dict(skipped) == {
        str(runs / "dead.h5"): "still running (status = running)",
        str(runs / "junk.h5"): dict(skipped)[str(runs / "junk.h5")],
        str(runs / "preempted.h5"): "not complete (status = preempted, 2 rounds)",
    }
    assert dict(skipped)[str(runs / "junk.h5")].startswith("unreadable (")
    row = df[(df["run"] == "gaussian-brace-1") & (df["round"] == 4)].iloc[0]
    assert (row["attack"], row["aggregator"], row["topology"], row["seed"], row["lr"]) == (
        "gaussian",
        "brace",
        "ring",
        1,
        0.001,
    )
    assert row["test_accuracy"] == 0.8125 - 0.0625 + 0.125
    assert row["test_error"] == 1 - row["test_accuracy"]
    assert row["bytes_per_client_round"] == 8 * D and row["n_parameters"] == D and row["status"] == "complete"
    assert list(df[df["run"] == "none-mean-0"]["round"]) == [2, 4]
    df_all, skipped_all = load_runs([runs], include_incomplete=True)
    assert set(df_all[df_all["status"] == "preempted"]["round"]) == {2}
    assert len(skipped_all) == 2


def test_load_skips_a_file_being_written(runs):
    live = runs / "none-mean-0.h5"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r+'); print('open', flush=True); time.sleep(30)",
            str(live),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        _, skipped = load_runs([live])
    finally:
        holder.kill()
        holder.wait()
    assert skipped == [(str(live), "being written (another process holds its HDF5 file lock)")]


def test_paper_table_layout_and_exact_cells(runs):
    df, _ = load_runs([runs])
    markdown, csv = paper_table(df)
    # seeds 0 and 1 differ by 0.125 in accuracy: mean shifts by 0.0625, sd = 0.125 / sqrt(2) = 0.0884
    assert markdown == (
        "Final test error (round 4); where measured: test error / attack success rate. "
        "18 runs, mean ± sd (n runs) over 2 seeds.\n\n"
        "| Attack | RAR | Krum | BRACE |\n"
        "|---|---|---|---|\n"
        "| no attack | 0.19 ± 0.09 (2) | 0.25 ± 0.09 (2) | 0.12 ± 0.09 (2) |\n"
        "| Gaussian attack | 0.25 ± 0.09 (2) | 0.31 ± 0.09 (2) | 0.19 ± 0.09 (2) |\n"
        "| Backdoor attack | 0.31 ± 0.09 (2) / 0.25 | 0.38 ± 0.09 (2) / 0.25 | 0.25 ± 0.09 (2) / 0.25 |\n"
    )
    assert list(csv.columns) == [f"{m}{s}" for m in ("RAR", "Krum", "BRACE") for s in ("", " sd", " n")]
    assert list(csv.index) == [
        "no attack",
        "Gaussian attack",
        "Backdoor attack",
        "Backdoor attack (attack success rate)",
    ]
    assert csv.loc["Gaussian attack", "Krum"] == 1 - (0.6875 - 0.0625 + 0.0625)
    assert csv.loc["Gaussian attack", "Krum sd"] == pytest.approx(0.125 / 2**0.5)
    assert csv.loc["Gaussian attack", "Krum n"] == 2
    assert csv.loc["Backdoor attack (attack success rate)", "BRACE"] == 0.25
    assert csv.loc["Backdoor attack (attack success rate)", "BRACE sd"] == 0.0
    # accuracy instead of error: the title says so, the cells are 1 - error
    markdown, csv = paper_table(df, metric="test_accuracy")
    assert markdown.startswith("Final test accuracy (round 4); where measured: test accuracy / attack success rate.")
    assert "| no attack | 0.81 ± 0.09 (2) | 0.75 ± 0.09 (2) | 0.88 ± 0.09 (2) |" in markdown
    assert csv.loc["Gaussian attack", "Krum"] == 0.6875 - 0.0625 + 0.0625


def test_paper_table_refuses_cells_that_mix_settings(runs, tmp_path, analysis_cli):
    fake_run(
        runs / "extra.h5",
        accuracy=lambda r: 0.5,
        topology="ring",
        aggregator="mean",
        attack="none",
        seed=2,
        byzantine=0.25,
        rounds=4,
        noniid=0.1,
    )
    df, _ = load_runs([runs])
    with pytest.raises(SystemExit, match=r"cell attack='no attack', method='RAR' differ in noniid \(0.1, 0.5\)"):
        paper_table(df)
    proc = analysis_cli("table", runs, "--where", "noniid=0.5", "--out", tmp_path / "t2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t2.md").read_text().startswith("Final test error (round 4)")
    assert "skipped " + str(runs / "junk.h5") in proc.stderr
    csv = pd.read_csv(tmp_path / "t2.csv", index_col=0)
    assert csv.index.name == "attack" and csv.loc["no attack", "BRACE"] == 1 - (0.8125 + 0.0625)


def test_plots_are_pngs(runs, tmp_path, analysis_cli):
    for n, server in ((4, 4 * 8 * D), (8, 8 * 8 * D)):  # traffic of other client counts
        for topology, aggregator, per_client in (
            ("ring", "mean", 2 * (n - 1) * D),
            ("ring", "brace", 33 * (n - 1) * D // 8),
            ("server", "krum", 4 * D),
        ):
            fake_run(
                tmp_path / f"c{n}{aggregator}.h5",
                accuracy=lambda r: 0.5,
                clients=n,
                topology=topology,
                aggregator=aggregator,
                bytes_per_client=per_client,
                server_bytes=server if topology == "server" else 0,
            )
    from analysis.plots import traffic

    df, _ = load_runs([tmp_path])
    t = traffic(df).set_index(["architecture", "n_clients"])
    assert t.loc[("RAR", 8), "bytes_per_client_round"] == 2 * 7 * D
    assert t.loc[("Server", 8), "server_bytes_per_round"] == 8 * 8 * D
    for cmd in ("plot-accuracy", "plot-bytes"):
        out = tmp_path / f"{cmd}.png"
        proc = analysis_cli(cmd, runs if cmd == "plot-accuracy" else tmp_path, "--out", out, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def calibration_file(path, cases, size_kind, alpha, coverage, size, status="complete"):
    """A conformal results file in the /calibration layout of fedring.conformal.trials, written by hand."""
    coverage, size = np.array(coverage, float), np.array(size, float)
    with h5py.File(path, "w") as f:
        f.attrs.update(status=status, task="conformal", config=json.dumps({"task": "conformal", "seed": 0}))
        g = f.create_group("calibration")
        g.attrs.update(
            cases=json.dumps(cases), size_kind=size_kind, alpha=alpha, settings=json.dumps({"trials": len(coverage)})
        )
        g["trial"] = np.arange(len(coverage))
        g["coverage"], g["size"], g["threshold"] = coverage, size, np.ones_like(coverage)
    return path


def conformal_files(tmp_path):
    """Two conformal runs (regression: interval width; classification: set size), and files to skip."""
    calibration_file(
        tmp_path / "prism.h5",
        [
            {"label": "FCP", "method": "fcp", "attack": "coverage", "shared": 50},
            {"label": "PRISM-FCP", "method": "prism", "attack": "coverage", "shared": 25},
        ],
        "interval width",
        0.2,
        coverage=[[1.0, 0.875], [1.0, 0.925]],
        size=[[8.0, 1.0], [10.0, 1.5]],
    )
    calibration_file(
        tmp_path / "labelshift.h5",
        [
            {"label": "weighted", "method": "weighted", "target": 1, "epsilon": 1.0},
            {"label": "oracle", "method": "oracle", "target": 1, "epsilon": None},
        ],
        "set size",
        0.1,
        coverage=[[0.875, 0.9], [0.9375, 0.9]],
        size=[[2.0, 2.5], [3.0, 2.5]],
    )
    calibration_file(
        tmp_path / "running.h5",
        [{"label": "FCP", "method": "fcp"}],
        "set size",
        0.1,
        [[1.0]],
        [[1.0]],
        status="running",
    )
    with h5py.File(tmp_path / "old.h5", "w") as f:  # the retired per-task layout: not read any more
        f.attrs.update(status="complete", config="{}")
        f.create_group("calibration").attrs["cases"] = json.dumps(
            [{"attack": "coverage", "method": "fcp", "shared": 50}]
        )
        f["calibration/coverage"] = np.ones((2, 1))
        f["calibration/width"] = np.ones((2, 1))


def test_conformal_table_reads_the_calibration_layout(tmp_path, analysis_cli):
    conformal_files(tmp_path)
    df, skipped = load_conformal([tmp_path])
    assert dict(skipped) == {
        str(tmp_path / "running.h5"): "not complete (status = running)",
        str(
            tmp_path / "old.h5"
        ): "/calibration is not in the layout of fedring.conformal.trials (KeyError: 'settings')",
    }
    markdown, csv = conformal_table(df)
    # (0.875 + 0.9375) / 2 = 90.625%, sd 0.0625 / sqrt(2) = 4.42%; sizes 2 and 3: 2.5 ± 0.71
    assert markdown == (
        "Coverage (%) and size (interval width or set size: Size kind), mean ± sd over the trials; "
        "Target = 100 (1 - alpha) %. Every row: seed = 0.\n\n"
        "| run | label | method | target | epsilon | attack | shared | Coverage (%) | Size | Size kind | Trials | Target (%) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| labelshift | weighted | weighted | 1 | 1 |  |  | 90.6 ± 4.4 | 2.50 ± 0.71 | set size | 2 | 90 |\n"
        "| labelshift | oracle | oracle | 1 |  |  |  | 90.0 ± 0.0 | 2.50 ± 0.00 | set size | 2 | 90 |\n"
        "| prism | FCP | fcp |  |  | coverage | 50 | 100.0 ± 0.0 | 9.00 ± 1.41 | interval width | 2 | 80 |\n"
        "| prism | PRISM-FCP | prism |  |  | coverage | 25 | 90.0 ± 3.5 | 1.25 ± 0.35 | interval width | 2 | 80 |\n"
    )
    row = csv[csv["label"] == "PRISM-FCP"].iloc[0]
    assert (row["coverage"], row["size"], row["size_kind"], row["trials"], row["alpha"]) == (
        0.9,
        1.25,
        "interval width",
        2,
        0.2,
    )
    assert row["coverage_sd"] == pytest.approx(0.05 / 2**0.5) and row["size_sd"] == pytest.approx(0.5 / 2**0.5)
    # one file: the kind of size is the column's name; the keys the cases share are in the caption
    markdown, _ = conformal_table(load_conformal([tmp_path / "prism.h5"])[0])
    assert markdown == (
        "Coverage (%) and interval width, mean ± sd over the trials; Target = 100 (1 - alpha) %. "
        "Every row: seed = 0; attack = coverage.\n\n"
        "| label | method | shared | Coverage (%) | Interval width | Trials | Target (%) |\n"
        "|---|---|---|---|---|---|---|\n"
        "| FCP | fcp | 50 | 100.0 ± 0.0 | 9.00 ± 1.41 | 2 | 80 |\n"
        "| PRISM-FCP | prism | 25 | 90.0 ± 3.5 | 1.25 ± 0.35 | 2 | 80 |\n"
    )
    proc = analysis_cli(
        "conformal-table", tmp_path, "--where", "method=prism", "--out", tmp_path / "conf", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert pd.read_csv(tmp_path / "conf.csv", index_col=0).loc["prism", "coverage"] == 0.9
    out = tmp_path / "conf.png"
    proc = analysis_cli("plot-conformal", tmp_path, "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_real_runs_end_to_end(tmp_path):
    """A real (tiny) run through load and table: the numbers are the file's own."""
    fedring(
        1,
        "run",
        "--dataset",
        "synthetic",
        "--clients",
        "3",
        "--rounds",
        "2",
        "--eval-every",
        "1",
        "--topology",
        "server",
        "--aggregator",
        "median",
        "--quiet",
        "--out",
        str(tmp_path / "median.h5"),
        timeout=120,
    )
    df, skipped = load_runs([tmp_path])
    assert skipped == [] and len(df) == 2
    _, csv = paper_table(df)
    with h5py.File(tmp_path / "median.h5") as f:
        assert csv.loc["no attack", "Median"] == 1 - f["metrics/test_accuracy"][-1]
        assert df[df["run"] == "median"]["bytes_per_client_round"].iloc[0] == f["comm/bytes_sent"][:].mean()


def test_method_labels_name_the_papers_rules_pre_aggregators_and_dp():
    from analysis.tables import method_labels

    runs = pd.DataFrame(
        {
            "aggregator": ["mean", "mean", "mean", "flame", "trimmed_mean", "mda", "mean"],
            "topology": ["server"] * 6 + ["ring"],
            "pre_aggregators": ["", "", "", "", "arc,nnm", "", ""],
            "dp": ["none", "central", "local", "none", "none", "none", "none"],
        }
    )
    assert method_labels(runs).tolist() == ["Mean", "Mean+DP", "Mean+LDP", "FLAME", "ARC+NNM+Trim-mean", "MDA", "RAR"]


def test_heatmap_of_a_metric_only_some_attacks_measure_drops_the_others(runs):
    from analysis.plots import heatmap_panels

    (panel,) = heatmap_panels(load_runs([runs])[0], metric="attack_success_rate").values()
    assert list(panel.columns) == ["Backdoor attack"]  # no success rate without a backdoor: no empty column
    assert panel["Backdoor attack"].tolist() == [0.25, 0.25, 0.25]
