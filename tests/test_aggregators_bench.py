"""The aggregator benchmark runs end to end on a tiny input and reports what it promises."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedring.aggregators.probe import OutputLayer
from fedring.bench.aggregators import ENTRIES, PAPER, PROBE_LR, PROBE_SHAPE, main, probe_dim, probe_for
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


def test_bench_deepsight_runs_on_its_probe_models_columns(tmp_path, capsys):
    """DeepSight is timed on the rows' first probe_dim(d) columns, the parameters of its probe MLP."""
    assert ENTRIES["deepsight"] == ("deepsight", {"num_samples": 100}, (), None)
    out = tmp_path / "bench.json"
    main(["--clients", "6", "--dim", "1700", "--repeats", "1", "--rules", "deepsight", "--json", str(out)])
    recs = json.loads(out.read_text())["records"]
    # 2 hidden units: 2 x 795 + 10 parameters
    assert [(r["rule"], r["clients"], r["dim"]) for r in recs] == [("mean", 6, 1700), ("deepsight", 6, 1600)]
    for r in recs:
        assert r["seconds"] > 0 and r["peak_extra_bytes"] > 0 and r["state_copies"] == 0.0
    assert "deepsight: the rows' first 1600 of 1700 columns, its probe model's parameters" in capsys.readouterr().out
    main(["--clients", "6", "--dim", "804", "--repeats", "1", "--rules", "deepsight"])
    assert "skip deepsight at n=6: its probe model needs --dim >= 805" in capsys.readouterr().out


def test_probe_for_holds_the_models_weights():
    """The probe MLP has exactly probe_dim(d) parameters, initialised from the seed without moving torch's
    global generator; the probe is bound to those weights and PROBE_LR, its output layer the MLP's last."""
    before = torch.random.get_rng_state()
    model, probe = probe_for(2500, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert w.shape == (probe_dim(2500),) == (2395,)  # 3 hidden units
    np.testing.assert_array_equal(probe.w, w)
    np.testing.assert_array_equal(
        probe_for(2500, seed=3)[0][1].weight.detach().numpy(), model[1].weight.detach().numpy()
    )
    assert probe.lr == np.float32(PROBE_LR) and probe.input_shape == PROBE_SHAPE
    assert probe.output_layer == OutputLayer(start=2355, classes=10, fan_in=3)
    x = np.zeros((2, *PROBE_SHAPE), np.float32)
    clients, server = probe.softmax(np.zeros((1, 2395), np.float32), x)
    np.testing.assert_array_equal(clients[0], server)  # a zero upload leaves the global model
    assert server.shape == (2, 10)
