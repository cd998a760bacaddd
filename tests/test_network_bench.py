"""``bench network``: every byte the ledger counts between nodes is on the wire, checked against
the kernel's counters of the emulated cluster's links; refusals before any work."""

from __future__ import annotations

import json
import subprocess

import h5py
import numpy as np
import pytest
from conftest import fedring_many, run_mpi

from fedring.bench import netem, network
from fedring.errors import ConfigError


def namespaces_unavailable() -> str | None:
    """Why this machine cannot build the cluster (None: it can)."""
    lacks = netem.missing()
    if lacks:
        return f"bench network needs {', '.join(lacks)}"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, check=False)
    return f"cannot create a network namespace: {probe.stderr.strip()}" if probe.returncode else None


@pytest.mark.mpi
@pytest.mark.slow
def test_links_carry_what_the_ledger_counts(tmp_path):
    """2 nodes x 1 rank at 1 Gbit/s, d = 2^20. The ledger's inter-node bytes are exact: the ring
    sends d/2 floats per rank and phase (8d bytes in all), BRACE d/2 int8 counts then d/2 bits
    per rank (9d/8), the server 4d up and 4d down. The kernel's count of the links is at least
    that and at most 3 % more: a 9000-byte frame carries 66 bytes of Ethernet, IP and TCP headers
    (0.74 %), the other direction's acknowledgements as much again, MPI adds a header per message
    and the timing a barrier (measured: 0.2-0.4 % above the ledger at this size), besides any TCP
    segment sent again (a drop at a full queue under load: once 5.7 % more on a CI run)."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "network.json"
    d = 2**20
    run_mpi(
        1,
        [
            "-m",
            "fedring",
            "bench",
            "network",
            "--nodes",
            "2",
            "--sizes",
            "20",
            "--repeats",
            "1",
            "--ops",
            "ring,brace,server",
            "--json",
            str(out),
        ],
        timeout=120,
    )
    records = {r["op"]: r for r in json.loads(out.read_text())}
    assert {op: r["ledger_bytes"] for op, r in records.items()} == {"ring": 8 * d, "brace": 9 * d // 8, "server": 8 * d}
    frame = netem.LINK["mtu"] + 14  # a segment sent again crosses the link again: one Ethernet frame at most
    for op, r in records.items():
        again = r["retransmitted_segments"] * frame
        assert r["ledger_bytes"] <= r["link_bytes"] <= 1.03 * r["ledger_bytes"] + again, op
    # each phase's busiest direction carries half the ledger's bytes of that phase, at 1e9 bit/s
    assert records["ring"]["bound_seconds"] == pytest.approx(4 * d * 8 / 1e9)
    assert records["server"]["bound_seconds"] == pytest.approx(8 * d * 8 / 1e9)


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert network.main(["--nodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing root" in err[0]


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--rate", "fast"], "rate"),
        (["--nodes", "1"], "nodes"),
        (["--sizes", "20,x"], "sizes"),
        (["--ops", "ring,nccl"], "ops"),
        (["--repeats", "0"], "repeats"),
        (["--sizes", "30"], "sizes"),
        (["--train", "--rules", "mean,krum"], "rules"),
        (["--train", "--rounds", "1"], "rounds"),
        (["--train", "--nodes", "4", "--clients", "3"], "clients"),
    ],
)
def test_bad_options_are_refused_before_any_work(argv, key):
    with pytest.raises(ConfigError) as e:
        network.settings(argv)
    assert e.value.key == key


def test_ledger_links_of_a_ring_over_two_nodes():
    """4 clients, 2 per node: only the hops 1 -> 2 and 3 -> 0 cross a link."""
    from fedring.comm import Ledger

    ledger = Ledger(4)
    for i, b in enumerate([10, 20, 30, 40]):
        ledger.add(i, "reduce_scatter", b)
    links = network.ledger_links(ledger, ("reduce_scatter", "all_gather"), np.array([0, 0, 1, 1]))
    assert links[0].tolist() == [[20, 40], [40, 20]]  # node 0 sends 1 -> 2, receives 3 -> 0
    assert not links[1].any()


@pytest.mark.mpi
@pytest.mark.slow
def test_training_rounds_split_and_count_bytes_as_a_normal_run(tmp_path):
    """``--train`` on 2 nodes x 1 rank, 4 clients, 2 rounds: every rank's communication time
    is within its round's wall time, the records' medians add up within the slowest rank's,
    and every round's bytes are those the ledger counts in a normal run of the same settings."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "train.json"
    common = ["--nodes", "2", "--clients", "4", "--rounds", "2", "--rules", "mean,brace,median"]
    run_mpi(1, ["-m", "fedring", "bench", "network", "--train", *common, "--json", str(out)], timeout=120)
    records = {r["rule"]: r for r in json.loads(out.read_text())}
    assert list(records) == ["mean", "brace", "median"]
    runs = {rule: [*network.train_argv(rule, 4, 2), "--out", str(tmp_path / f"{rule}.h5")] for rule in records}
    codes, _ = fedring_many(2, runs, tmp_path, timeout=120)
    assert codes == dict.fromkeys(records, 0)
    for rule, r in records.items():
        split = np.array(r["per_round"])  # (rounds, ranks, [seconds, comm_seconds])
        assert split.shape == (2, 2, 2)
        assert (split[:, :, 1] > 0).all() and (split[:, :, 1] <= split[:, :, 0]).all(), rule
        assert 0 < r["comm_seconds"] and 0 < r["compute_seconds"], rule
        assert r["compute_seconds"] + r["comm_seconds"] <= r["seconds"], rule
        with h5py.File(tmp_path / f"{rule}.h5", "r") as f:
            normal = f["comm/bytes_sent"][:].sum(axis=1) + f["comm/server_bytes_sent"][:]
        assert r["bytes_per_round"] == normal.tolist(), rule
