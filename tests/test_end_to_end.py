"""Every server rule and every attack in real multi-rank training.

One ``mpiexec -n 2`` job runs all the configurations one after the other (the start-up of
torch is paid once), each into its own results file; the tests then read the files.
"""

import h5py
import numpy as np
import pytest
from conftest import fedring_many

from fedring.aggregators import AGGREGATORS
from fedring.attacks import ATTACKS
from fedring.comm.brace import SIGN_RULES
from fedring.comm.ring import RING_RULES

COMMON = ["--dataset", "synthetic", "--model", "mlp", "--clients", "7", "--quiet", "--lr", "0.01"]
RULES = sorted(AGGREGATORS)
#: Attacks run against the server's mean (a robust rule may rightly leave the model as it
#: was, so only the mean shows every attack's effect) and against BRACE on the ring; 2 of 7
#: clients, drawn from the seed, are Byzantine.
ATTACK_NAMES = sorted(ATTACKS)


def configs():
    runs = {
        f"rule-{rule}": [
            "--topology",
            "server",
            "--aggregator",
            rule,
            "--rounds",
            "3",
            "--byzantine",
            "1",
            "--attack",
            "gaussian",
        ]
        for rule in RULES
    }
    runs["rule-pre"] = [
        "--topology",
        "server",
        "--aggregator",
        "median",
        "--pre-aggregators",
        "nnm,bucketing,clipping",
        "--rounds",
        "3",
        "--byzantine",
        "1",
        "--attack",
        "gaussian",
    ]
    for topology, aggregator in (("server", "mean"), ("ring", "brace")):
        runs[f"{topology}-honest"] = [
            "--topology",
            topology,
            "--aggregator",
            aggregator,
            "--rounds",
            "2",
            "--byzantine",
            "2",
        ]
        for attack in ATTACK_NAMES:
            runs[f"{topology}-{attack}"] = [
                "--topology",
                topology,
                "--aggregator",
                aggregator,
                "--rounds",
                "2",
                "--byzantine",
                "2",
                "--attack",
                attack,
            ]
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    runs = {name: [*COMMON, *args, "--out", str(root / f"{name}.h5")] for name, args in configs().items()}
    return root, fedring_many(2, runs, root, timeout=900)[0]


def load(root, name):
    with h5py.File(root / f"{name}.h5", "r") as f:
        return {
            "status": f.attrs["status"],
            "rounds": int(f.attrs["rounds_completed"]),
            "model": f["model/final"][:],
            "selected": f["aggregation/selected"][:] if "aggregation/selected" in f else None,
            "metrics": {k: v[:] for k, v in f["metrics"].items()},
            "byzantine": f["byzantine/clients"][:],
        }


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("rule", [*RULES, "pre"])
def test_every_server_rule_trains_three_rounds_on_two_ranks(results, rule):
    root, codes = results
    assert codes[f"rule-{rule}"] == 0
    run = load(root, f"rule-{rule}")
    assert run["status"] == "complete" and run["rounds"] == 3
    assert np.all(np.isfinite(run["model"]))
    if run["selected"] is not None:
        assert run["selected"].shape == (3, 7)
        assert np.all((run["selected"] >= 0) & (run["selected"] <= 1))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["server", "ring"])
@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_every_attack_runs_in_both_topologies_and_changes_the_model(results, topology, attack):
    root, codes = results
    assert codes[f"{topology}-{attack}"] == 0
    run, honest = load(root, f"{topology}-{attack}"), load(root, f"{topology}-honest")
    assert run["status"] == "complete" and run["rounds"] == 2
    np.testing.assert_array_equal(run["byzantine"], honest["byzantine"])
    assert run["byzantine"].size == 2
    # same seed, same clients: only the attack differs, and it must have an effect
    assert run["model"].tobytes() != honest["model"].tobytes()
    if attack == "backdoor":
        assert 0 <= run["metrics"]["attack_success_rate"][-1] <= 1


def test_ring_rules_are_ring_all_reduce_crfl_and_the_sign_family():
    assert set(SIGN_RULES) == {"brace", "signsgd", "rlr"}
    assert list(RING_RULES) == ["brace", "crfl", "mean", "rlr", "signsgd"]
