"""Non-finite uploads: the exclusion policy of every server rule, the ring, the nonfinite attack."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import fedring_many

from fedring.aggregators import AGGREGATORS, make_aggregator
from fedring.aggregators.probe import LinearProbe
from fedring.attacks import AttackContext, NonFinite
from fedring.errors import ConfigError

RNG = np.random.default_rng(5)
X = RNG.standard_normal((12, 40))
POISON = {0: np.nan, 5: np.inf, 11: -np.inf}  # rows 0, 5, 11 hold one non-finite value each


def poisoned(rows):
    Y = X.copy()
    for i in rows:
        Y[i, 3] = POISON[i]
    return Y


def reference_for(rule):
    return np.ones(X.shape[1]) if rule.needs_reference else None


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
@pytest.mark.parametrize("rows", [(0,), (11,), (0, 5, 11)])
def test_every_rule_aggregates_the_finite_rows_told_f_minus_e(name, rows):
    """Whatever the rule and wherever the bad rows sit, the result is the rule on the finite
    rows with f' = f - e declared Byzantine clients, and it is finite."""
    rule = make_aggregator(name, 3 if name != "bulyan" else 2)
    keep = np.setdiff1d(np.arange(12), rows)
    probe = LinearProbe(np.zeros(40), 0.1, (19,)) if rule.needs_probe else None  # DeepSight's model
    got = rule.aggregate(poisoned(rows), reference=reference_for(rule), rng=np.random.default_rng(1), probe=probe)
    want = rule.with_f(max(rule.f - len(rows), 0)).aggregate(
        X[keep], reference=reference_for(rule), rng=np.random.default_rng(1), probe=probe
    )
    assert got.vector.tobytes() == want.vector.tobytes()
    assert np.isfinite(got.vector).all()
    assert np.flatnonzero(got.excluded).tolist() == list(rows)
    assert (got.selected is None) == (not rule.selects)
    if rule.selects:
        assert got.selected[list(rows)].tolist() == [0.0] * len(rows)
        np.testing.assert_array_equal(got.selected[keep], want.selected)


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_every_rule_survives_a_finite_row_whose_float32_squares_overflow(name):
    """A Byzantine upload of finite float32 values above 1e19 overflows the float32 products of the
    Gram passes; CAF, SMEA, DnC, Auror and SimpleClustering used to fail on the infinite matrix (and
    so end the job). The row is finite, so it stays in, and every rule returns a finite vector."""
    rule = make_aggregator(name, 3 if name != "bulyan" else 2)
    Y = X.astype(np.float32)
    Y[4, :5] = 3e30
    probe = LinearProbe(np.zeros(40), 0.1, (19,)) if rule.needs_probe else None
    reference = np.ones(40, np.float32) if rule.needs_reference else None
    with np.errstate(over="ignore", invalid="ignore"):
        got = rule.aggregate(Y, reference=reference, rng=np.random.default_rng(1), probe=probe)
    assert got.excluded is None
    assert np.isfinite(got.vector).all()


def test_too_few_finite_rows_give_the_zero_vector():
    # Krum (paper variant) needs n > 2f + 2: 2 finite rows told f' = 0 are too few
    krum = make_aggregator("krum", 1)
    Y = X[:5].copy()
    Y[[0, 1, 2], 0] = np.nan
    res = krum.aggregate(Y)
    assert res.vector.tolist() == [0.0] * 40 and res.selected.tolist() == [0.0] * 5
    assert res.excluded.tolist() == [True, True, True, False, False]
    every = np.full((3, 2), np.nan)
    assert make_aggregator("mean").aggregate(every).vector.tolist() == [0.0, 0.0]


def test_absent_client_keeps_its_fldetector_state():
    rule = make_aggregator("fldetector", 1, {"window": 2})
    state = rule.init_state(12, 40)
    for t in range(4):
        rule.aggregate(X + t, state=state, rng=np.random.default_rng(t))
    before = {k: np.array(v) for k, v in state.items()}
    rule.aggregate(poisoned((5,)), state=state, rng=np.random.default_rng(9))
    np.testing.assert_array_equal(state["prev"][5], before["prev"][5])  # client 5 was absent
    np.testing.assert_array_equal(state["scores"][:, 5], before["scores"][:, 5])
    assert not np.array_equal(state["prev"][4], before["prev"][4])
    assert int(state["round"]) == 5


def test_bucketing_in_front_of_a_per_client_state_rule_is_refused():
    rule = make_aggregator("fldetector", 1, {}, ["bucketing"], {"bucketing": {}})
    assert "fldetector keeps state per client, and bucketing mixes the clients' rows" in rule.check(8)


def test_nonfinite_attack_parameters():
    ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=None)
    out = NonFinite(fraction=0.25)(np.ones((2, 8)), None, ctx)
    assert np.isnan(out).sum(axis=1).tolist() == [2, 2]  # ceil(0.25 * 8) per attacker
    with pytest.raises(ConfigError, match=r"attack.value: 'zero' is not allowed; allowed: nan, inf, -inf, mixed"):
        NonFinite(value="zero")
    with pytest.raises(ConfigError, match=r"attack.fraction: must be in \(0.0, 1.0\], got 0.0"):
        NonFinite(fraction=0)


SMALL = [
    "--dataset",
    "synthetic",
    "--clients",
    "8",
    "--rounds",
    "4",
    "--eval-every",
    "2",
    "--quiet",
    "--byzantine",
    "2",
    "--attack",
    "nonfinite",
    "--set",
    "attack.value=mixed",
    "--set",
    "attack.fraction=0.3",
]


#: name -> (the rule's settings, whether the model stays finite)
RULES = {
    "server-mean": (
        ["--topology", "server", "--aggregator", "mean"],
        True,
    ),  # excluded before the rule: even mean survives
    "server-krum": (["--topology", "server", "--aggregator", "krum"], True),
    "brace": (["--aggregator", "brace", "--lr", "0.01", "--set", "brace.lambda=1"], True),  # sign_zero votes
    "ring-mean": (["--aggregator", "mean"], False),  # ring-all-reduce has no defence, but the run completes
}


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory):
    """Every rule of RULES on 2 ranks, one job (``{name}.h5``); its stderr."""
    root = tmp_path_factory.mktemp("nonfinite")
    runs = {name: [*SMALL, *rule, "--out", str(root / f"{name}.h5")] for name, (rule, _) in RULES.items()}
    codes, proc = fedring_many(2, runs, root)
    return root, codes, proc.stderr


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RULES))
def test_training_records_nonfinite_uploads(nonfinite_runs, name):
    root, codes, stderr = nonfinite_runs
    update_finite = RULES[name][1]
    out = root / f"{name}.h5"
    assert codes[name] == 0 and "RuntimeWarning" not in stderr
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] == "complete"
        byzantine = f["byzantine/clients"][:]
        flags = f["aggregation/nonfinite"][:]
        assert flags.shape == (4, 8) and flags.dtype == np.uint8
        assert np.array_equal(np.flatnonzero(flags[0]), byzantine) and flags[:, byzantine].all()
        # once ring-all-reduce's model is lost, the honest gradients are not finite either
        assert flags.all(axis=1).tolist() == [False] + [not update_finite] * 3
        assert f["aggregation/nonfinite_update"][:].tolist() == [0 if update_finite else 1] * 4
        assert np.isfinite(f["model/final"][:]).all() == update_finite
