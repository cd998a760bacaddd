"""Sweep grids: expansion, stable names, config files, results-file states, job plans, local runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import pytest
from conftest import MPIEXEC, ROOT, mpi_env

from fedring.cli.sweep import _run_task, main, plan, task_args
from fedring.config import Config, merge
from fedring.errors import ConfigError
from fedring.sweep import (
    canonical,
    config_hash,
    config_toml,
    differences,
    expand,
    file_state,
    load_sweep,
    resolve,
)


def test_expand_is_the_cartesian_product_in_file_order():
    assert expand({"a": [1, 2], "b": "x", "c": [True, False]}) == [
        {"a": 1, "b": "x", "c": True},
        {"a": 1, "b": "x", "c": False},
        {"a": 2, "b": "x", "c": True},
        {"a": 2, "b": "x", "c": False},
    ]


def test_groups_pair_settings_and_override_plain_ones():
    grid = {
        "lr": 0.1,
        "attack": ["none", "gaussian"],
        "pairs": [
            {"topology": "ring", "aggregator": ["mean", "brace"], "lr": 0.001},
            {"topology": "server", "aggregator": "krum"},
        ],
    }
    got = [(c["attack"], c["topology"], c["aggregator"], c["lr"]) for c in expand(grid)]
    assert got == [
        ("none", "ring", "mean", 0.001),
        ("none", "ring", "brace", 0.001),
        ("none", "server", "krum", 0.1),
        ("gaussian", "ring", "mean", 0.001),
        ("gaussian", "ring", "brace", 0.001),
        ("gaussian", "server", "krum", 0.1),
    ]


def test_two_group_axes_multiply():
    grid = {"g": [{"a": 1}, {"a": 2}], "h": [{"b": 1}, {"b": 2}, {"b": 3}]}
    assert [(c["a"], c["b"]) for c in expand(grid)] == [(a, b) for a in (1, 2) for b in (1, 2, 3)]


def test_sections_and_list_valued_settings():
    grid = {"krum": {"variant": ["paper", "byzfl"], "m": 3}, "pre_aggregators": ["nnm", "bucketing"]}
    assert expand(grid) == [
        {"krum.variant": "paper", "krum.m": 3, "pre_aggregators": ["nnm", "bucketing"]},
        {"krum.variant": "byzfl", "krum.m": 3, "pre_aggregators": ["nnm", "bucketing"]},
    ]
    # a list of lists is an axis of a list setting; a wrapped list is one literal value
    assert expand({"pre_aggregators": [[], ["nnm"]]}) == [{"pre_aggregators": []}, {"pre_aggregators": ["nnm"]}]
    assert expand({"brace": {"w": [[1, 2]]}}) == [{"brace.w": [1, 2]}]


def test_expand_errors_name_the_setting():
    with pytest.raises(ConfigError, match=r"^seed: an empty list"):
        expand({"seed": []})
    with pytest.raises(ConfigError, match=r'^attack: is a setting, not a section.*"attack\.name" = value'):
        expand({"attack": {"sigma": 200}})


def test_hash_is_the_documented_sha256_of_non_default_settings():
    cfg = resolve({"dataset": "synthetic", "rounds": 5}, ranks=2, origin="test")
    assert canonical(cfg) == {"clients": 2, "dataset": "synthetic", "rounds": 5}
    expected = hashlib.sha256(b'{"clients":2,"dataset":"synthetic","rounds":5}').hexdigest()[:12]
    assert config_hash(cfg) == expected


def test_hash_ignores_key_order_spelled_defaults_and_run_control():
    multikrum = {"topology": "server", "aggregator": "multikrum"}
    a = resolve(
        {"dataset": "synthetic", "rounds": 5, "multikrum.variant": "paper", "multikrum.m": 2, **multikrum}, 4, "t"
    )
    b = resolve(
        {
            "multikrum.m": 2,
            "multikrum.variant": "paper",
            "rounds": 5,
            "dataset": "synthetic",
            **multikrum,
            "seed": 0,
            "byzantine_select": "random",
            "out": "x.h5",
            "checkpoint_every": 3,
            "quiet": True,
        },
        4,
        "t",
    )
    assert config_hash(a) == config_hash(b)
    c = resolve(
        {"dataset": "synthetic", "rounds": 5, "multikrum.variant": "paper", "multikrum.m": 3, **multikrum}, 4, "t"
    )
    assert config_hash(c) != config_hash(a)
    # clients defaults to the rank count: same ranks same name, explicit clients likewise (a rule's
    # settings are checked as validation builds it: multikrum takes m, krum does not)
    assert config_hash(
        resolve(
            {
                "clients": 4,
                "dataset": "synthetic",
                "rounds": 5,
                "multikrum.variant": "paper",
                "multikrum.m": 2,
                **multikrum,
            },
            1,
            "t",
        )
    ) == config_hash(a)


def test_config_file_round_trips_to_the_same_config():
    cfg = resolve(
        {
            "dataset": "synthetic",
            "lr": 1e-5,
            "byzantine": 0.2,
            "attack": "gaussian",
            "attack.sigma": 200.0,
            "topology": "server",
            "aggregator": "hplus",
            "hplus.base": "krum",
            "pre_aggregators": ["nnm"],
            "data_dir": 'say "hi" \u00e9\n',  # quotes, a non-ASCII letter and a newline in a string
            "krum.variant": "byzfl",  # H+'s base rule reads its own section
            "lr_schedule": "step",
            "step.milestones": [0.25, 0.5],
        },
        4,
        "t",
    )
    text = config_toml(cfg)
    assert f"# fedring config {config_hash(cfg)}\n" in text
    assert '"attack.sigma" = 200.0' in text  # a setting-named section cannot be a table
    back = merge(Config(), tomllib.loads(text), "file")
    assert canonical(back) == canonical(cfg)
    assert config_hash(back) == config_hash(cfg)


def test_load_sweep_overrides_validation_and_dedup(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text('dataset = "synthetic"\nseed = [0, 1]\n[[d]]\nlr = 0.5\n[[d]]\nlr = 0.1\n[sweep]\nranks = 2\n')
    sw = load_sweep(grid)
    assert [(c.seed, c.lr) for c in sw.configs] == [(0, 0.5), (0, 0.1), (1, 0.5), (1, 0.1)]
    assert sw.out_dir.as_posix() == "results/g"
    assert sw.varying() == ["lr", "seed"]
    # --set replaces a setting everywhere, groups included; lr=0.1 twice is one config
    sw = load_sweep(grid, ["lr=0.1", "rounds=[3, 4]"], {"ranks": 1, "out_dir": "o"})
    assert [(c.seed, c.lr, c.rounds, c.clients) for c in sw.configs] == [
        (0, 0.1, 3, 1),
        (0, 0.1, 4, 1),
        (1, 0.1, 3, 1),
        (1, 0.1, 4, 1),
    ]
    assert sw.settings.out_dir == "o" and len(set(sw.hashes)) == 4
    with pytest.raises(ConfigError, match=r"^clients: 1 clients on 2 MPI ranks.*\(in the config .*seed=0"):
        load_sweep(grid, ["clients=1"])
    with pytest.raises(ConfigError, match=r"^sweep\.ranks: must be >= 1"):
        load_sweep(grid, [], {"ranks": 0})
    grid.write_text("seed = 1\n[sweep]\nnodes = 2\n")
    with pytest.raises(ConfigError, match=r"^sweep\.nodes: unknown; allowed: out_dir, ranks"):
        load_sweep(grid)


#: every run control a sweep passes on, none at its default
CONTROL = {
    "log": ["tensorboard", "mlflow"],
    "tensorboard_dir": "tb",
    "mlflow_uri": "file:///tmp/m",
    "checkpoint_every": 2,
    "stop_grace": 5.0,
    "quiet": True,
}


def test_a_grids_run_control_reaches_every_run_through_its_config_file(tmp_path):
    """log (the trackers and their places), checkpoint_every, stop_grace, quiet: written into every
    config file, which a job runs with --config, and in no config's name."""
    plain = 'dataset = "synthetic"\nrounds = 3\nseed = [0, 1]\n'
    grid = tmp_path / "g.toml"
    grid.write_text(plain + "".join(f"{k} = {json.dumps(v)}\n" for k, v in CONTROL.items()))
    sw = load_sweep(grid)
    (tmp_path / "p.toml").write_text(plain)
    assert len(sw.configs) == 2 and sw.hashes == load_sweep(tmp_path / "p.toml").hashes
    for cfg, h in zip(sw.configs, sw.hashes):
        text = config_toml(cfg)
        assert tomllib.loads(text) == {**canonical(cfg), **CONTROL}
        (tmp_path / f"{h}.toml").write_text(text)
        args = plan(["--config", str(tmp_path / f"{h}.toml"), "--out", str(tmp_path / f"{h}.h5")], 1, restart=False)
        run = _run_task(args, 1).cfg
        assert {k: getattr(run, k) for k in CONTROL} == CONTROL and run.seed == cfg.seed


def test_run_control_is_one_for_the_whole_grid_and_the_results_file_is_the_sweeps(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text('dataset = "synthetic"\n[[d]]\nlog = ["tensorboard"]\n[[d]]\nlog = ["mlflow"]\n')
    with pytest.raises(ConfigError, match=r"^log: is run control, .* \['tensorboard'\] and \['mlflow'\] \(run two"):
        load_sweep(grid)
    grid.write_text('dataset = "synthetic"\ncheckpoint_every = [5, 10]\n')
    with pytest.raises(ConfigError, match=r"^checkpoint_every: is run control, .*: 5 and 10"):
        load_sweep(grid)
    grid.write_text('dataset = "synthetic"\nout = "r.h5"\n')
    with pytest.raises(ConfigError, match=r"^out: a sweep sets it for each run .*: leave it out of g.toml") as e:
        load_sweep(grid)
    assert "\n" not in str(e.value)
    grid.write_text('dataset = "synthetic"\n')
    with pytest.raises(ConfigError, match=r"^resume: a sweep sets it for each run"):
        load_sweep(grid, ["resume=true"])


def write_result(path, cfg: Config, status: str, checkpoint: bool = False, rounds: int = 3):
    with h5py.File(path, "w") as f:
        f.attrs["config"] = cfg.to_json()
        f.attrs["status"] = status
        f.attrs["rounds_completed"] = rounds
        if checkpoint:
            root = f.create_group("checkpoint")
            root.attrs["current"] = "a"
            root.create_group("a").attrs["round"] = rounds


def test_file_states(tmp_path):
    cfg = resolve({"dataset": "synthetic"}, 1, "t")
    assert file_state(tmp_path / "none.h5").kind == "missing"
    write_result(tmp_path / "a.h5", cfg, "complete")
    st = file_state(tmp_path / "a.h5")
    assert (st.kind, st.checkpoint, st.rounds_completed, st.config["dataset"]) == ("complete", False, 3, "synthetic")
    write_result(tmp_path / "b.h5", cfg, "preempted", checkpoint=True, rounds=7)
    st = file_state(tmp_path / "b.h5")
    assert (st.kind, st.checkpoint, st.rounds_completed) == ("preempted", True, 7)
    (tmp_path / "c.h5").write_bytes(b"not hdf5")
    assert file_state(tmp_path / "c.h5").kind == "unreadable"
    # a file another process is writing holds HDF5's lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r+'); print('open', flush=True); time.sleep(30)",
            str(tmp_path / "a.h5"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert file_state(tmp_path / "a.h5").kind == "live"
    finally:
        holder.kill()
        holder.wait()
    assert file_state(tmp_path / "a.h5").kind == "complete"


def test_differences_treat_missing_keys_as_defaults():
    cfg = resolve({"dataset": "synthetic", "rounds": 5}, 1, "t")
    stored = json.loads(cfg.to_json())
    assert differences(stored, cfg) == []
    del stored["server_samples"]  # a file from before that setting existed
    stored["out"] = "elsewhere.h5"  # run control never differs
    assert differences(stored, cfg) == []
    stored["rounds"] = 300
    stored["sections"] = {"krum": {"m": 1}}
    assert differences(stored, cfg) == ["rounds: 300 -> 5", "sections: {'krum': {'m': 1}} -> {}"]


def test_plan_by_file_state(tmp_path):
    out = tmp_path / "r.h5"
    base = ["--dataset", "synthetic", "--rounds", "3", "--out", str(out)]
    cfg = resolve({"dataset": "synthetic", "rounds": 3}, 1, "t")
    assert plan(base, 1, restart=False) == base
    assert plan([*base, "--resume"], 1, restart=False) == base
    write_result(out, cfg, "preempted", checkpoint=True)
    assert plan(base, 1, restart=False) == [*base, "--resume"]
    assert plan([*base, "--overwrite"], 1, restart=False) == [*base, "--overwrite"]  # asked for a fresh start
    assert plan([*base, "--overwrite"], 1, restart=True) == [*base, "--resume"]  # a requeued job never restarts
    write_result(out, cfg, "running", checkpoint=False)  # killed before its first checkpoint
    assert plan(base, 1, restart=True) == [*base, "--overwrite"]
    write_result(out, cfg, "complete")
    assert plan(base, 1, restart=False) is None
    assert plan([*base, "--overwrite"], 1, restart=True) is None
    with pytest.raises(ConfigError, match=r"^out: .* was written with other settings: rounds: 3 -> 4"):
        plan([*base[:3], "4", *base[4:]], 1, restart=False)
    out.write_bytes(b"junk")
    with pytest.raises(ConfigError, match="not a readable results file"):
        plan(base, 1, restart=False)


#: ``python no_torch.py ARGS``: ``python -m fedring ARGS``, then fails if torch was imported
NO_TORCH = """
import sys
from fedring.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "torch was imported"
sys.exit(code)
"""


def test_planning_and_listing_import_no_torch(tmp_path):
    """A job's planning step (every array task starts one) and a sweep's listing check settings without
    importing torch, which takes most of a second: they start in a fraction of it."""
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH)
    grid = tmp_path / "g.toml"
    grid.write_text('dataset = "synthetic"\nrounds = 3\nmomentum = [0.0, 0.9]\n[sweep]\nout_dir = "out"\n')
    for args in (
        ["sweep", "--plan", "--dataset", "synthetic", "--set", "clip_norm=1", "--out", "r.h5"],
        ["sweep", str(grid), "--dry-run"],
    ):
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=mpi_env(),
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr


def test_task_args(tmp_path):
    (tmp_path / "tasks-x.txt").write_text("aaa\nbbb\n")
    assert task_args(tmp_path / "tasks-x.txt", 1) == [
        "--config",
        str(tmp_path / "configs" / "bbb.toml"),
        "--out",
        str(tmp_path / "bbb.h5"),
    ]
    with pytest.raises(ConfigError, match=r"index 2 outside 0\.\.1"):
        task_args(tmp_path / "tasks-x.txt", 2)


@pytest.mark.mpi
@pytest.mark.parametrize("expect, ok", [("2", True), ("3", False)])
def test_check_world_size_under_mpiexec(expect, ok):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    env = {**mpi_env(), "FEDRING_EXPECT_RANKS": expect}
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "fedring", "sweep", "--check-world-size"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (proc.returncode == 0) == ok
    assert proc.stderr.count("MPI world size is 2 but SLURM_NTASKS=3") == (0 if ok else 2)


def test_dry_run_lists_states_and_the_sbatch_command(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    out = tmp_path / "out"
    grid.write_text(
        f'dataset = "synthetic"\nrounds = 3\nseed = [0, 1]\n[sweep]\nranks = 2\nout_dir = "{out}"\n'
        'max_parallel = 4\ntime = "00:10:00"\nsbatch = ["--partition=debug"]\n'
    )
    sw = load_sweep(grid)
    out.mkdir()
    write_result(out / f"{sw.hashes[0]}.h5", sw.configs[0], "complete")
    assert main([str(grid), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"{grid}: 2 configs, 2 ranks each, results in {out}/ (1 complete, 1 missing)" in text
    assert f"0  {sw.hashes[0]}  complete  0" in text
    assert f"1  {sw.hashes[1]}  missing   1" in text
    assert "would submit 1 array tasks" in text
    assert (
        f"sbatch --parsable --array=0-0%4 --ntasks=2 --job-name=fedring-g --output={out}/logs/%A_%a.out "
        f"--time=00:10:00 --partition=debug {ROOT}/jobs/sweep.sbatch {out}/tasks-"
    ) in text
    assert not (out / "configs").exists()  # a dry run writes nothing
    # results of other settings under a config's name are refused
    other = resolve({"dataset": "synthetic", "rounds": 4}, 2, "t")
    write_result(out / f"{sw.hashes[1]}.h5", other, "complete")
    assert main([str(grid)]) == 2
    captured = capsys.readouterr()
    assert f"{sw.hashes[1]}  conflict  1     rounds: 4 -> 3" in captured.out
    assert "error: out_dir: results of other settings" in captured.err


def sweep_locally(grid: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m fedring sweep GRID --local`` in ``cwd``, which must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedring", "sweep", str(grid), "--local"],
        capture_output=True,
        text=True,
        timeout=180,
        env=mpi_env(),
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_local_sweep_runs_each_config_once_max_parallel_at_once_with_a_log_each(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    out = tmp_path / "out"
    grid.write_text(
        f'dataset = "synthetic"\nmodel = "mlp"\nclients = 2\nrounds = 2\neval_every = 1\nseed = [0, 1, 2]\nlr_schedule = "cosine"\n'
        f'[sweep]\nout_dir = "{out}"\nmax_parallel = 2\n'
    )
    proc = sweep_locally(grid, tmp_path)
    sw = load_sweep(grid)
    for cfg, h in zip(sw.configs, sw.hashes):
        assert file_state(out / f"{h}.h5").kind == "complete"
        assert f"config {h}: exit 0" in proc.stdout
        assert "results:" in (out / "logs" / f"local-{h}.out").read_text()
        written = tomllib.loads((out / "configs" / f"{h}.toml").read_text())
        assert (
            written
            == canonical(cfg)
            == {
                "clients": 2,
                "dataset": "synthetic",
                "model": "mlp",
                "rounds": 2,
                "eval_every": 1,
                "lr_schedule": "cosine",
                **({"seed": cfg.seed} if cfg.seed else {}),
            }
        )
    capsys.readouterr()
    assert main([str(grid), "--local"]) == 0 and "nothing to run" in capsys.readouterr().out  # in this process


@pytest.mark.slow
def test_a_local_sweep_logs_every_run_to_tensorboard(tmp_path):
    """A grid's ``log`` reaches its runs: each run's event folder is ``<tensorboard_dir>/<hash>``, with
    the round of every entry of its results file, read back with TensorBoard's own reader."""
    pytest.importorskip("tensorboard")
    from test_tracking import tensorboard_scalars

    grid, out, board = tmp_path / "g.toml", tmp_path / "out", tmp_path / "tb"
    grid.write_text(
        f'dataset = "synthetic"\nmodel = "mlp"\nclients = 2\nrounds = 2\neval_every = 1\nseed = [0, 1]\n'
        f'log = ["tensorboard"]\ntensorboard_dir = "{board}"\n[sweep]\nout_dir = "{out}"\n'
    )
    sweep_locally(grid, tmp_path)
    hashes = load_sweep(grid).hashes
    assert sorted(p.name for p in board.iterdir()) == sorted(hashes)
    for h in hashes:
        with h5py.File(out / f"{h}.h5", "r") as f:
            assert f.attrs["tensorboard_dir"] == str(board / h) and f.attrs["status"] == "complete"
        steps = {tuple(steps) for steps, _ in tensorboard_scalars(str(board / h)).values()}
        assert steps == {(1, 2)}


@pytest.mark.slow
def test_output_piped_into_head_ends_quietly(tmp_path):
    """``sweep --dry-run | head -1`` on 6,300 configs (more than a pipe holds): no
    BrokenPipeError traceback, exit 0."""
    seeds = "seed=[" + ",".join(map(str, range(100))) + "]"
    cmd = f"set -o pipefail; {sys.executable} -m fedring sweep table2.toml --dry-run --set '{seeds}' | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert "table2.toml: 6300 configs" in proc.stdout
