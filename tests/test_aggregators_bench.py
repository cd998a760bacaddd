"""The aggregator benchmark runs end to end on a tiny input and reports what it promises."""

from __future__ import annotations

import json

import pytest

from fedring.bench.aggregators import ENTRIES, PAPER, main
from fedring.errors import ConfigError


def test_bench_aggregators_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(
        [
            "--clients",
            "7",
            "--dim",
            "3000",
            "--repeats",
            "1",
            "--rules",
            "krum,fedseca,fldetector,nnm+mean",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    recs = {r["rule"]: r for r in data["records"]}
    assert list(recs) == ["mean", "krum", "fedseca", "fldetector", "nnm+mean"]  # the yardstick comes first
    assert recs["mean"]["x_mean"] == 1.0
    assert recs["krum"]["paper_row"] == "Krum" and recs["krum"]["paper_seconds"] is None  # no 7-client column
    for r in recs.values():
        assert r["seconds"] > 0 and r["peak_extra_bytes"] > 0 and len(r["times"]) == 1
    assert recs["fldetector"]["state_copies"] > 1  # previous gradients + history window
    text = capsys.readouterr().out
    assert "| rule | paper row | clients | ours (s) | CPU (s) |" in text


def test_bench_entries_and_paper_table():
    assert {row for _, _, _, row in ENTRIES.values() if row} == set(PAPER)
    assert PAPER["Krum"][64] == 95.84 and PAPER["FedSECA"][16] == 37.79


def test_bench_bad_arguments():
    with pytest.raises(ConfigError, match="--rules: unknown nope"):
        main(["--rules", "nope", "--dim", "10"])
    with pytest.raises(ConfigError, match="--clients"):
        main(["--clients", "a,b"])


def test_bench_new_rules_tiny(tmp_path):
    """The peers' rules are benchmark entries and run end to end (figures are not asserted)."""
    for name in ["mda", "monna-0", "meamed", "caf", "smea", "arc+mean", "dnc", "signguard", "flame", "foolsgold"]:
        assert name in ENTRIES
    for name in ["normclipping", "simpleclustering", "auror", "crfl", "lasa", "clippedclustering"]:
        assert name in ENTRIES
    out = tmp_path / "bench.json"
    main(["--clients", "9", "--dim", "2000", "--repeats", "1", "--rules", "dnc,foolsgold", "--json", str(out)])
    recs = {r["rule"]: r for r in json.loads(out.read_text())["records"]}
    assert list(recs) == ["mean", "dnc", "foolsgold"]
    for r in recs.values():
        assert r["seconds"] > 0 and r["cpu_seconds"] >= 0 and r["peak_extra_bytes"] > 0
        assert r["paper_row"] is None or r["rule"] == "mean"
    assert recs["foolsgold"]["state_copies"] >= 1  # the history of every client
