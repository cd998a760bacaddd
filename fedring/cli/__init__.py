"""The command line: ``python -m fedring [run|bench|conformal|sweep] ...`` (:func:`main`).

Works under ``mpiexec -n N`` and without it (one rank). Modules are imported only for the
command that needs them: ``sweep`` runs in the job script's shell, where MPI must not start.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from fedring.errors import ConfigError

from .launcher import launched_ranks

if TYPE_CHECKING:
    from mpi4py import MPI

USAGE = """usage: python -m fedring [--overwrite] [--quiet]  the headline job: ring-all-reduce and BRACE under attack (docs/brace.md)
       python -m fedring [run] [options]        one run of any task; training by default (python -m fedring run --help)
       python -m fedring conformal prism|labelshift [options]   federated conformal prediction (... --help)
       python -m fedring bench comm|aggregators|prism|network|train [options] benchmarks that print measured ratios (... --help)
       python -m fedring sweep GRID.toml [--dry-run|--submit|--local] [options]   grids of runs, on SLURM or here

docs/cli.md lists every command and setting."""

# subcommand -> (module, function, one line), imported only when used
SUBCOMMANDS = {
    ("bench", "comm"): ("fedring.bench.comm", "main", "ring-all-reduce and the sign rules vs MPI's Allreduce"),
    ("bench", "aggregators"): (
        "fedring.bench.aggregators",
        "main",
        "every server rule on a large vector, vs the FedSECA paper's timings",
    ),
    ("bench", "prism"): ("fedring.bench.prism", "main", "PRISM-FCP over MPI vs one process"),
    ("bench", "train"): ("fedring.bench.train", "main", "fedring's training round vs a bare PyTorch loop"),
    ("bench", "network"): (
        "fedring.bench.network",
        "main",
        "ring, BRACE and server in wall time on an emulated cluster (root)",
    ),
    ("conformal", "prism"): ("fedring.conformal.prism.task", "main", "PRISM-FCP, Rob-FCP and FCP (task prism)"),
    ("conformal", "labelshift"): (
        "fedring.conformal.labelshift.task",
        "main",
        "DP-FedCP under label shift (task labelshift)",
    ),
}


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> int:
    """``python -m fedring ARGV`` on every rank of ``comm`` (default ``MPI.COMM_WORLD``): its exit code.

    With ``comm`` a group of the job's ranks (``MPI.COMM_WORLD.Split``) runs fedring as a job of
    its own, so several runs can share one MPI job side by side (docs/cli.md, "From Python").
    """
    argv = sys.argv[1:] if argv is None else argv
    if comm is None:
        return _main(argv, *launched_ranks())
    from fedring.runtime import running_on

    with running_on(comm):
        return _main(argv, comm.rank, comm.size)


def _main(argv: list[str], rank: int, size: int) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        if rank == 0:
            print(USAGE)
        return 0
    if argv[:1] == ["sweep"]:
        if size > 1 and argv[1:2] != ["--check-world-size"]:
            if rank == 0:
                print(
                    "fedring: error: sweep: runs in one process and starts the MPI jobs itself: run it without mpiexec",
                    file=sys.stderr,
                )
            return 2
        from .sweep import main as sweep_main

        return sweep_main(argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] != "run":
        group = argv[0]
        choices = {k[1]: v for k, v in SUBCOMMANDS.items() if k[0] == group}
        if choices and (len(argv) < 2 or argv[1] in ("-h", "--help")):
            if rank == 0:
                out = sys.stdout if len(argv) > 1 else sys.stderr
                print(f"usage: python -m fedring {group} {'|'.join(choices)} [options]\n", file=out)
                print("\n".join(f"  {name:<12} {line}" for name, (_, _, line) in choices.items()), file=out)
            return 0 if len(argv) > 1 else 2
        if tuple(argv[:2]) not in SUBCOMMANDS:
            if rank == 0:
                print(f"fedring: error: unknown command {' '.join(argv[:2])!r}\n{USAGE}", file=sys.stderr)
            return 2
        module, fn, _ = SUBCOMMANDS[argv[0], argv[1]]
        try:
            return getattr(importlib.import_module(module), fn)(argv[2:])
        except ConfigError as e:  # a benchmark's bad option (the tasks agree on theirs themselves)
            if rank == 0:
                print(f"fedring: error: {e}", file=sys.stderr)
            return 2
    from .run import headline, run

    try:
        if set(argv) <= {"--overwrite", "--quiet"}:  # the headline job; --overwrite replaces its results
            return headline(overwrite="--overwrite" in argv, quiet="--quiet" in argv)
        return run(argv[1:] if argv[:1] == ["run"] else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
