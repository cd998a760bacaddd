"""The reference pages stay true: docs/cli.md's generated tables and example settings files."""

import subprocess
import sys

from conftest import ROOT, mpi_env


def test_cli_reference_tables_and_examples_match_the_code():
    proc = subprocess.run([sys.executable, "docs/cli_keys.py", "--check"], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
