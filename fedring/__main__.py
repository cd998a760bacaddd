"""``python -m fedring``: see :mod:`fedring.cli`."""

import sys

from .cli import main

sys.exit(main())
