"""PRISM-FCP end to end: the PSO-Fed recursion against the paper's matrix equations, bytes
measured at M/D, common random numbers (C3, C4), the UCI loader, the command line and its
results file, resume after a failure, TOML settings, and equal results on 1, 2 and 4 MPI
ranks."""

from __future__ import annotations

import itertools
import json
import time

import h5py
import numpy as np
import pytest
from conftest import MPIEXEC, fedring, fedring_many, run_mpi, wait_for_unlock
from mpi4py import MPI

from fedring.comm import Layout, Network
from fedring.conformal.prism import robust_calibrate
from fedring.conformal.prism.environment import synthetic_environment
from fedring.conformal.prism.experiment import case, run_trial
from fedring.conformal.prism.psofed import (
    UplinkNoise,
    client_masks,
    participants,
    train_psofed,
)
from fedring.conformal.prism.settings import settings
from fedring.conformal.prism.uci import (
    COLUMNS,
    client_indices,
    decile_bins,
    load_superconductivity,
    write_standin_csv,
)
from fedring.conformal.trials import read_calibration
from fedring.errors import ConfigError

TINY = dict(
    clients=12,
    participants=4,
    dim=6,
    shared=2,
    iterations=60,
    byzantine=3,
    calib_samples=200,
    test_samples=100,
    bins=20,
)
TINY_ARGS = [
    "--clients",
    "12",
    "--participants",
    "4",
    "--dim",
    "6",
    "--shared",
    "2",
    "--iterations",
    "60",
    "--byzantine",
    "3",
    "--calib-samples",
    "200",
    "--test-samples",
    "100",
    "--bins",
    "20",
]


def network(n_clients: int) -> Network:
    """The real network on one rank (every message a memory copy)."""
    return Network(Layout(n_clients, MPI.COMM_SELF))


@pytest.fixture(scope="module")
def net():
    return network(TINY["clients"])


def _reference_psofed(cfg, env, shared, seed, trial):
    """The paper's recursions (Sec. II-B, II-C) written literally with D x D matrices."""
    K, D, N, P = cfg.clients, cfg.dim, cfg.iterations, cfg.participants
    masks = client_masks(cfg, seed, trial, range(K), shared)
    parts = participants(cfg, seed, trial)
    byz = UplinkNoise(cfg, seed, trial, env)

    def S(k, n):
        m = np.zeros((D, D))
        m[masks[n, k], masks[n, k]] = 1.0
        return m

    eye = np.eye(D)
    w, wk = np.zeros(D), np.zeros((K, D))
    for n in range(1, N + 1):
        part = set(parts[n - 1].tolist())
        new_wk = wk.copy()
        for k in range(K):
            x, y = env.x_train[n - 1, k], env.y_train[n - 1, k]
            if k in part:
                prior = S(k, n - 1) @ w + (eye - S(k, n - 1)) @ wk[k]
            elif cfg.local_updates:
                prior = wk[k]
            else:
                continue
            eps = y - prior @ x
            new_wk[k] = prior + cfg.step * x * eps
        wk = new_wk
        total = np.zeros(D)
        for k in sorted(part):
            sent = wk[k].copy()
            if env.is_byzantine[k] and byz.tau[n - 1, k]:
                noise = byz.delta[byz.slot[k], n - 1]
                if cfg.byz_persist == "full":
                    wk[k] = wk[k] + noise
                elif cfg.byz_persist == "sent":
                    wk[k] = wk[k] + S(k, n) @ noise
                sent = sent + noise
            total += S(k, n) @ sent + (eye - S(k, n)) @ w
        w = total / P
    return w


@pytest.mark.parametrize("persist,local", [("none", True), ("sent", False), ("full", True), ("sent", True)])
def test_psofed_matches_the_paper_recursion(net, persist, local):
    cfg = settings(byz_persist=persist, local_updates=local, attack_prob=0.5, **TINY)
    env = synthetic_environment(cfg, 3, 0, 0, cfg.clients)
    got = train_psofed(cfg, env, cfg.shared, net, 3, 0)
    np.testing.assert_allclose(got.w, _reference_psofed(cfg, env, cfg.shared, 3, 0), rtol=1e-11, atol=1e-13)


def test_training_bytes_are_M_over_D_of_full_sharing(net):
    cfg = settings(**TINY)
    env = synthetic_environment(cfg, 0, 0, 0, cfg.clients)
    part = train_psofed(cfg, env, cfg.shared, net, 0, 0)
    full = train_psofed(cfg, env, cfg.dim, net, 0, 0)
    per_iter = cfg.participants * 8  # float64 values per participant
    assert (part.bytes_up, part.bytes_down) == (60 * per_iter * 2, 60 * per_iter * 2)
    assert (full.bytes_up, full.bytes_down) == (60 * per_iter * 6, 60 * per_iter * 6)
    assert part.bytes_up / full.bytes_up == cfg.shared / cfg.dim


def test_lms_learns_without_attack(net):
    cfg = settings(profile="stable", **{**TINY, "iterations": 3000, "byzantine": 0})
    env = synthetic_environment(cfg, 1, 0, 0, cfg.clients)
    w = train_psofed(cfg, env, cfg.shared, net, 1, 0).w
    assert np.mean((w - env.w_star) ** 2) < 1e-4  # from ||w*||^2 / D = 0.17 at the start


def _cases(cfg, attacks=("efficiency", "coverage", "random")):
    return [
        case(a, m, s, r)
        for a in attacks
        for m, s, r in (
            ("prism", cfg.shared, "known"),
            ("prism", cfg.dim, "known"),
            ("robfcp", cfg.dim, "known"),
            ("fcp", cfg.dim, None),
        )
    ]


def test_common_random_numbers_C3_C4(net):
    cfg = settings(**TINY)
    cases = _cases(cfg)
    rec = run_trial(cfg, cases, 5, 0, net)
    by = {(c["attack"], c["method"], c["shared"]): i for i, c in enumerate(cases)}
    for a in ("efficiency", "coverage", "random"):
        i, j = by[(a, "prism", cfg.dim)], by[(a, "robfcp", cfg.dim)]
        for k in rec:  # C4: PRISM-FCP at M = D is Rob-FCP
            assert np.array_equal(rec[k][i], rec[k][j]), k
        assert rec["tp"][j] == 3 and rec["fp"][j] == 0
    for m, s in (("prism", cfg.shared), ("robfcp", cfg.dim)):  # C3: same retained data
        i, j = by[("efficiency", m, s)], by[("coverage", m, s)]
        assert rec["threshold"][i] == rec["threshold"][j] and rec["coverage"][i] == rec["coverage"][j]
    train_up = rec["bytes_train_up"]
    assert train_up[by[("efficiency", "prism", 2)]] * 3 == train_up[by[("efficiency", "fcp", 6)]]
    again = run_trial(cfg, cases, 5, 0, net)
    assert all(np.array_equal(rec[k], again[k]) for k in rec)
    other = run_trial(cfg, cases, 6, 0, net)
    assert not np.array_equal(rec["threshold"], other["threshold"])


def test_fcp_breaks_and_prism_holds_under_attack():
    cfg = settings(**{**TINY, "clients": 40, "byzantine": 8, "calib_samples": 500})
    cases = _cases(cfg)
    recs = [run_trial(cfg, cases, 0, t, network(40)) for t in range(3)]
    cov = {c["label"]: np.mean([r["coverage"][i] for r in recs]) for i, c in enumerate(cases)}
    for c in cases:
        v = cov[c["label"]]
        if c["method"] == "fcp" and c["attack"] == "coverage":
            assert v == 1.0
        elif c["method"] == "fcp" and c["attack"] == "efficiency":
            assert 0.86 < v < 0.89  # C1: 1 - (1 - 0.9) * 40/32 = 0.875
        elif c["method"] != "fcp":
            assert 0.88 < v < 0.92
    # deterministic attacks are always caught; the random one (sigma_C = 0.5) only once the
    # model is trained well enough for benign scores to be small (not in 60 iterations)
    assert all(
        r["tp"][i] == 8 and r["fp"][i] == 0
        for r in recs
        for i, c in enumerate(cases)
        if c["filter"] and c["attack"] != "random"
    )


def test_calibration_speed():
    rng = np.random.default_rng(0)
    scores = np.abs(rng.standard_normal((100, 1000))) * rng.uniform(0.1, 0.3, (100, 1))
    scores[:20] = 0.0
    t0 = time.perf_counter()
    for rule in ("known", "mad"):
        res = robust_calibrate(scores, 0.1, rule, n_byzantine=20)
    assert time.perf_counter() - t0 < 1.0  # typically ~20 ms for both
    assert res.flagged[:20].all()


# ---- UCI Superconductivity loader (on a small file in the real format) --------------------


@pytest.fixture(scope="module")
def uci_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("uci")
    write_standin_csv(d / "train.csv", np.random.default_rng(0), n_rows=600)
    return d


def test_uci_loader_and_split(uci_dir):
    data = load_superconductivity(uci_dir)
    assert data.x.shape == (600, 81) and data.y.shape == (600,) and len(COLUMNS) == 82
    np.testing.assert_allclose(data.x.mean(axis=0), 0, atol=1e-9)
    np.testing.assert_allclose(data.y.std(), 1.0)
    assert data.y_std > 0 and data.feature_names[0] == "number_of_elements"
    bins = decile_bins(data.y)
    assert [b.size for b in bins] == [60] * 10
    assert all(data.y[a].max() <= data.y[b].min() for a, b in itertools.pairwise(bins))
    idx = client_indices(bins, np.random.default_rng(1), 3000)
    assert idx.size == 3000 and idx.min() >= 0 and idx.max() < 600
    bad = uci_dir / "bad"
    bad.mkdir()
    (bad / "train.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError) as e:
        load_superconductivity(bad)
    assert e.value.key == "prism.data_dir"
    with pytest.raises(ConfigError):
        load_superconductivity(uci_dir / "missing")


def test_uci_trial(uci_dir):
    cfg = settings(
        dataset="uci",
        data_dir=str(uci_dir),
        clients=10,
        participants=4,
        byzantine=2,
        iterations=100,
        calib_samples=100,
        test_samples=100,
        shared=20,
    )
    data = load_superconductivity(uci_dir)
    cases = [case("coverage", "prism", 20, "known"), case("coverage", "fcp", 81, None)]
    rec = run_trial(cfg, cases, 0, 0, network(10), data)
    assert rec["tp"][0] == 2 and rec["coverage"][1] == 1.0
    assert rec["size"][0] == pytest.approx(2 * rec["threshold"][0] * data.y_std)
    assert rec["bytes_train_up"][0] * 81 == rec["bytes_train_up"][1] * 20


# ---- command line, results file, resume, TOML settings and MPI -----------------------------


def prism(ranks: int, *args: str, **kw):
    """``python -m fedring conformal prism`` with the tiny settings (under mpiexec for ranks > 1)."""
    return fedring(ranks, "conformal", "prism", *TINY_ARGS, "--quiet", *args, **kw)


def rows_of(path) -> dict[str, np.ndarray]:
    """Every row dataset of a conformal results file: /calibration and /comm."""
    with h5py.File(path) as f:
        assert f.attrs["status"] == "complete"
        return {f"{g}/{name}": ds[()] for g in ("calibration", "comm") for name, ds in f[g].items()}


def assert_same_rows(a, b) -> None:
    ra, rb = rows_of(a), rows_of(b)
    assert sorted(ra) == sorted(rb)
    for name in ra:
        assert np.array_equal(ra[name], rb[name]), name


@pytest.mark.slow
def test_cli_writes_hdf5_and_refuses_overwrite(tmp_path, fedring_cli):
    out = tmp_path / "r.h5"
    args = ["--trials", "2", "--calib-attack", "efficiency", "--out", str(out)]
    prism(1, *args)
    attrs, rows = read_calibration(out)
    assert attrs["size_kind"] == "interval width" and attrs["alpha"] == 0.1
    assert attrs["cases"] == [
        {"label": "efficiency/prism/M=2", "method": "prism", "attack": "efficiency", "shared": 2, "filter": "known"}
    ]
    assert attrs["settings"]["clients"] == 12 and attrs["settings"]["profile"] == "paper-fit"
    assert rows["trial"].tolist() == [0, 1]
    for name in (
        "coverage",
        "size",
        "threshold",
        "mse_db",
        "tp",
        "fp",
        "bytes_train_up",
        "bytes_train_down",
        "bytes_calib_up",
        "bytes_calib_down",
    ):
        assert rows[name].shape == (2, 1), name
    assert rows["flagged"].shape == (2, 1, 12) and rows["flagged"].dtype == np.uint8
    assert (rows["tp"] == 3).all() and (rows["fp"] == 0).all()
    assert rows["bytes_train_up"][0, 0] == 60 * 4 * 2 * 8
    with h5py.File(out) as f:
        assert f.attrs["status"] == "complete" and f.attrs["task"] == "prism"
        sent = f["comm/bytes_sent"][()]
        assert sent.shape == (2, 12) and sent[0].sum() == rows["bytes_train_up"][0, 0] + rows["bytes_calib_up"][0, 0]
    again = fedring_cli("conformal", "prism", *TINY_ARGS, "--quiet", *args)
    assert again.returncode == 2 and "exists" in again.stderr
    prism(1, *args, "--overwrite")


@pytest.mark.parametrize(
    "bad",
    [
        ["--shared", "99"],
        ["--trials", "0"],
        ["--method", "krum"],
        ["--dataset", "uci"],
        ["--dataset", "uci", "--data-dir", "/nonexistent"],
        ["--byz-persist", "maybe"],
        ["--clients", "12", "--byzantine", "12"],
        ["--set", "coverage.factor=0"],
        ["--set", "krum.variant=byzfl"],
    ],
)
def test_cli_rejects_bad_settings(bad, tmp_path, fedring_cli):
    proc = fedring_cli("conformal", "prism", *TINY_ARGS, "--quiet", *bad, "--out", tmp_path / "x.h5")
    assert proc.returncode == 2 and "error" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_one_two_and_four_ranks_give_the_same_results(tmp_path):
    """Every case of the table (every attack, the omniscient coverage attack's side channel
    included) gives bit-identical rows on 1, 2 and 4 ranks."""
    common = ["--table", "--trials", "2", "--set", "coverage.mean=benign"]
    for ranks in (1, 2, 4):
        prism(ranks, *common, "--out", str(tmp_path / f"{ranks}.h5"), timeout=180)
    assert_same_rows(tmp_path / "1.h5", tmp_path / "2.h5")
    assert_same_rows(tmp_path / "1.h5", tmp_path / "4.h5")


#: ``python crash.py TRIAL ARGS...``: fedring ARGS, raising in trial TRIAL (0-based) on every rank.
CRASH_AT_TRIAL = """
import sys
from fedring.conformal.prism.experiment import PrismJob
original = PrismJob.run_batch
def run_batch(self, trials):
    if trials[0] == int(sys.argv[1]):
        raise RuntimeError("injected failure on purpose")
    return original(self, trials)
PrismJob.run_batch = run_batch
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_after_a_failure_ends_with_the_rows_of_an_uninterrupted_run(tmp_path):
    """A run that fails in trial 2 of 4 (on 2 ranks when mpiexec is there) keeps trials 0
    and 1; --resume (on 1 rank) continues with trial 2 and ends with the same rows as a run
    that never stopped."""
    args = ["--calib-attack", "random", "--trials", "4"]
    prism(1, *args, "--out", str(tmp_path / "whole.h5"))
    script, out = tmp_path / "crash.py", tmp_path / "resumed.h5"
    script.write_text(CRASH_AT_TRIAL)
    ranks = 2 if MPIEXEC else 1
    proc = run_mpi(
        ranks, [str(script), "2", "conformal", "prism", *TINY_ARGS, "--quiet", *args, "--out", str(out)], check=False
    )
    assert proc.returncode != 0 and "injected failure on purpose" in proc.stderr
    wait_for_unlock(out)
    with h5py.File(out) as f:
        assert f.attrs["status"] == "failed" and f["calibration/trial"][()].tolist() == [0, 1]
    prism(1, *args, "--out", str(out), "--resume")
    assert_same_rows(tmp_path / "whole.h5", out)


@pytest.mark.slow
def test_toml_settings_run_through_fedring_run(tmp_path):
    """``task = "prism"`` with a [prism] section (and an attack's section) is the same run as
    the command-line spelling; the attack's parameter takes effect."""
    toml = tmp_path / "x.toml"
    values = "\n".join(f"{k} = {json.dumps(v)}" for k, v in TINY.items())
    toml.write_text(
        f'task = "prism"\nseed = 3\n\n[prism]\n{values}\nmethod = "fcp"\ncalib_attack = "coverage"\n'
        "trials = 2\n\n[coverage]\nfactor = 5.0\n"
    )
    args = [
        "conformal",
        "prism",
        *TINY_ARGS,
        "--quiet",
        "--method",
        "fcp",
        "--calib-attack",
        "coverage",
        "--trials",
        "2",
        "--seed",
        "3",
    ]
    runs = {
        "toml": ["run", "--config", toml, "--out", tmp_path / "toml.h5"],  # the one run that prints its banner
        "cli": [*args, "--set", "coverage.factor=5", "--out", tmp_path / "cli.h5"],
        "ten": [*args, "--out", tmp_path / "ten.h5"],
    }
    codes, proc = fedring_many(1, runs, tmp_path)  # one after the other in one process
    assert codes == dict.fromkeys(runs, 0)
    assert "fedring: prism: FCP (M=6 of D=6), calibration attack coverage; 12 clients on 1 rank" in proc.stdout
    assert_same_rows(tmp_path / "toml.h5", tmp_path / "cli.h5")
    _, five = read_calibration(tmp_path / "toml.h5")
    _, ten = read_calibration(tmp_path / "ten.h5")
    assert (five["threshold"] < ten["threshold"]).all()  # FCP's threshold is an attacker's value


@pytest.mark.slow
def test_P14_partial_sharing_lowers_mse_and_width():
    """Table I: under the training attack, M/D < 1 gives a smaller parameter MSE
    and narrower intervals than full sharing (here by > 3 dB in each of 3 trials)."""
    cfg = settings(
        clients=50, participants=10, dim=20, shared=6, iterations=600, byzantine=10, calib_samples=300, test_samples=200
    )
    net = network(50)
    cases = [case("efficiency", "prism", 6, "known"), case("efficiency", "robfcp", 20, "known")]
    for t in range(3):
        rec = run_trial(cfg, cases, 0, t, net)
        assert rec["mse_db"][1] - rec["mse_db"][0] > 3
        assert rec["size"][0] < rec["size"][1]
