"""The README's tour, run as written: its attack/defence commands print the figures it quotes.

The commands and their expected last lines are read from README.md itself (the lines
``$ mpiexec -n 2 python -m fedring run ...`` of the tour, each followed by the progress line it
ends with), so the README cannot drift from what the tool does. Training is deterministic (the
same seed gives bit-identical results on any number of ranks), so the accuracies must match to
the printed digit; the qualitative claim (undefended at chance, defended far above it) is
checked too. The commands run one after the other in one ``mpiexec -n 2`` job (torch and MPI
start once), each printing what it would alone.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch
from conftest import ROOT, fedring_many, many_printed

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


def figures_capability() -> str:
    """The PyTorch CPU kernels the tour's figures were printed with, as the README names them."""
    text = TOUR.read_text()
    match = re.search(r"PyTorch \S+ runs its (\S+)\s+kernels", text)
    assert match, "the README names the CPU kernels its figures come from"
    return match.group(1).replace("-", "")


def test_the_tour_quotes_its_commands():
    commands = tour_commands()
    assert len(commands) == 4  # one run, then the mean, BRACE and the median under the same attack
    attack = [argv for argv, _, _ in commands if "--attack" in argv]
    assert len(attack) == 3 and len({tuple(a[: a.index("--eval-every") + 2]) for a in attack}) == 1


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """What each tour command printed, by index: all four run one after the other in one
    ``mpiexec -n 2`` job (as the README has them: 2 ranks), from a scratch directory."""
    root = tmp_path_factory.mktemp("tour")
    runs = {}
    for index, (argv, _, _) in enumerate(tour_commands()):
        assert argv[:5] == ["mpiexec", "-n", "2", "python", "-m"] and argv[5] == "fedring"
        runs[str(index)] = argv[6:]
    codes, _ = fedring_many(2, runs, root, cwd=root)
    assert codes == dict.fromkeys(runs, 0)
    return many_printed(root)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("index", range(4))
def test_tour_command_prints_the_quoted_figures(printed, index):
    """The quoted byte counts everywhere (no arithmetic decides them); the quoted accuracies to the
    printed digit on the kind of CPU the README names, and elsewhere the claims they illustrate
    (the undefended mean at chance, the defences far above it): other kernels round otherwise."""
    argv, accuracy, sent = tour_commands()[index]
    last = [m for m in map(PROGRESS.match, printed[str(index)].splitlines()) if m][-1]
    assert last.group(1) == last.group(2)  # the run's final round
    assert last.group(4) == sent
    if torch.backends.cpu.get_cpu_capability() == figures_capability():
        assert last.group(3) == accuracy
    if "--attack" in argv:
        defended = "--aggregator" in argv  # the mean is the default rule
        for printed_accuracy in (accuracy, last.group(3)):
            assert (float(printed_accuracy) > 0.8) if defended else (float(printed_accuracy) < 0.15)
