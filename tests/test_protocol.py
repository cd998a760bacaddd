"""The robustness literature's protocol settings in a run: client and server optimizer state,
BatchNorm statistics, local epochs, shards and the validation split resume bit-exactly and give
the same results on any number of ranks; bad settings are refused before any work."""

import h5py
import numpy as np
import pytest
from conftest import crash_at_round, fedring, fedring_many
from test_resume import snapshot

from fedring.cli.run import build_config
from fedring.errors import ConfigError

RUN = [
    "--dataset",
    "synthetic",
    "--clients",
    "6",
    "--rounds",
    "5",
    "--eval-every",
    "2",
    "--checkpoint-every",
    "2",
    "--quiet",
    "--model",
    "bn_mlp:BatchNormMLP",
    "--batch-size",
    "64",
]

SETTINGS = {
    # the ring: client momentum with Nesterov, weight decay and clipping, FedAdam, shared BatchNorm statistics,
    # McMahan's shards with a validation split, three local steps, local DP (noise per client and round)
    "ring-adam": [
        "--local-steps",
        "3",
        "--partition",
        "shards",
        "--set",
        "momentum=0.9",
        "--set",
        "nesterov=true",
        "--set",
        "weight_decay=0.001",
        "--set",
        "clip_norm=5",
        "--set",
        "server_optimizer=adam",
        "--set",
        "adam.lr=0.01",
        "--set",
        "validation=0.1",
        "--set",
        'dp="local"',
        "--set",
        "dp.clip=5",
        "--set",
        "dp.noise_multiplier=0.1",
    ],
    # DP-FedAvg on a server (central noise, keyed by the round) over cohorts of half the clients, FedAdam
    "server-dp": [
        "--topology",
        "server",
        "--set",
        'dp="central"',
        "--set",
        "dp.noise_multiplier=0.5",
        "--set",
        "participation=0.5",
        "--set",
        "momentum=0.9",
        "--set",
        "server_optimizer=adam",
        "--set",
        "validation=0.1",
    ],
    # a server rule under an omniscient attack on momentum vectors: FedYogi, BatchNorm statistics kept per
    # client, one local epoch
    "server-yogi": [
        "--topology",
        "server",
        "--aggregator",
        "median",
        "--byzantine",
        "1",
        "--attack",
        "alie",
        "--set",
        "local_epochs=1",
        "--batch-size",
        "256",
        "--set",
        "momentum=0.5",
        "--set",
        "server_optimizer=yogi",
        "--set",
        "bn_stats=local",
        "--set",
        "validation=0.2",
    ],
}


#: a run whose local SGD steps must give the same model on any number of ranks
LOCAL_STEPS = [
    "--dataset",
    "synthetic",
    "--clients",
    "3",
    "--rounds",
    "3",
    "--eval-every",
    "3",
    "--quiet",
    "--local-steps",
    "3",
    "--topology",
    "server",
    "--aggregator",
    "median",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``ref-{name}.h5``: each of SETTINGS uninterrupted on 2 ranks (one job); ``run-{name}.h5``: each
    crashed in round 4 on 2 ranks (a job each), then all resumed on 3 ranks in one job, which also
    writes ``local-3.h5`` (LOCAL_STEPS; ``local-1.h5`` on one rank)."""
    root = tmp_path_factory.mktemp("protocol")
    refs = {name: [*RUN, *SETTINGS[name], "--out", root / f"ref-{name}.h5"] for name in SETTINGS}
    assert fedring_many(2, refs, root)[0] == dict.fromkeys(refs, 0)
    for name in SETTINGS:
        crash_at_round(root, 2, 3, [*RUN, *SETTINGS[name], "--out", str(root / f"run-{name}.h5")])
    on3 = {name: [*RUN, *SETTINGS[name], "--out", root / f"run-{name}.h5", "--resume"] for name in SETTINGS}
    on3["local"] = [*LOCAL_STEPS, "--out", root / "local-3.h5"]
    assert fedring_many(3, on3, root)[0] == dict.fromkeys(on3, 0)
    fedring(1, *LOCAL_STEPS, "--out", str(root / "local-1.h5"))
    return root


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", SETTINGS)
def test_new_state_resumes_bit_exactly_on_another_rank_count(runs, name):
    settings = [*RUN, *SETTINGS[name]]
    with h5py.File(runs / f"ref-{name}.h5", "r") as f:
        slot = f["checkpoint"][f["checkpoint"].attrs["current"]]
        stored = {k: slot[k].shape for k in slot}
        assert {"validation_accuracy", "validation_loss"} <= set(f["metrics"])
    d = stored["w"][0]
    assert stored["client_m"] == (6, d) and stored["optim_m"] == stored["optim_v"] == (d,)
    assert stored["buffers"] == ((33,) if "bn_stats=local" not in settings else (6, 33))
    assert snapshot(runs / f"run-{name}.h5") == snapshot(runs / f"ref-{name}.h5")


@pytest.mark.mpi
@pytest.mark.slow
def test_local_steps_give_the_same_model_on_any_rank_count(runs):
    """Local SGD steps train a copy of the shared weights (they once trained the replica itself,
    which made the result depend on how many clients a rank hosted)."""
    finals = []
    for ranks in (1, 3):
        with h5py.File(runs / f"local-{ranks}.h5", "r") as f:
            finals.append(f["model/final"][:])
    assert np.array_equal(*finals)


@pytest.mark.parametrize(
    "args, key",
    [
        (["--set", "local_epochs=2", "--local-steps", "3"], "local_epochs"),
        (["--set", "local_epochs=0"], "local_epochs"),
        (["--set", "nesterov=true"], "nesterov"),
        (["--set", "momentum=1"], "momentum"),
        (["--set", "clip_norm=-1"], "clip_norm"),
        (["--set", "server_optimizer=adamw"], "server_optimizer"),
        (["--set", "server_optimizer=adam", "--set", "adam.beta=0.9"], "adam.beta"),
        (["--set", "yogi.tau=0.1"], "yogi"),  # a section of a server optimizer the run does not use
        (["--set", "shards.per_client=2"], "shards"),  # and of a partition it does not use
        (["--partition", "shards", "--set", "shards.per_client=0"], "shards.per_client"),
        (["--set", "validation=1"], "validation"),
        (["--set", "bn_stats=mean"], "bn_stats"),
    ],
)
def test_bad_protocol_settings_are_refused(tmp_path, args, key):
    with pytest.raises(ConfigError) as e:
        build_config(["--dataset", "synthetic", "--clients", "4", "--out", str(tmp_path / "x.h5"), *args], 1)
    assert e.value.key == key
