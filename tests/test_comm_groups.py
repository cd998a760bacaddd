"""``fedring.cli.main(argv, comm)``: runs side by side in one MPI job, each on a group of its ranks.

The test suite's warm pool runs every pooled job this way (conftest.POOL); here two runs share
one 3-rank job at the same time, and each ends bit-identical to the same run on its own."""

import h5py
import numpy as np
import pytest
from conftest import fedring_many, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

RUN = ["--dataset", "synthetic", "--model", "mlp", "--clients", "6", "--rounds", "4", "--eval-every", "2"]
#: one run per group: rank 0 alone runs ring-all-reduce, ranks 1 and 2 a server with Krum under attack
GROUPS = {
    "ring": [*RUN, "--seed", "1"],
    "server": [*RUN, "--seed", "2", "--topology", "server", "--aggregator", "krum", "--byzantine", "1"],
}

#: ``python side_by_side.py RING.h5 SERVER.h5``
SCRIPT = """
import signal, sys
from mpi4py import MPI
from fedring.cli import main
from test_comm_groups import GROUPS
world = MPI.COMM_WORLD
name = "ring" if world.rank == 0 else "server"
group = world.Split(world.rank > 0, world.rank)
code = main([*GROUPS[name], "--out", sys.argv[1 + (name == "server")]], comm=group)
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the run's stop handler outlived it"
world.Barrier()  # the groups' runs overlap: neither group leaves before both are done
sys.exit(code)
"""


def test_two_runs_side_by_side_equal_each_run_alone(tmp_path):
    script = tmp_path / "side_by_side.py"
    script.write_text(SCRIPT)
    proc = run_mpi(3, [str(script), str(tmp_path / "ring.h5"), str(tmp_path / "server.h5")])
    banners = [line for line in proc.stdout.splitlines() if line.startswith("fedring: train:")]
    assert len(banners) == 2, proc.stdout  # each group's first rank speaks for it, once
    assert any("6 clients on 1 rank" in b for b in banners) and any("6 clients on 2 ranks" in b for b in banners)

    alone = {name: [*argv, "--quiet", "--out", str(tmp_path / f"alone-{name}.h5")] for name, argv in GROUPS.items()}
    assert fedring_many(2, alone, tmp_path)[0] == {"ring": 0, "server": 0}
    for name in GROUPS:
        with h5py.File(tmp_path / f"{name}.h5", "r") as a, h5py.File(tmp_path / f"alone-{name}.h5", "r") as b:
            assert a.attrs["status"] == "complete" and a.attrs["world_size"] == 1 + (name == "server")
            assert np.array_equal(a["model/final"][:], b["model/final"][:])
            assert np.array_equal(a["metrics/test_accuracy"][:], b["metrics/test_accuracy"][:])
            assert np.array_equal(a["comm/bytes_sent"][:], b["comm/bytes_sent"][:])
