"""benchmarks/gpu.sh cannot rot: its --smoke mode runs every step on the CPU at tiny sizes; and
``bench aggregators --device`` times rules on tensors, beside ByzFL's where it is installed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fedring.aggregators import make_aggregator
from fedring.bench.aggregators import BYZFL, ENTRIES, byzfl_module, byzfl_pipeline, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_script_smoke(tmp_path):
    env = {**os.environ, "FEDRING_GPU_OUT": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--smoke"], capture_output=True, text=True, env=env, timeout=400
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    names = {p.stem for p in tmp_path.glob("*.json")}
    server = {f"train-cnn_cifar-server-{rule}" for rule in ("median", "trimmed_mean", "krum")}
    assert (
        names
        == {"train-cnn", "train-cnn-protocol", "train-cnn_cifar-ring", "aggregators", "local_ring", "draws"} | server
    )
    protocol = json.loads((tmp_path / "train-cnn-protocol.json").read_text())
    assert protocol["settings"] == ["momentum=0.9", "clip_norm=1", "weight_decay=0.0005"]
    ring = json.loads((tmp_path / "local_ring.json").read_text())
    assert ring["device"] == "cpu" and [(r["d"], r["rows"]) for r in ring["records"]] == [
        (100, "numpy"),
        (100, "torch"),
        (1000, "numpy"),
        (1000, "torch"),
    ]
    assert all(r["ring_s"] > 0 and r["ratio"] == r["ring_s"] / r["bare_sum_s"] for r in ring["records"])
    assert all(r["padded_s"] > 0 and r["planned_s"] > 0 for r in ring["records"])
    draws = json.loads((tmp_path / "draws.json").read_text())
    assert (
        draws["clients"] == 100
        and draws["repeats"] == 7
        and set(draws["us_per_client"])
        == {
            "generator",
            "default_rng(key)",
            "client_generators",
            "generator, choice and sort",
            "client_generators, choice and sort",
        }
    )
    assert set(draws["few"]) == {"1", "2", "4", "6", "8", "10", "12", "16", "24", "32"} and "together_from" in draws
    assert "draws per client, µs: generator" in run.stdout
    for name in names - {"aggregators", "local_ring", "draws"}:
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert (
            record["device"] == "cpu"
            and record["device_name"] == "cpu"
            and "fedring-batched" in record["seconds_per_round"]
        )
        assert (
            record["data"].startswith("random images in the published formats")
            or record["data"] == "the published files"
        )
    bench = json.loads((tmp_path / "aggregators.json").read_text())
    assert bench["meta"]["device"] == "cpu" and {r["device"] for r in bench["records"]} == {"cpu"}
    assert "=== summary" in run.stdout and "round / ring-mean round" in run.stdout
    assert "ring of 100 on one rank, d=1000, torch on cpu" in run.stdout
    assert "=== batched_clients=None:" in run.stdout and "=== batched_clients=6:" in run.stdout  # the profile


def test_bench_aggregators_on_cpu_tensors(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--clients",
                "9",
                "--dim",
                "500",
                "--repeats",
                "1",
                "--rules",
                "median,krum",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu"
    recs = {r["rule"]: r for r in data["records"]}
    assert list(recs) == ["mean", "median", "krum"]
    for r in recs.values():
        assert r["device"] == "cpu" and r["seconds"] > 0 and r["numpy_seconds"] > 0 and r["peak_extra_bytes"] is None
    assert "| rule | clients | device | runs | fedring (s) |" in capsys.readouterr().out


def test_byzfl_needs_a_device():
    with pytest.raises(Exception, match="--byzfl"):
        main(["--dim", "10", "--byzfl"])


def test_byzfl_pipelines_name_fedring_entries():
    assert set(BYZFL) <= set(ENTRIES)


def test_byzfl_pipelines_compute_fedring_rules():
    """ByzFL's pipeline of each deterministic entry gives fedring's vector on the same rows (float32
    arithmetic in two orders: 1e-5 relative), so the parameters map as the benchmark claims."""
    byzfl = byzfl_module()
    if byzfl is None:
        pytest.skip("ByzFL 0.0.11 is not installed, or cannot import (it needs scipy)")
    rng = np.random.default_rng(3)
    n, d = 11, 40
    X = rng.standard_normal((n, d), dtype=np.float32)
    X[:2] *= 10
    f = 2
    for name in ["mean", "median", "trimmed_mean", "krum", "multikrum", "cclip", "meamed", "monna-0", "clipping+mean"]:
        rule, params, pre, _ = ENTRIES[name]
        ours = make_aggregator(rule, f, params, pre)(X)
        pipeline = byzfl_pipeline(byzfl, name, f, n)
        assert not isinstance(pipeline, str)
        theirs = pipeline[1](torch.from_numpy(X.copy())).numpy()
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5, err_msg=name)
    assert "subsets" in byzfl_pipeline(byzfl, "mda", 24, 100)  # C(100, 24) subsets are not tried
