"""Resume: a run interrupted at any point and resumed ends bit-identical to an uninterrupted one.

The uninterrupted reference runs are made once per module, in one job (``fedring_many``)."""

import shutil
import signal
import subprocess
import time

import h5py
import pytest
from conftest import MPIEXEC, crash_at_round, fedring, fedring_many, many_printed, paused_at_round, wait_for_unlock

from fedring.results import read_checkpoint

RUN = [
    "--dataset",
    "synthetic",
    "--model",
    "mlp",
    "--clients",
    "4",
    "--rounds",
    "7",
    "--eval-every",
    "2",
    "--checkpoint-every",
    "2",
    "--quiet",
]

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def snapshot(path):
    with h5py.File(path, "r") as f:
        return {
            "status": f.attrs["status"],
            "rounds": int(f.attrs["rounds_completed"]),
            "model": f["model/final"][:].tobytes() if "model/final" in f else None,
            **{f"metrics/{k}": v[:].tobytes() for k, v in f.get("metrics", {}).items() if k != "wall_seconds"},
            "comm": f["comm/bytes_sent"][:].tobytes(),
        }


#: stateful rules: server rules with a previous aggregate or FL-Detector's history, BRACE's relays and rows;
#: and 3DFed, whose attacker reads last round's indicators
RULES = {
    "cclip": ["--topology", "server", "--aggregator", "cclip"],
    "fldetector": ["--topology", "server", "--aggregator", "fldetector"],
    "brace": [
        "--aggregator",
        "brace",
        "--byzantine",
        "2",
        "--set",
        "brace.relay_attack=flip",
        "--set",
        "brace.check=on",
    ],
    "threedfed": [
        "--topology",
        "server",
        "--aggregator",
        "mean",
        "--byzantine",
        "2",
        "--attack",
        "threedfed",
        "--set",
        "attack.num_neurons=3",
        "--set",
        "attack.poison_epochs=2",
    ],
}


def rule_settings(rule: str) -> list[str]:
    return [*RUN, *RULES[rule], "--clients", "6"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs on 2 ranks, one job: RUN (``ref.h5``) and RUN with each of RULES."""
    root = tmp_path_factory.mktemp("ref")
    runs = {"ref": [*RUN, "--out", str(root / "ref.h5")]}
    runs.update({rule: [*rule_settings(rule), "--out", str(root / f"{rule}.h5")] for rule in RULES})
    assert fedring_many(2, runs, root)[0] == dict.fromkeys(runs, 0)
    return root


@pytest.fixture(scope="module")
def reference(references):
    return snapshot(references / "ref.h5")


#: runs crashed in a round (0-based) and resumed: name -> (settings, round); the stateful rules crash in round 6
CRASHES = {"round-1": (RUN, 1), "round-6": (RUN, 6), **{rule: (rule_settings(rule), 5) for rule in RULES}}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each of CRASHES crashed on 2 ranks (a job each), then all resumed in one 2-rank job:
    the directory of the files (``{name}.h5``) and each one's status after its crash."""
    root = tmp_path_factory.mktemp("resumed")
    status, resumes = {}, {}
    for name, (settings, round_) in CRASHES.items():
        out = root / f"{name}.h5"
        crash_at_round(root, 2, round_, [*settings, "--out", str(out)])
        status[name] = snapshot(out)["status"]
        resumes[name] = [*settings, "--out", str(out), "--resume"]
    assert fedring_many(2, resumes, root)[0] == dict.fromkeys(resumes, 0)
    return root, status


@pytest.mark.parametrize("crash_round", [1, 6])
def test_resume_after_crash_is_bit_exact(resumed, reference, crash_round):
    root, status = resumed
    assert status[f"round-{crash_round}"] == "failed"
    assert snapshot(root / f"round-{crash_round}.h5") == reference


@pytest.mark.parametrize("rule", list(RULES))
def test_resume_keeps_the_aggregator_state(resumed, references, rule):
    """Stateful server rules (previous aggregate, FL-Detector's history), BRACE's per-round relay
    draws and rows, and 3DFed's feedback state resume exactly."""
    root, status = resumed
    assert status[rule] == "failed"
    assert snapshot(root / f"{rule}.h5") == snapshot(references / f"{rule}.h5")


def test_resume_on_other_rank_count_is_bit_exact(tmp_path, reference):
    out = tmp_path / "run.h5"
    crash_at_round(tmp_path, 2, 4, [*RUN, "--out", str(out)])
    fedring(4, *RUN, "--out", str(out), "--resume")
    assert snapshot(out) == reference


def wait_for_round(proc, rnd, timeout=60):
    """Read the progress lines until round ``rnd`` is reported."""
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.startswith("round") and int(line.split()[1].split("/")[0]) >= rnd:
            return
        assert time.time() < deadline, "the run did not reach the round in time"
    raise AssertionError(f"the run ended before round {rnd}")


def test_signal_checkpoints_and_exits_75_then_resumes(tmp_path, reference):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run.h5"
    # progress lines on (round 2 is the first into a pipe); the ranks pause before round 5 (0-based 4),
    # so the signal sent once round 2 is reported lands mid-run
    proc = paused_at_round(
        tmp_path, 2, 4, 30, [*RUN[:-1], "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    wait_for_round(proc, 2)
    proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to the ranks
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    stopped = snapshot(out)
    assert stopped["status"] == "preempted" and 2 <= stopped["rounds"] < 7  # signalled after round 2
    with h5py.File(out) as f:
        assert read_checkpoint(f)[1]["round"] == stopped["rounds"]
    fedring(2, *RUN, "--out", str(out), "--resume")
    assert snapshot(out) == reference


def test_kill_9_then_resume_from_last_checkpoint(tmp_path, reference):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "run.h5"
    proc = paused_at_round(
        tmp_path,
        2,
        4,
        30,
        [*RUN[:-1], "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_round(proc, 2)  # the first progress line (into a pipe: the first, every tenth and the last)
    # SIGKILL to the launcher and every rank (the ranks carry the output path on their command line)
    subprocess.run(["pkill", "-KILL", "-f", str(out)], check=False)
    proc.wait(timeout=30)
    wait_for_unlock(out)
    assert snapshot(out)["status"] == "running"  # killed: nobody could mark it
    fedring(2, *RUN, "--out", str(out), "--resume")
    assert snapshot(out) == reference


def test_resume_refuses_other_settings(tmp_path, references, fedring_cli):
    out = tmp_path / "run.h5"
    shutil.copy(references / "ref.h5", out)
    with h5py.File(out, "r+") as f:
        f.attrs["status"] = "failed"  # as a crash leaves it
    proc = fedring_cli(*RUN, "--lr", "0.5", "--out", out, "--resume")
    assert proc.returncode == 2
    assert "resume:" in proc.stderr and "lr: 0.1 -> 0.5" in proc.stderr


def test_resume_from_the_file_alone(tmp_path, reference, fedring_cli):
    """The file holds every setting: --out and --resume are enough (on another rank count too);
    the banner says where it resumes; a setting given must agree with the stored one."""
    out, again = tmp_path / "run.h5", tmp_path / "again.h5"
    crash_at_round(tmp_path, 1, 5, [*RUN, "--out", str(out)])
    shutil.copy(out, again)
    with h5py.File(out, "r") as f:
        done = read_checkpoint(f)[1]["round"]
    proc = fedring_cli("run", "--out", out, "--resume", "--rounds", "8")
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"fedring: error: resume: {out} was written with other settings (file -> given): rounds: 7 -> 8; leave them out"
    )
    runs = {
        "quiet": ["run", "--out", out, "--resume", "--quiet", "--checkpoint-every", "1"],  # run control may change
        "banner": ["run", "--out", again, "--resume", "--rounds", "7"],
    }
    assert fedring_many(2, runs, tmp_path)[0] == dict.fromkeys(runs, 0)
    printed = many_printed(tmp_path)
    assert printed["quiet"] == many_printed(tmp_path, 1)["quiet"] == "" and snapshot(out) == reference
    assert f"fedring: resuming {again} from round {done} of 7\n" in printed["banner"] and snapshot(again) == reference
