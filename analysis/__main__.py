"""``python -m analysis <command> ...``: see :mod:`analysis`; ``--help`` lists the commands.

A command whose optional dependency (pandas, matplotlib) is missing prints one line naming
the extra to install and exits 2.
"""

import importlib
import sys

from analysis import COMMANDS, EXTRAS, INSTALL_EXTRA


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m analysis COMMAND FILES|DIRS... [options]   (python -m analysis COMMAND --help: options)",
        "",
        "Tables and plots from fedring's HDF5 results files; a directory stands for every *.h5 under it.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {line}" for name, (_, _, line) in COMMANDS.items()]
    return "\n".join(lines) + f"\n\nneeds pandas and matplotlib: {INSTALL_EXTRA}"


def _no_mpi_init() -> None:
    """The conformal reader lives in a module that imports mpi4py's MPI: never initialise MPI here."""
    if "mpi4py.MPI" in sys.modules:
        return
    try:
        import mpi4py
    except ImportError:
        return
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"], ["help"])
        if argv and not asked:
            print(f"python -m analysis: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    module, fn, _ = COMMANDS[argv[0]]
    _no_mpi_init()
    try:
        command = getattr(importlib.import_module(module), fn)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        print(f"python -m analysis {argv[0]} needs {missing}, which is not installed: {INSTALL_EXTRA}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
