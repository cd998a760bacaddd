"""Client-level differential privacy (fedring.train.privacy): DP-FedAvg's clipping and noise, central
and local, the privacy spent, and its settings."""

import math

import numpy as np
import pytest
from mpi4py import MPI

from fedring.cli.run import build_config
from fedring.comm.ring import Aggregation
from fedring.config import Config
from fedring.errors import ConfigError
from fedring.rng import Stream, generator
from fedring.train.privacy import Privacy


def test_local_release_clips_then_adds_the_clients_own_noise():
    """Clipping to C: a row outside the ball lands on it, one inside stays; the noise is the client's own
    stream of the round, z C times a standard normal draw, added in float32; other rows are untouched."""
    p = Privacy("local", seed=7, clip=2.0, noise_multiplier=0.5)
    rows = np.array([[6.0, 8.0, 0.0], [0.3, 0.4, 0.0], [6.0, 8.0, 0.0]], np.float32)
    out = p.release(rows.copy(), t=3, lo=10, honest=np.array([True, True, False]))
    noise = [generator(7, Stream.DP_LOCAL, client=c, step=3).standard_normal(3, dtype=np.float32) for c in (10, 11)]
    np.testing.assert_array_equal(out[0], np.array([1.2, 1.6, 0.0], np.float32) + np.float32(1.0) * noise[0])
    np.testing.assert_array_equal(out[1], rows[1] + np.float32(1.0) * noise[1])
    np.testing.assert_array_equal(out[2], rows[2])


def test_central_noise_has_the_dp_fedavg_scale():
    """The noise added to the mean of m = 4 rows has standard deviation z C / m: over d = 200,000
    coordinates the sample standard deviation is within 5 standard errors (sd/sqrt(2d)) of it, a false
    alarm rate below 1e-6; it is the same on every replica (drawn from the seed and the round)."""
    p = Privacy("central", seed=1, clip=3.0, noise_multiplier=2.0)
    d, m = 200_000, 4
    update = np.ones(d, np.float32)
    noised = p.noised(Aggregation(update), t=5, m=m)
    sigma, sd = 2.0 * 3.0 / m, float(np.std(noised.update.astype(np.float64) - 1.0))
    assert abs(sd - sigma) <= 5 * sigma / math.sqrt(2 * d)
    np.testing.assert_array_equal(noised.update, p.noised(Aggregation(update), t=5, m=m).update)
    assert not np.array_equal(noised.update, p.noised(Aggregation(update), t=6, m=m).update)
    idle = Aggregation(np.zeros(3, np.float32), updated=False)
    assert p.noised(idle, t=5, m=0) is idle  # a round without an update stays without one


def test_privacy_spent_matches_opacus_and_abadi_et_al():
    """Central: Abadi et al. (CCS 2016), q = 0.01, sigma = 4, 10,000 steps, delta = 1e-5: the moments
    accountant's epsilon 1.26 bounds Opacus' RDP value, which is kept as a literal (Opacus 1.6.0, its
    default orders and more). Local: the Gaussian mechanism of multiplier z / 2 composed without sampling, whose
    RDP at order a is a T / (2 (z/2)^2). Without noise nothing is private; without DP nothing is spent."""
    central = Privacy("central", noise_multiplier=4.0, delta=1e-5)
    assert central.epsilon(10_000, 0.01) == pytest.approx(1.0354900660362476, rel=1e-12)
    assert central.epsilon(10_000, 0.01) < 1.26
    assert central.epsilon(100, 0.01) < central.epsilon(10_000, 0.01) < central.epsilon(10_000, 0.02)
    local = Privacy("local", noise_multiplier=8.0, delta=1e-5)
    orders = np.array([1.5, 2, 4, 8, 16, 32, 64, 128, 256, 4096])
    rdp = orders * 10 / (2 * 4.0**2)
    from opacus.accountants.analysis.rdp import get_privacy_spent

    expected = get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=1e-5)[0]
    assert local.epsilon(10, q=0.3) <= expected  # Opacus' finer orders can only do better
    assert local.epsilon(10, q=0.3) == local.epsilon(10, q=1.0)
    assert Privacy("local", noise_multiplier=0.0).epsilon(1, 1.0) == math.inf
    assert Privacy("none").epsilon(5, 1.0) is None


@pytest.mark.parametrize(
    "args, key, words",
    [
        (["--set", 'dp="centrl"'], "dp", "did you mean 'central'"),
        (["--set", 'dp="central"'], "dp", "a server (--topology server)"),
        (["--topology", "server", "--aggregator", "krum", "--set", 'dp="central"'], "dp", "--aggregator mean"),
        (["--topology", "server", "--pre-aggregators", "nnm", "--set", 'dp="central"'], "dp", "no pre_aggregators"),
        (["--set", 'dp="local"', "--set", "dp.cliip=1"], "dp.cliip", "did you mean 'clip'"),
        (["--set", 'dp="local"', "--set", "dp.clip=0"], "dp.clip", "> 0"),
        (["--set", 'dp="local"', "--set", "dp.delta=1"], "dp.delta", "must be in (0, 1)"),
        (["--set", "dp.clip=1"], "dp.clip", "unknown parameter of dp none"),
    ],
)
def test_bad_dp_settings_are_refused_before_any_work(args, key, words):
    with pytest.raises(ConfigError) as e:
        build_config(["--dataset", "synthetic", "--clients", "4", *args], 1)
    assert e.value.key == key and words in str(e.value)


def test_central_dp_applies_the_mean_of_clipped_uploads_plus_the_rounds_noise():
    """One round in process: the update applied is the mean of the clients' uploads clipped to C, plus
    the round's noise scaled by z C / m, bit for bit (the server clips as the ``clipping`` pre-aggregator)."""
    from fedring.aggregators import make_aggregator
    from fedring.train.loop import train_round
    from fedring.train.task import TrainTask
    from fedring.train.trainer import Trainer

    cfg = Config(dataset="synthetic", model="mlp", clients=4, topology="server", dp="central", quiet=True)
    cfg.sections = {"dp": {"clip": 0.05, "noise_multiplier": 0.3}}
    tr = Trainer(cfg, MPI.COMM_WORLD, parts=TrainTask(cfg, 1).parts)
    seen = []
    aggregate = tr.topology.aggregate

    def record(rows, *args):
        seen.append(rows.copy())
        return aggregate(rows, *args)

    tr.topology.aggregate = record
    result = train_round(tr, 0)
    clipped = make_aggregator("mean", 0, {}, ["clipping"], {"clipping": {"c": 0.05}})(seen[0])
    noise = generator(0, Stream.DP_NOISE, step=0).standard_normal(clipped.size, dtype=np.float32)
    np.testing.assert_array_equal(result.aggregation.update, clipped + np.float32(0.3 * 0.05 / 4) * noise)
    assert np.linalg.norm(seen[0], axis=1).min() > 0.05  # every upload was clipped


def test_dp_without_opacus_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "opacus" else real(name, *a))
    with pytest.raises(ConfigError, match=r"dp: local needs Opacus .*pip install 'fedring\[dp\]'"):
        build_config(["--dataset", "synthetic", "--clients", "4", "--set", 'dp="local"'], 1)
