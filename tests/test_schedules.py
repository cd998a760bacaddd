"""Learning-rate schedules, the drift diagnostics, and the drift of BRACE's printed rule."""

import h5py
import numpy as np
import pytest
from conftest import crash_at_round, fedring, fedring_many

from fedring.errors import ConfigError
from fedring.train.schedules import make_schedule

BRACE = [
    "--dataset",
    "synthetic",
    "--clients",
    "8",
    "--rounds",
    "40",
    "--eval-every",
    "10",
    "--quiet",
    "--aggregator",
    "brace",
    "--lr",
    "0.01",
    "--set",
    "brace.lambda=1",
]


def test_schedule_factors_by_hand():
    assert [make_schedule("constant").factor(t, 10) for t in (0, 9)] == [1.0, 1.0]
    step = make_schedule("step", {"milestones": [0.6], "gamma": 0.5})
    assert [step.factor(t, 10) for t in (0, 5, 6, 9)] == [1.0, 1.0, 0.5, 0.5]
    assert make_schedule("invsqrt", {"tau": 2}).factor(6, 10) == 0.5  # 1 / sqrt(1 + 6/2)
    cosine = make_schedule("cosine", {"final": 0.2})
    assert [cosine.factor(t, 4) for t in (0, 2, 4)] == [1.0, 0.6000000000000001, 0.2]


@pytest.mark.parametrize(
    "name,params,key",
    [
        ("linear", {}, "lr_schedule: unknown lr_schedule 'linear'; allowed: constant, cosine, invsqrt, step"),
        ("step", {"milestones": [1.5]}, "step.milestones: must be in (0, 1], got 1.5"),
        ("step", {"gamma": 0}, "step.gamma: must be > 0"),
        ("step", {"every": 3}, "step.every: unknown parameter of lr_schedule step; allowed: milestones, gamma"),
        ("invsqrt", {"tau": -1}, "invsqrt.tau: must be > 0"),
        ("cosine", {"final": 2}, "cosine.final: must be in [0, 1], got 2.0"),
    ],
)
def test_schedule_errors_name_the_setting(name, params, key):
    with pytest.raises(ConfigError) as e:
        make_schedule(name, params)
    assert str(e.value).startswith(key)


def metrics(path, *names):
    with h5py.File(path, "r") as f:
        return [f[name][:] for name in names]


#: BRACE for 20 rounds with a step schedule, resumed after a crash in round 14 (the mlp: the model does not matter)
STEP = [
    *BRACE,
    "--model",
    "mlp",
    "--rounds",
    "20",
    "--eval-every",
    "5",
    "--lr-schedule",
    "step",
    "--set",
    "step.milestones=[0.5]",
    "--checkpoint-every",
    "5",
]
RULES = ("paper", "symmetric")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank job: STEP (``step.h5``) and BRACE with each printed rule (``paper.h5``, ``symmetric.h5``)."""
    root = tmp_path_factory.mktemp("schedules")
    jobs = {"step": [*STEP, "--out", root / "step.h5"]}
    jobs.update({rule: [*BRACE, "--set", f"brace.rule={rule}", "--out", root / f"{rule}.h5"] for rule in RULES})
    assert fedring_many(2, jobs, root)[0] == dict.fromkeys(jobs, 0)
    return root


@pytest.mark.mpi
@pytest.mark.slow
def test_step_schedule_is_applied_stored_and_resumed_bit_exact(tmp_path, runs):
    full = runs / "step.h5"
    (lr,) = metrics(full, "metrics/lr")
    assert lr.tolist() == [0.01, 0.01, 0.001, 0.001]  # rounds 5, 10 (t = 9 < 10), 15, 20
    part = tmp_path / "part.h5"
    crash_at_round(tmp_path, 2, 13, [*STEP, "--out", str(part)])
    fedring(2, *STEP, "--out", str(part), "--resume")
    a, b = (metrics(p, "model/final", "metrics/test_accuracy", "metrics/weight_mean_change") for p in (full, part))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.mpi
@pytest.mark.slow
def test_paper_rule_drifts_and_the_symmetric_rule_does_not(runs):
    """BRACE's eq. (1) maps every coordinate with S <= lambda to -1, so with w <- w - lr GAR the
    weights climb by about lr per round on weakly agreed coordinates; the symmetric map leaves
    them alone. Deterministic (seeded), so the bounds carry no false-alarm rate."""
    drift, fractions = {}, {}
    for rule in RULES:
        out = runs / f"{rule}.h5"
        drift[rule], plus, minus, zero = metrics(
            out, "metrics/weight_mean_change", "ring/plus_fraction", "ring/minus_fraction", "ring/zero_fraction"
        )
        assert plus.shape == (40,) and np.allclose(plus + minus + zero, 1.0)
        fractions[rule] = (plus.mean(), minus.mean(), zero.mean())
    assert np.all(np.diff(drift["paper"]) > 0) and drift["paper"][-1] > 0.05  # of at most 40 * 0.01
    assert abs(drift["symmetric"][-1]) < 0.2 * drift["paper"][-1]
    plus, minus, zero = fractions["paper"]
    assert zero == 0.0 and minus > 0.55 > plus  # the printed rule has no 0 and leans to -1
    assert fractions["symmetric"][2] > 0.5  # most coordinates are not agreed on: they stay put
