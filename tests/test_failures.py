"""Bad input stops every rank with exit 2 and no file; a crash on any rank ends the job promptly.

The settings errors are checked in this process (one rank, ``fedring_cli``); one of them, a
setting wrong for the number of ranks, under ``mpiexec -n 2``: said once, every rank exits 2."""

import time

import h5py
import pytest
from conftest import fedring, run_mpi

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--clients", "4", "--rounds", "2", "--quiet"]


@pytest.mark.parametrize(
    "args,key",
    [
        (["--topology", "mesh"], "topology: 'mesh' is not allowed; allowed: ring, server"),
        (["--rounds", "0"], "rounds: must be >= 1"),
        (["--set", "bogus=3"], "bogus: unknown setting"),
        (["--set", "krun.f=3"], "krun: unknown settings section"),
        (["--set", "krum.variant=nope", "--topology", "server", "--aggregator", "krum"], "krum.variant"),
        (["--attack", "gaussian"], "byzantine: --attack gaussian needs Byzantine clients"),
        (["--attack", "gaussian", "--byzantine", "1", "--set", "attack.sigma=-1"], "attack.sigma"),
        (["--set", "rounds=many"], "rounds: must be an integer, got 'many'"),
        (["--aggregator", "nope"], "aggregator: "),
        (["--partition", "dirichlet", "--noniid", "0"], "noniid: Dirichlet alpha must be > 0"),
        (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], "data_dir: Fashion-MNIST files"),
        (["--config", "/nonexistent.toml"], "config: file /nonexistent.toml does not exist"),
        (["--frobnicate"], "arguments: unrecognized arguments: --frobnicate"),
        (["--round", "5"], "arguments: unknown option --round; did you mean --rounds?"),  # no abbreviations
        (["--set", "brace.lambda=3"], "brace: settings of brace, which this run does not use (aggregator mean"),
        (
            ["--aggregator", "brace", "--set", "brace.relay_clients=[1]"],
            "brace.relay_clients: in a run the Byzantine clients are the relays",
        ),
    ],
)
def test_config_errors_exit_2_before_any_work(tmp_path, fedring_cli, args, key):
    out = tmp_path / "x.h5"
    proc = fedring_cli(*SMALL, "--out", out, *args)
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    assert proc.stderr.count("fedring: error") == 1
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.mpi
def test_config_error_on_two_ranks_is_said_once_and_every_rank_exits_2(tmp_path):
    out = tmp_path / "x.h5"
    proc = fedring(2, *SMALL, "--out", str(out), "--clients", "1", check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "clients: 1 clients on 2 MPI ranks" in proc.stderr
    assert proc.stderr.count("fedring: error") == 1  # said once, by rank 0
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_existing_output_needs_overwrite(tmp_path, fedring_cli):
    out = tmp_path / "x.h5"
    out.write_bytes(b"keep me")
    proc = fedring_cli(*SMALL, "--out", out)
    assert proc.returncode == 2 and "pass --overwrite" in proc.stderr
    assert out.read_bytes() == b"keep me"
    fedring(1, *SMALL, "--out", str(out), "--overwrite")
    with h5py.File(out) as f:
        assert f.attrs["status"] == "complete"


@pytest.mark.slow
def test_toml_config_and_precedence(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "synthetic"\nmodel = "mlp"\nclients = 4\nrounds = 5\nseed = 3\n')
    out = tmp_path / "c.h5"
    fedring(1, "--config", str(cfg), "--set", "rounds=3", "--rounds", "2", "--quiet", "--out", str(out))
    with h5py.File(out) as f:
        import json

        c = json.loads(f.attrs["config"])
        assert (c["rounds"], c["seed"], c["clients"]) == (2, 3, 4)
        assert f.attrs["rounds_completed"] == 2


CRASH = """
import sys
import fedring.train.loop as training
original = training.train_round
def train_round(tr, t):
    if tr.comm.rank == int(sys.argv[1]) and t == 2:
        raise RuntimeError("injected failure on purpose")
    return original(tr, t)
training.train_round = train_round
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("failing_rank", [0, 2])
def test_exception_on_any_rank_ends_job_with_traceback(tmp_path, failing_rank):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    out = tmp_path / "crash.h5"
    t0 = time.perf_counter()
    proc = run_mpi(
        3,
        [
            str(script),
            str(failing_rank),
            "--dataset",
            "synthetic",
            "--clients",
            "3",
            "--rounds",
            "50",
            "--eval-every",
            "1",
            "--quiet",
            "--out",
            str(out),
        ],
        check=False,
        timeout=90,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0
    assert "RuntimeError: injected failure on purpose" in proc.stderr
    assert f"rank {failing_rank} failed" in proc.stderr
    assert elapsed < 60
    with h5py.File(out, "r") as f:  # readable, every completed round kept
        assert f.attrs["status"] == "failed"
        assert f["metrics/round"][:].tolist() == [1, 2]


def test_headline_refuses_to_replace_earlier_results(tmp_path, fedring_cli):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "headline-brace.h5").write_bytes(b"earlier")
    proc = fedring_cli(cwd=tmp_path)
    assert proc.returncode == 2
    assert "out: results/headline-brace.h5 exist(s) from an earlier run" in proc.stderr
    assert (tmp_path / "results" / "headline-brace.h5").read_bytes() == b"earlier"
    assert not (tmp_path / "results" / "headline-ring-all-reduce.h5").exists()
