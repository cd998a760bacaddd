"""analysis worst-case and analysis heatmap: the worst-case protocol on hand-made runs.

Every run's final validation and test accuracy is an exact binary fraction, so the chosen
setting and every reported cell are known exactly. The grid is built so that the worst-case
choice differs from the no-attack choice (Median's best lr without an attack collapses under
Min-Max, as in docs/brace.md), and so that both tie-breaks are exercised.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_analysis import fake_run

from analysis.load import load_runs
from analysis.plots import plot_heatmap
from analysis.worst_case import worst_case

LRS = [0.03, 0.1, 0.3]
ATTACKS = ["none", "minmax", "alie"]  # the table's order (analysis.ATTACK_LABELS)
#: the mean over the two seeds of the final validation accuracy, per (aggregator, lr): one per attack
VALIDATION = {
    # no attack prefers 0.3, which collapses under Min-Max; the worst case prefers 0.03 (0.625 > 0.5)
    ("median", 0.03): (0.75, 0.625, 0.6875),
    ("median", 0.1): (0.8125, 0.5, 0.75),
    ("median", 0.3): (0.875, 0.125, 0.8125),
    # 0.1 and 0.3 share the worst case (0.5): 0.1 has the higher mean over attacks
    ("krum", 0.03): (0.5, 0.25, 0.375),
    ("krum", 0.1): (0.75, 0.5, 0.75),
    ("krum", 0.3): (0.75, 0.5, 0.5),
    # 0.1 and 0.3 tie in worst case and mean: the smaller lr, 0.1
    ("trimmed_mean", 0.03): (0.5, 0.25, 0.25),
    ("trimmed_mean", 0.1): (0.625, 0.5, 0.5),
    ("trimmed_mean", 0.3): (0.5, 0.5, 0.625),
}
CHOSEN = {
    "Median": ("0.03", 0.625, "Min-Max attack"),
    "Krum": ("0.1", 0.5, "Min-Max attack"),
    "Trim-mean": ("0.1", 0.5, "ALIE attack"),
}
GAP = 0.0625  # test accuracy = validation accuracy - GAP; seed 0 and 1 lie GAP below and above the mean


def write_grid(d, validation=True, byzantine=0.2, shift=0.0, **extra):
    """One file per (aggregator, lr, attack, seed) of :data:`VALIDATION` (every value minus ``shift``)."""
    d.mkdir(exist_ok=True)
    for (aggregator, lr), values in VALIDATION.items():
        for attack, mean in zip(ATTACKS, values):
            for seed, sign in ((0, -1), (1, 1)):
                v = mean - shift + sign * GAP
                fake_run(
                    d / f"{aggregator}-{lr}-{attack}-{byzantine}-{seed}.h5",
                    accuracy=lambda r, v=v: v - GAP if r == 4 else 0.0,
                    validation=(lambda r, v=v: v if r == 4 else 0.0) if validation else None,
                    topology="server",
                    aggregator=aggregator,
                    attack=attack,
                    seed=seed,
                    byzantine=byzantine,
                    lr=lr,
                    **extra,
                )
    return d


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The grid of :data:`VALIDATION`, written once per module."""
    return write_grid(tmp_path_factory.mktemp("grid") / "runs")


@pytest.fixture
def grid(written, tmp_path):
    """A copy of the grid that a test may change."""
    return Path(shutil.copytree(written, tmp_path / "runs"))


def expected_test(defence):
    lr = float(CHOSEN[defence][0])
    aggregator = {"Median": "median", "Krum": "krum", "Trim-mean": "trimmed_mean"}[defence]
    return [v - GAP for v in VALIDATION[(aggregator, lr)]]


def test_worst_case_choice_and_table_are_exact(grid, analysis_cli, tmp_path):
    result = worst_case(load_runs([grid])[0], "aggregator", ["lr"])
    assert result.selected_on == "validation_accuracy"
    assert list(result.choice.index) == ["Krum", "Median", "Trim-mean"]  # the BRACE paper's column order
    for defence, (lr, score, attack) in CHOSEN.items():
        assert tuple(result.choice.loc[defence, ["lr", "score", "worst attack"]]) == (lr, score, attack)
        assert list(result.test["mean"].loc[defence]) == expected_test(defence)
        assert list(result.test["std"].loc[defence]) == [2**0.5 * GAP] * 3
        assert list(result.test["count"].loc[defence]) == [2, 2, 2]
    # the no-attack choice would differ: Median's best lr without an attack is 0.3
    assert max(LRS, key=lambda lr: VALIDATION[("median", lr)][0]) == 0.3

    out = analysis_cli("worst-case", grid, "--tune", "lr", "--out", tmp_path / "wc", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "| Defence | lr | worst-case validation accuracy | worst attack | no attack | Min-Max attack | ALIE attack |"
        in out.stdout
    )
    assert (
        "| Median | 0.03 | 0.62 | Min-Max attack | 0.69 ± 0.09 (2) | 0.56 ± 0.09 (2) | 0.62 ± 0.09 (2) |" in out.stdout
    )
    csv = pd.read_csv(tmp_path / "wc.csv", index_col=0)
    assert list(csv.loc["Median", ["lr", "worst-case validation_accuracy", "no attack", "Min-Max attack n"]]) == [
        0.03,
        0.625,
        0.6875,
        2,
    ]
    assert "warning" not in out.stderr


def test_a_tidy_csv_gives_the_same_table(grid, analysis_cli, tmp_path):
    assert analysis_cli("load", grid, "--out", tmp_path / "runs.csv", cwd=tmp_path).returncode == 0
    from_files = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    from_csv = analysis_cli("worst-case", tmp_path / "runs.csv", "--tune", "lr", cwd=tmp_path)
    assert from_csv.returncode == 0, from_csv.stderr
    assert from_csv.stdout == from_files.stdout


def test_final_window_averages_the_last_evaluations(grid):
    # the window of 2 averages round 4 with round 2 (0.0): every value halves, the choice stands
    result = worst_case(load_runs([grid])[0], "aggregator", ["lr"], window=2)
    assert result.choice.loc["Median", "score"] == 0.3125
    assert list(result.test["mean"].loc["Median"]) == [v / 2 for v in expected_test("Median")]


def test_no_validation_split_falls_back_to_test_accuracy_with_a_warning(tmp_path, analysis_cli):
    d = write_grid(tmp_path / "runs", validation=False)
    out = analysis_cli("worst-case", d, "--tune", "lr", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning")]
    assert warnings == [
        "warning: the runs have no validation split (/metrics/validation_accuracy): "
        "the setting is chosen on test accuracy, the data it is reported on"
    ]
    # test accuracy is validation - GAP everywhere: the same choice, scored GAP lower
    assert "| Median | 0.03 | 0.56 | Min-Max attack |" in out.stdout
    assert "worst-case test accuracy" in out.stdout


def krum_run(path, value: float, validation: bool = True, **extra):
    """One more run beside the grid's: Krum under ALIE at lr 0.1, seed 2, every evaluation ``value``."""
    fake_run(
        path,
        accuracy=lambda r: value,
        validation=(lambda r: value) if validation else None,
        topology="server",
        aggregator="krum",
        attack="alie",
        seed=2,
        lr=0.1,
        byzantine=0.2,
        **extra,
    )


def test_runs_partly_with_a_validation_split_are_refused(grid, analysis_cli, tmp_path):
    krum_run(grid / "extra.h5", 0.5, validation=False)
    out = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    assert out.returncode != 0
    assert "have a validation split and 1 do not" in out.stderr


def test_a_cell_mixing_settings_is_refused(grid, analysis_cli, tmp_path):
    krum_run(grid / "other-batch.h5", 0.5, batch_size=64)
    out = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    assert out.returncode != 0
    assert "the runs of cell defence='Krum', attack='ALIE attack', lr='0.1' differ in batch_size (32, 64)" in out.stderr
    narrowed = analysis_cli("worst-case", grid, "--tune", "lr", "--where", "batch_size=32", cwd=tmp_path)
    assert narrowed.returncode == 0, narrowed.stderr


def test_where_with_several_values_of_a_key_keeps_any_of_them(grid, analysis_cli, tmp_path):
    # a seed that has only begun (one run of a third seed) changes a cell; naming the finished
    # seeds gives the table of those alone
    before = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    assert before.returncode == 0, before.stderr
    krum_run(grid / "krum-0.1-alie-0.2-2.h5", 0.0)
    unfiltered = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    assert unfiltered.returncode == 0, unfiltered.stderr
    assert unfiltered.stdout != before.stdout
    assert (
        "warning: seed 2 in 1 of the 27 cells (defence, lr, attack): the cells average different seeds; "
        "name the seeds in every cell with --where seed=0 --where seed=1"
    ) in unfiltered.stderr, unfiltered.stderr.splitlines()[-1]
    seeds = analysis_cli("worst-case", grid, "--tune", "lr", "--where", "seed=0", "--where", "seed=1", cwd=tmp_path)
    assert seeds.returncode == 0, seeds.stderr
    assert seeds.stdout == before.stdout
    assert "warning" not in seeds.stderr and "warning" not in before.stderr


def test_a_setting_missing_an_attack_is_refused(grid, analysis_cli, tmp_path):
    for seed in (0, 1):
        (grid / f"krum-0.3-minmax-0.2-{seed}.h5").unlink()
    out = analysis_cli("worst-case", grid, "--tune", "lr", cwd=tmp_path)
    assert out.returncode != 0
    assert "Krum at lr=0.3 has no runs under Min-Max attack" in out.stderr


def test_bad_tune_key_is_an_error(grid, analysis_cli, tmp_path):
    out = analysis_cli("worst-case", grid, "--tune", "lr,nonsense", cwd=tmp_path)
    assert out.returncode != 0
    assert "'nonsense': not a setting of these runs" in out.stderr


def test_heatmap_panels_per_byzantine_share(grid, tmp_path, analysis_cli):
    d = grid
    write_grid(d, byzantine=0.1, shift=-0.125)  # the same grid, every accuracy 0.125 higher
    panels = plot_heatmap(load_runs([d])[0], str(tmp_path / "h.png"), tune=["lr"])
    assert list(panels) == [
        "defence x attack, Byzantine 10 %",
        "defence x attack, Byzantine 20 %",
        "defence x Byzantine share: worst case over attacks",
    ]
    at20 = panels["defence x attack, Byzantine 20 %"]
    assert list(at20.loc["Median"]) == expected_test("Median")
    assert list(panels["defence x attack, Byzantine 10 %"].loc["Median"]) == [
        v + 0.125 for v in expected_test("Median")
    ]
    worst = panels["defence x Byzantine share: worst case over attacks"]
    assert list(worst.columns) == ["10 %", "20 %"]
    assert list(worst.loc["Median"]) == [0.6875, 0.5625]
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = analysis_cli(
        "heatmap", d, "--where", "byzantine=0.2", "--where", "lr=0.1", "--out", tmp_path / "m.png", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m.png").stat().st_size > 0
    # without --tune: the metric's mean over seeds, one lr fixed by --where
    assert "defence x attack, Byzantine 20 %:\n" in out.stdout
    assert "Median        0.7500          0.4375       0.6875" in out.stdout
