"""Experiment trackers (``--log tensorboard,mlflow``): what they hold, read back with each library's
own reader, equals the results file; a resumed run goes on with the same TensorBoard folder and
MLflow run and logs each step once; a missing extra is a settings error; a tracker that cannot
write fails the run as a full disk does, and ``--resume`` then fills its log in."""

import sys

import h5py
import numpy as np
import pytest
from conftest import crash_at_round, fedring, fedring_many, run_mpi

#: MLflow's SQLite store warns of a loader strategy SQLAlchemy 2.1 deprecates, on each store it opens: not fedring's
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

#: the MLflow run's parameters and the TensorBoard hyperparameters of a training run, as a sample
PARAMS = {"rounds": 6, "dataset": "synthetic", "clients": "6", "nesterov": False}

#: training runs (brace: the ring rules' figures; krum: a server rule, client sampling) on 2 ranks
BRACE = [
    "--clients",
    "6",
    "--aggregator",
    "brace",
    "--byzantine",
    "2",
    "--set",
    "brace.relay_attack=flip",
    "--set",
    "brace.check=on",
]
KRUM = ["--clients", "10", "--topology", "server", "--aggregator", "krum", "--byzantine", "1"]
KRUM += ["--set", "participation=0.6"]
COMMON = ["--dataset", "synthetic", "--model", "mlp", "--rounds", "6", "--eval-every", "2", "--quiet"]

#: what the trackers log of every training run (docs/hdf5.md#experiment-trackers)
EVERY_RUN = {
    "metrics/bytes_sent",
    "metrics/bytes_sent_total",
    "metrics/lr",
    "metrics/server_bytes_sent",
    "metrics/test_accuracy",
    "metrics/test_loss",
    "metrics/train_loss",
    "metrics/wall_seconds",
    "metrics/weight_mean_change",
    "comm/bytes_sent/sum",
    "comm/server_bytes_sent",
    "aggregation/nonfinite/sum",
    "aggregation/nonfinite_update",
}
RING_FIGURES = [
    "integrity_detections",
    "integrity_flagged_counts",
    "minus_fraction",
    "paper_formula_bytes",
    "plus_fraction",
    "rar_formula_bytes",
    "relay_flipped_signs",
    "relay_tampered_hops",
    "zero_fraction",
]
LOGGED = {
    "brace": EVERY_RUN
    | {f"metrics/{name}" for name in RING_FIGURES}
    | {f"ring/{name}" for name in RING_FIGURES}
    | {"ring/detections/sum"},
    # not aggregation/selected (per-client weights)
    "krum": EVERY_RUN | {"participation/byzantine", "participation/cohort/sum", "participation/updated"},
}


def tracked(tmp_path) -> list[str]:
    """``--log tensorboard,mlflow`` into ``tmp_path``: event files under ``runs``, MLflow's SQLite store ``mlflow.db``."""
    return [
        "--log",
        "tensorboard,mlflow",
        "--set",
        f"tensorboard_dir={tmp_path / 'runs'}",
        "--set",
        f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


def expected(f: h5py.File) -> dict[str, tuple[list[int], np.ndarray]]:
    """Every tag the trackers should hold for the results file ``f``: (steps, values), read from the file."""
    rounds = list(range(1, int(f.attrs["rounds_completed"]) + 1))
    out = {}
    if "metrics" in f:
        evaluated = f["metrics/round"][:].tolist()
        out = {f"metrics/{name}": (evaluated, ds[:]) for name, ds in f["metrics"].items() if name != "round"}
    for group in ("comm", "aggregation", "ring", "participation"):
        for name, ds in f.get(group, {}).items():
            path = f"{group}/{name}"
            if ds.ndim == 1:
                out[path] = (rounds, ds[:])
            elif path in ("comm/bytes_sent", "aggregation/nonfinite", "participation/cohort", "ring/detections"):
                out[f"{path}/sum"] = (rounds, ds[:].sum(axis=1))
    if "calibration" in f:
        trials = list(range(1, len(f["calibration/trial"]) + 1))
        for name, ds in f["calibration"].items():
            if ds.ndim == 2:
                out.update({f"calibration/{name}/{case}": (trials, ds[:, case]) for case in range(ds.shape[1])})
    return out


def tensorboard_scalars(folder: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of the TensorBoard folder, read with TensorBoard's own reader: (steps, values) by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0})  # 0: keep every value
    events.Reload()
    return {
        tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
        for tag in events.Tags()["scalars"]
    }


def tensorboard_hparams(folder: str) -> dict:
    """The hyperparameters of the TensorBoard folder (the HPARAMS tab's session start), as Python values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(folder)
    events.Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}


def mlflow_history(uri: str, run_id: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every metric of the MLflow run, read with MLflow's client: (steps, values) by key."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    out = {}
    for key in client.get_run(run_id).data.metrics:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        out[key] = ([m.step for m in history], [m.value for m in history])
    return out


def assert_trackers_match(path, tags: set[str], skip_values: frozenset[str] = frozenset()) -> None:
    """TensorBoard and MLflow hold exactly ``tags``, each step once, with the file's values: float32 in
    TensorBoard, float64 in MLflow; the values of ``skip_values`` (logged before a resume) are not compared."""
    with h5py.File(path, "r") as f:
        want, attrs = expected(f), dict(f.attrs)
    assert set(want) == tags
    board = tensorboard_scalars(attrs["tensorboard_dir"])
    history = mlflow_history(attrs["mlflow_tracking_uri"], attrs["mlflow_run_id"])
    assert set(board) == set(history) == tags
    for tag, (steps, values) in want.items():
        assert board[tag][0] == history[tag][0] == steps, tag
        if tag not in skip_values:
            np.testing.assert_array_equal(np.float32(board[tag][1]), values.astype(np.float32), err_msg=tag)
            np.testing.assert_array_equal(history[tag][1], values.astype(np.float64), err_msg=tag)


def mlflow_run(path):
    """The MLflow run the results file names."""
    from mlflow.tracking import MlflowClient

    with h5py.File(path, "r") as f:
        return MlflowClient(f.attrs["mlflow_tracking_uri"]).get_run(f.attrs["mlflow_run_id"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The brace and krum runs on 2 ranks, in one job, each logging to TensorBoard and MLflow."""
    root = tmp_path_factory.mktemp("tracked")
    runs = {
        name: [*COMMON, *args, *tracked(root), "--out", root / f"{name}.h5"]
        for name, args in [("brace", BRACE), ("krum", KRUM)]
    }
    assert fedring_many(2, runs, root)[0] == dict.fromkeys(runs, 0)
    return root


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", ["brace", "krum"])
def test_trackers_hold_what_the_results_file_holds(trained, name):
    assert_trackers_match(trained / f"{name}.h5", LOGGED[name])


@pytest.mark.mpi
@pytest.mark.slow
def test_one_run_per_results_file_named_after_it_with_the_settings(trained):
    """Rank 0 alone logs: one event file per folder, one MLflow run per results file; the run is
    named after the file, ended as it ended, and has the settings as parameters."""
    from mlflow.tracking import MlflowClient

    folders = sorted((trained / "runs").iterdir())
    assert [folder.name for folder in folders] == ["brace", "krum"]
    assert [len(list(folder.iterdir())) for folder in folders] == [1, 1]
    client = MlflowClient(f"sqlite:///{trained / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fedring").experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["brace", "krum"]
    run = mlflow_run(trained / "brace.h5")
    assert run.info.run_name == "brace" and run.info.status == "FINISHED"
    assert run.data.tags["fedring.results"] == str(trained / "brace.h5") and run.data.tags["fedring.task"] == "train"
    assert {key: run.data.params[key] for key in PARAMS} == {
        "rounds": "6",
        "dataset": "synthetic",
        "clients": "6",
        "nesterov": "false",
    }
    assert run.data.params["brace.check"] == "on" and "out" not in run.data.params
    assert {key: tensorboard_hparams(str(trained / "runs" / "brace"))[key] for key in PARAMS} == {
        **PARAMS,
        "rounds": 6.0,
    }


@pytest.mark.slow
def test_conformal_trials_log_one_value_per_case(tmp_path):
    """A conformal task logs through the same recorder: its (cases,) rows, one tag per case, at the trials done."""
    out = tmp_path / "prism.h5"
    tiny = ["--clients", "12", "--participants", "4", "--dim", "6", "--shared", "2", "--iterations", "60"]
    tiny += ["--byzantine", "3", "--calib-samples", "200", "--test-samples", "100", "--bins", "20"]
    fedring(
        1,
        "conformal",
        "prism",
        *tiny,
        "--trials",
        "2",
        "--calib-attack",
        "efficiency",
        "--quiet",
        *tracked(tmp_path),
        "--out",
        out,
    )
    fields = ["bytes_calib_down", "bytes_calib_up", "bytes_train_down", "bytes_train_up", "coverage", "fp", "mse_db"]
    fields += ["size", "threshold", "tp"]
    assert_trackers_match(
        out, {f"calibration/{field}/0" for field in fields} | {"comm/bytes_sent/sum", "comm/server_bytes_sent"}
    )
    run = mlflow_run(out)
    assert (
        run.data.params["task"] == "prism"
        and run.data.params["prism.trials"] == "2"
        and "rounds" not in run.data.params
    )


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_goes_on_with_the_same_runs_and_logs_each_step_once(tmp_path):
    """A crash after round 4 (checkpoint at 3), then ``--resume`` from the file alone: the same
    TensorBoard folder (a second event file) and MLflow run; round 4, computed again, is not logged
    again, so its wall_seconds is the first run's."""
    out = tmp_path / "run.h5"
    crash_at_round(tmp_path, 2, 4, [*COMMON, *BRACE, *tracked(tmp_path), "--checkpoint-every", "3", "--out", str(out)])
    with h5py.File(out, "r") as f:
        before = {key: f.attrs[key] for key in ("tensorboard_dir", "mlflow_run_id", "mlflow_tracking_uri")}
        assert (f.attrs["status"], f.attrs["rounds_completed"]) == ("failed", 4)
    assert mlflow_run(out).info.status == "FAILED"
    assert tensorboard_scalars(before["tensorboard_dir"])["comm/server_bytes_sent"][0] == [1, 2, 3, 4]
    fedring(2, "run", "--out", out, "--resume")
    with h5py.File(out, "r") as f:
        assert {key: f.attrs[key] for key in before} == before and f.attrs["status"] == "complete"
    assert len(list((tmp_path / "runs" / "run").iterdir())) == 2
    assert mlflow_run(out).info.status == "FINISHED"
    assert_trackers_match(out, LOGGED["brace"], skip_values=frozenset({"metrics/wall_seconds"}))


#: ``python fail_mlflow.py STEP ARGS``: fedring ARGS, MLflow failing to log the metrics of step STEP
FAIL_MLFLOW = """
import sys
from mlflow.tracking import MlflowClient
original = MlflowClient.log_batch
def log_batch(self, run_id, metrics=(), *args, **kwargs):
    if any(m.step == int(sys.argv[1]) for m in metrics):
        raise OSError(28, "No space left on device")
    return original(self, run_id, metrics, *args, **kwargs)
MlflowClient.log_batch = log_batch
from fedring.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_tracker_that_cannot_write_fails_the_run_and_resume_fills_its_log_in(tmp_path):
    """MLflow fails at round 3: the run ends as on a full disk (one line, exit 1, the file failed
    with rounds 1 to 3); ``--resume`` logs round 3 to MLflow, and nothing twice to either tracker."""
    out, script = tmp_path / "run.h5", tmp_path / "fail_mlflow.py"
    script.write_text(FAIL_MLFLOW)
    args = [*COMMON, "--clients", "2", *tracked(tmp_path), "--out", str(out)]
    proc = run_mpi(1, [str(script), "3", *args], check=False)
    with h5py.File(out, "r") as f:
        run_id, uri = f.attrs["mlflow_run_id"], f.attrs["mlflow_tracking_uri"]
        assert (f.attrs["status"], f.attrs["rounds_completed"]) == ("failed", 3)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        f"fedring: error (rank 0): mlflow: could not write to run {run_id} at {uri} ([Errno 28] No space left "
        "on device); the results file keeps every step so far: --resume continues the run and its log"
    ) in proc.stderr.splitlines()
    assert mlflow_history(uri, run_id)["comm/server_bytes_sent"][0] == [1, 2]
    fedring(1, "run", "--out", out, "--resume")
    assert mlflow_run(out).info.status == "FINISHED"
    assert_trackers_match(out, EVERY_RUN, skip_values=frozenset({"metrics/wall_seconds"}))


@pytest.mark.parametrize(
    ("tracker", "module"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("mlflow", "alembic")]
)
def test_a_missing_extra_is_a_settings_error(tmp_path, fedring_cli, monkeypatch, tracker, module):
    """Checked on every rank before any work: one line, exit 2, no results file."""
    monkeypatch.setitem(sys.modules, module, None)  # what an interpreter without the package finds
    proc = fedring_cli(*COMMON, "--log", tracker, "--out", tmp_path / "run.h5")
    assert (proc.returncode, proc.stderr) == (
        2,
        f"fedring: error: log: {tracker} needs the {tracker} extra: pip install 'fedring[{tracker}]'\n",
    )
    assert not (tmp_path / "run.h5").exists()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--log", "tensorbord"],
            "log: unknown tracker 'tensorbord'; did you mean 'tensorboard'? allowed: tensorboard, mlflow",
        ),
        (["--log", "mlflow,mlflow"], "log: names mlflow twice"),
        (["--log", "tensorboard", "--set", "tensorboard_dir="], "tensorboard_dir: must name a folder (default runs)"),
    ],
)
def test_tracker_settings_are_checked(tmp_path, fedring_cli, args, error):
    proc = fedring_cli(*COMMON, *args, "--out", tmp_path / "run.h5")
    assert (proc.returncode, proc.stderr) == (2, f"fedring: error: {error}\n")


def test_a_new_run_never_writes_into_an_earlier_runs_folder(tmp_path):
    """Runs of one name (``--overwrite``, another working directory's results) get a folder each."""
    from fedring.tracking import new_folder

    assert [new_folder(tmp_path / "runs", "run").name for _ in range(3)] == ["run", "run-2", "run-3"]
