"""Every grid shipped in jobs/ expands and validates, as `sweep --dry-run` would check it."""

from pathlib import Path

import pytest

from fedring.sweep import load_sweep

JOBS = sorted((Path(__file__).resolve().parents[1] / "jobs").glob("*.toml"))


@pytest.mark.parametrize("grid", JOBS, ids=[g.stem for g in JOBS])
def test_shipped_grid_expands_to_valid_configs(grid):
    sweep = load_sweep(grid)
    assert len(sweep.configs) == len(set(sweep.hashes)) >= 1


def test_worst_case_grids_are_five_defences_by_four_attacks_by_three_rates():
    for name in ("worst_case", "worst_case_long"):
        sweep = load_sweep(Path(__file__).resolve().parents[1] / "jobs" / f"{name}.toml")
        assert len(sweep.configs) == 60
        assert sweep.varying() == ["aggregator", "attack", "lr"]
