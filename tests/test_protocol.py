"""The robustness literature's protocol settings in a run: client and server optimizer state,
BatchNorm statistics, local epochs, shards and the validation split resume bit-exactly and give
the same results on any number of ranks; bad settings are refused before any work."""

import h5py
import numpy as np
import pytest
from conftest import crash_at_round, fedring
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
    "cnn_bn",
    "--batch-size",
    "64",
]

SETTINGS = {
    # the ring: client momentum with Nesterov, weight decay and clipping, FedAdam, shared BatchNorm statistics,
    # McMahan's shards with a validation split, three local steps
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


@pytest.mark.parametrize("name", SETTINGS)
def test_new_state_resumes_bit_exactly_on_another_rank_count(tmp_path, name):
    settings = [*RUN, *SETTINGS[name]]
    ref, out = tmp_path / "ref.h5", tmp_path / "run.h5"
    fedring(2, *settings, "--out", str(ref))
    with h5py.File(ref, "r") as f:
        slot = f["checkpoint"][f["checkpoint"].attrs["current"]]
        stored = {k: slot[k].shape for k in slot}
        assert {"validation_accuracy", "validation_loss"} <= set(f["metrics"])
    d = stored["w"][0]
    assert stored["client_m"] == (6, d) and stored["optim_m"] == stored["optim_v"] == (d,)
    assert stored["buffers"] == ((162,) if "bn_stats=local" not in settings else (6, 162))
    proc = crash_at_round(tmp_path, 2, 3, [*settings, "--out", str(out)])
    assert proc.returncode != 0
    fedring(3, *settings, "--out", str(out), "--resume")
    assert snapshot(out) == snapshot(ref)


def test_local_steps_give_the_same_model_on_any_rank_count(tmp_path):
    """Local SGD steps train a copy of the shared weights (they once trained the replica itself,
    which made the result depend on how many clients a rank hosted)."""
    finals = []
    for ranks in (1, 3):
        out = tmp_path / f"r{ranks}.h5"
        fedring(
            ranks,
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
            "--out",
            str(out),
        )
        with h5py.File(out, "r") as f:
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
