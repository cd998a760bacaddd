"""``python -m fedring sweep GRID.toml [--dry-run | --submit | --local]`` and the job scripts' helpers.

The grid format and the files a sweep writes are described in :mod:`fedring.sweep`.
``jobs/run.sbatch`` and ``jobs/sweep.sbatch`` call ``python -m fedring sweep --plan``,
``--task`` and ``--check-world-size`` (below).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedring.config import split_key
from fedring.errors import ConfigError
from fedring.results import FileStatus
from fedring.sweep import (
    JOBS_DIR,
    Sweep,
    differences,
    file_state,
    load_sweep,
    sbatch_command,
    states,
    tasks_file,
    write_configs,
)
from fedring.tasks import Task

# ---------------------------------------------------------------------------------------------
# What a job does with its results file (called by jobs/run.sbatch)
# ---------------------------------------------------------------------------------------------


def _run_task(argv: list[str], world_size: int) -> Task:
    """The task that ``python -m fedring run ARGV`` resolves to (file checks left out)."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # parse only: no MPI in the batch shell
    from .run import build_task

    return build_task([*argv, "--overwrite"], world_size)


def plan(argv: list[str], world_size: int, restart: bool) -> list[str] | None:
    """Arguments to run ``python -m fedring run ARGV`` as a (possibly requeued) job; None = nothing to do.

    By the state of the ``--out`` file: missing -> as given; complete -> nothing (unless a
    first start asked ``--overwrite``); has a checkpoint -> ``--resume``; exists without one ->
    ``--overwrite`` (nothing to keep); being written by another process -> nothing. A requeued
    job (``restart``) never starts afresh. A stored config that differs from ARGV's is an error.
    """
    if any("\n" in a for a in argv):
        raise ConfigError("arguments", "a job argument contains a newline")
    args = [a for a in argv if a not in ("--overwrite", "--resume")]
    fresh = "--overwrite" in argv and not restart
    task = _run_task(args, world_size)
    cfg = task.cfg
    assert cfg.out is not None, "the task's checks name the results file"
    state = file_state(cfg.out)
    say = lambda msg: print(f"fedring job: {cfg.out}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if state.kind == "missing":
        return args
    if state.kind == "live":
        say(f"being written by another process ({state.detail}): nothing to do")
        return None
    if state.kind == "unreadable":
        raise ConfigError(
            "out", f"{cfg.out} is not a readable results file ({state.detail}); remove it or choose another --out"
        )
    if fresh:
        return [*args, "--overwrite"]
    diff = differences(state.config or {}, cfg)
    if diff:
        raise ConfigError(
            "out",
            f"{cfg.out} was written with other settings: {'; '.join(diff)}; "
            "pass --overwrite (first start) or choose another --out",
        )
    if state.kind == FileStatus.COMPLETE:
        say("complete: nothing to do")
        return None
    if state.checkpoint:
        say(f"{state.kind} after {state.rounds_completed} {task.steps()[1]}: resuming from its checkpoint")
        return [*args, "--resume"]
    say(f"{state.kind} without a checkpoint: starting afresh")
    return [*args, "--overwrite"]


def check_world_size() -> int:
    """Exit 1 (loudly, on every process) unless MPI's world size is the job's ``SLURM_NTASKS``.

    A launcher that does not speak the MPI library's process-management interface (plain
    ``srun`` without ``--mpi=pmi2``) starts SLURM_NTASKS independent 1-rank programs. The job
    script passes its SLURM_NTASKS as ``FEDRING_EXPECT_RANKS``: mpiexec's proxies run in a
    step of their own, where SLURM_NTASKS counts proxies, not ranks.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a stop request meant for the run that follows
    from mpi4py import MPI

    want = int(os.environ.get("FEDRING_EXPECT_RANKS") or os.environ.get("SLURM_NTASKS", "1"))
    size = MPI.COMM_WORLD.size
    if size == want:
        return 0
    print(
        f"fedring job: MPI world size is {size} but SLURM_NTASKS={want}: the launcher started separate "
        f"programs instead of one MPI job. Use srun --mpi=pmi2 (FEDRING_SRUN_MPI) or FEDRING_LAUNCHER=mpiexec.",
        file=sys.stderr,
        flush=True,
    )
    return 1


def task_args(tasks_file: str | Path, index: int) -> list[str]:
    """``--config C --out O`` of array task ``index`` of a tasks file."""
    tasks_file = Path(tasks_file).resolve()
    hashes = tasks_file.read_text().split()
    if not 0 <= index < len(hashes):
        raise ConfigError("task", f"index {index} outside 0..{len(hashes) - 1} of {tasks_file}")
    root, h = tasks_file.parent, hashes[index]
    return ["--config", str(root / "configs" / f"{h}.toml"), "--out", str(root / f"{h}.h5")]


def _table(sweep: Sweep, rows: list[tuple[str, str]]) -> str:
    cols = sweep.varying()
    header = ["#", "hash", "state", *cols, "note"]
    body = []
    for i, (cfg, h, (kind, note)) in enumerate(zip(sweep.configs, sweep.hashes, rows)):
        values = []
        for c in cols:
            sec, key = split_key(c)
            values.append(cfg.sections.get(sec, {}).get(key) if key else getattr(cfg, c))
        body.append([str(i), h, kind, *("" if v is None else str(v) for v in values), note])
    widths = [max(len(r[j]) for r in [header, *body]) for j in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *body])


def submit(sweep: Sweep, pending: list[int], jobs_dir: Path, dry_run: bool) -> int:
    tasks = tasks_file(sweep, pending)
    cmd = sbatch_command(sweep, tasks, len(pending), jobs_dir)
    env_note = f"FEDRING_LAUNCHER={sweep.settings.launcher} " if sweep.settings.launcher else ""
    if dry_run:
        print(f"would submit {len(pending)} array tasks (and write {sweep.out_dir}/configs/, {tasks.name}):")
        print(f"  {env_note}{shlex.join(cmd)}")
        return 0
    for script in ("sweep.sbatch", "run.sbatch"):
        if not (jobs_dir / script).is_file():
            raise ConfigError(
                "jobs-dir", f"{jobs_dir / script} not found (give --jobs-dir: the fedring checkout's jobs/)"
            )
    if shutil.which("sbatch") is None:
        raise ConfigError("submit", "sbatch not found: not on a SLURM cluster (use --local to run here)")
    write_configs(sweep)
    tasks_file(sweep, pending, write=True)
    (sweep.out_dir / "logs").mkdir(exist_ok=True)
    env = dict(os.environ)
    if sweep.settings.launcher:
        env["FEDRING_LAUNCHER"] = sweep.settings.launcher
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(
            f"fedring sweep: sbatch failed ({proc.returncode}): {proc.stderr.strip()}\n  {shlex.join(cmd)}",
            file=sys.stderr,
        )
        return 1
    job = proc.stdout.strip().split(";")[0]
    print(
        f"submitted array job {job}: {len(pending)} tasks; results in {sweep.out_dir}/, logs in {sweep.out_dir}/logs/"
    )
    return 0


def run_local(sweep: Sweep, pending: list[int]) -> int:
    """Run the pending configs here (``mpiexec -n ranks``), ``max_parallel`` at a time (default 1).

    With one at a time the runs print to this terminal; with more, each run's output goes to
    ``logs/local-<hash>.out`` and a line is printed as each starts and ends.
    """
    write_configs(sweep)
    launch = (
        [] if sweep.settings.ranks == 1 else [shutil.which("mpiexec") or "mpiexec", "-n", str(sweep.settings.ranks)]
    )
    parallel = sweep.settings.max_parallel or 1
    if parallel > 1:
        (sweep.out_dir / "logs").mkdir(exist_ok=True)
    running: list[tuple[str, subprocess.Popen, Any]] = []
    failed = []

    def wait_until(at_most: int) -> None:
        while len(running) > at_most:
            done = [item for item in running if item[1].poll() is not None]
            if not done:
                time.sleep(0.5)
            for h, proc, log in done:
                running.remove((h, proc, log))
                if log is not None:
                    log.close()
                    print(f"config {h}: exit {proc.returncode}", flush=True)
                if proc.returncode != 0:
                    failed.append(f"{h} (exit {proc.returncode})")

    for k, i in enumerate(pending):
        h = sweep.hashes[i]
        args = plan(
            ["--config", str(sweep.config_path(h)), "--out", str(sweep.results_path(h))],
            sweep.settings.ranks,
            restart=False,
        )
        if args is None:
            continue
        wait_until(parallel - 1)
        log = open(sweep.out_dir / "logs" / f"local-{h}.out", "a") if parallel > 1 else None  # noqa: SIM115 (wait_until closes it)
        print(f"[{k + 1}/{len(pending)}] config {h}" + (f" (log: {log.name})" if log else ""), flush=True)
        cmd = [*launch, sys.executable, "-m", "fedring", "run", *args]
        running.append((h, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None), log))
    wait_until(0)
    if failed:
        print(f"fedring sweep: {len(failed)} run(s) did not complete: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedring sweep",
        description="Expand a TOML grid of run settings; submit it as a SLURM array job, or run it here.",
        epilog="Grid format: see the docstring of fedring/sweep.py or the README.",
    )
    p.add_argument("grid", metavar="GRID.toml")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list the configs and the sbatch command (default)")
    mode.add_argument("--submit", action="store_true", help="submit the configs that are not complete")
    mode.add_argument("--local", action="store_true", help="run them one after another here (mpiexec -n ranks)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace a setting everywhere (a list is an axis)",
    )
    p.add_argument("--ranks", type=int, help="MPI ranks per run ([sweep] ranks)")
    p.add_argument("--out-dir", dest="out_dir", help="[sweep] out_dir")
    p.add_argument("--time", help="[sweep] time (sbatch --time)")
    p.add_argument("--launcher", help="[sweep] launcher: srun | mpiexec")
    p.add_argument("--max-parallel", dest="max_parallel", type=int, help="[sweep] max_parallel")
    p.add_argument("--jobs-dir", dest="jobs_dir", type=Path, default=JOBS_DIR, help=f"job scripts (default {JOBS_DIR})")
    return p


def _internal(argv: list[str]) -> int:
    """Helpers for the job scripts: ``--task FILE I``, ``--plan RUN-ARGS...``, ``--check-world-size``."""
    if argv[0] == "--check-world-size":
        return check_world_size()
    if argv[0] == "--task":
        print("\n".join(task_args(argv[1], int(argv[2]))))
        return 0
    args = plan(argv[1:], int(os.environ.get("SLURM_NTASKS", "1")), int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0)
    if args is not None:
        print("\n".join(args))
    return 0


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] in ("--task", "--plan", "--check-world-size"):
            return _internal(argv)
        args = parser().parse_args(argv)
        overrides = {k: getattr(args, k) for k in ("ranks", "out_dir", "time", "launcher", "max_parallel")}
        sweep = load_sweep(args.grid, args.set, overrides)
        rows = states(sweep)
        conflicts = [sweep.hashes[i] for i, (kind, _) in enumerate(rows) if kind in ("conflict", "unreadable")]
        pending = [
            i for i, (kind, _) in enumerate(rows) if kind not in (FileStatus.COMPLETE, "live", "conflict", "unreadable")
        ]
        counts = {k: sum(1 for kind, _ in rows if kind == k) for k in dict.fromkeys(kind for kind, _ in rows)}
        print(
            f"{sweep.grid}: {len(sweep.configs)} configs, {sweep.settings.ranks} ranks each, results in {sweep.out_dir}/ "
            f"({', '.join(f'{n} {k}' for k, n in counts.items())})"
        )
        print(_table(sweep, rows))
        if conflicts:
            raise ConfigError(
                "out_dir",
                f"results of other settings under the names of {', '.join(conflicts)} "
                "(see the notes): remove those files or choose another out_dir",
            )
        if not pending:
            print("nothing to run: every config is complete or being written")
            return 0
        if args.local:
            return run_local(sweep, pending)
        return submit(sweep, pending, args.jobs_dir.resolve(), dry_run=not args.submit)
    except ConfigError as e:
        print(f"fedring sweep: error: {e}", file=sys.stderr)
        return 2
