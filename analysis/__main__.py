"""``python -m analysis <command> ...``: see :mod:`analysis`."""

import importlib
import sys

COMMANDS = {
    "load": ("analysis.load", "main"),
    "table": ("analysis.tables", "main_table"),
    "conformal-table": ("analysis.tables", "main_conformal"),
    "plot-accuracy": ("analysis.plots", "main_accuracy"),
    "plot-bytes": ("analysis.plots", "main_bytes"),
    "plot-conformal": ("analysis.plots", "main_conformal"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        import analysis

        print(analysis.__doc__, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, fn = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), fn)(argv[1:])


sys.exit(main(sys.argv[1:]))
