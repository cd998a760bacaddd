"""``python -m fedring``: see :mod:`fedring.cli`."""

import sys

from .cli import main

try:
    code = main()
except BrokenPipeError:  # output piped into head & co.
    sys.stderr.close()
    code = 0
sys.exit(code)
