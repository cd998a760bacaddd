"""The command line: ``python -m fedring [run|bench|conformal|sweep] ...`` (:func:`main`).

Works under ``mpiexec -n N`` and without it (one rank). Modules are imported only for the
command that needs them: ``sweep`` runs in the job script's shell, where MPI must not start.
"""

from __future__ import annotations

import importlib
import os
import sys

USAGE = """usage: python -m fedring                        the headline experiment (BRACE vs ring-all-reduce under attack)
       python -m fedring [run] [options]        federated training (python -m fedring run --help)
       python -m fedring bench comm|aggregators|prism [options]
       python -m fedring conformal prism|labelshift [options]
       python -m fedring sweep GRID.toml [--dry-run|--submit|--local] [options]"""

# subcommand -> (module, function), imported only when used
SUBCOMMANDS = {
    ("bench", "comm"): ("fedring.bench.comm", "main"),
    ("bench", "aggregators"): ("fedring.bench.aggregators", "main"),
    ("bench", "prism"): ("fedring.bench.prism", "main"),
    ("conformal", "prism"): ("fedring.conformal.prism.task", "main"),
    ("conformal", "labelshift"): ("fedring.conformal.labelshift.task", "main"),
}


def _launched_ranks() -> tuple[int, int]:
    """(rank, size) from the MPI launcher's environment, without starting MPI (MPICH, Open MPI, PMIx)."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if size_var in os.environ:
            return int(os.environ.get(rank_var, 0)), int(os.environ[size_var])
    return 0, 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] == ["sweep"]:
        rank, size = _launched_ranks()
        if size > 1 and argv[1:2] != ["--check-world-size"]:
            if rank == 0:
                print("fedring: error: sweep: runs in one process and starts the MPI jobs itself: "
                      "run it without mpiexec", file=sys.stderr)
            return 2
        from .sweep import main as sweep_main

        return sweep_main(argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] != "run":
        key = tuple(argv[:2])
        if key not in SUBCOMMANDS:
            if _launched_ranks()[0] == 0:
                print(f"fedring: error: unknown command {' '.join(argv[:2])!r}\n{USAGE}", file=sys.stderr)
            return 2
        module, fn = SUBCOMMANDS[key]
        return getattr(importlib.import_module(module), fn)(argv[2:])
    from .run import headline, run

    try:
        return run(argv[1:] if argv[:1] == ["run"] else argv) if argv else headline()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
