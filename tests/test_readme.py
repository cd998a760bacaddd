"""The README's tour, run as written: its attack/defence commands print the figures it quotes.

The commands and their expected last lines are read from README.md itself (the lines
``$ mpiexec -n 2 python -m fedring run ...`` of the tour, each followed by the progress line it
ends with), so the README cannot drift from what the tool does. Training is deterministic (the
same seed gives bit-identical results on any number of ranks), so the accuracies must match to
the printed digit; the qualitative claim (undefended at chance, defended far above it) is
checked too.
"""

from __future__ import annotations

import re
import shlex
import sys

import pytest
from conftest import MPIEXEC, ROOT, mpi_env

TOUR = ROOT / "README.md"
PROGRESS = re.compile(r"round (\d+)/(\d+)\s+test_acc (\d\.\d{4})\s+bytes_sent_total ([\d,.]+ MB)")


def tour_commands() -> list[tuple[list[str], str, str]]:
    """(argv, expected test_acc, expected bytes_sent_total) of every tour command with its last line."""
    text = TOUR.read_text()
    tour = text[text.index("## A five-minute tour") : text.index("## Module map")]
    lines = tour.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("$ mpiexec -n 2 python -m fedring run "):
            quoted = []  # the command's output: up to the next command or the end of the block
            for after in lines[i + 1 :]:
                if after.startswith(("$ ", "```")):
                    break
                quoted += [m for m in [PROGRESS.match(after)] if m]
            out.append((shlex.split(line[2:]), quoted[-1].group(3), quoted[-1].group(4)))
    return out


def test_the_tour_quotes_its_commands():
    commands = tour_commands()
    assert len(commands) == 4  # one run, then the mean, BRACE and the median under the same attack
    attack = [argv for argv, _, _ in commands if "--attack" in argv]
    assert len(attack) == 3 and len({tuple(a[: a.index("--eval-every") + 2]) for a in attack}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("index", range(4))
def test_tour_command_prints_the_quoted_figures(tmp_path, index):
    import subprocess

    if MPIEXEC is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    argv, accuracy, sent = tour_commands()[index]
    assert argv[:3] == ["mpiexec", "-n", "2"] and argv[3] == "python"
    cmd = [MPIEXEC, *argv[1:3], sys.executable, *argv[4:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    last = [m for m in map(PROGRESS.match, proc.stdout.splitlines()) if m][-1]
    assert last.group(1) == last.group(2)  # the run's final round
    assert (last.group(3), last.group(4)) == (accuracy, sent)
    if "--attack" in argv:
        defended = "--aggregator" in argv  # the mean is the default rule
        assert (float(accuracy) > 0.8) if defended else (float(accuracy) < 0.15)
