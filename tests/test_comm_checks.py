"""Misused comm buffers raise on every rank before any message, instead of hanging a peer."""

import pytest
from conftest import run_mpi

SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
from fedring.comm import Layout, Network
from fedring.comm.ring import ring_allreduce

case, n = sys.argv[1], int(sys.argv[2])
net = Network(Layout(n))
rank, k = net.layout.rank, net.layout.n_local
rows = np.ones((k, 10), np.float32)
try:
    if case == "fortran":
        ring_allreduce(net, np.asfortranarray(rows))
    elif case == "extra_row":
        ring_allreduce(net, np.ones((k + (rank == 1), 10), np.float32))
    elif case == "dtype":
        ring_allreduce(net, rows.astype(np.float64) if rank == 1 else rows)
    elif case == "width":
        ring_allreduce(net, np.ones((k, 10 + rank), np.float32))
    elif case == "gather":
        net.gather_to_server(rows[: k - (rank == 1)], "up")
    elif case == "broadcast":
        net.broadcast_from_server(np.ones(7) if rank == 0 else None, "down", (10,), np.float64)
    elif case == "scatter":
        net.scatter_from_server(np.ones((1, 10)) if rank == 0 else None, np.array([0, 2]), "down", (10,), np.float64)
except ValueError as e:
    print(f"rank {rank}: ValueError: {e}", flush=True)
    sys.exit(3)
print(f"rank {rank}: no error", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize(
    "case,message",
    [
        ("fortran", "rank 0: rows must be C-contiguous"),  # rank 1's single row is contiguous either way
        ("extra_row", "rank 1: rows has 2 rows; it needs one row for each of the 1 clients this rank sends for"),
        ("dtype", "the dtype size of rows differs between ranks (4 and 8)"),
        ("width", "the row size of rows differs between ranks (10 and 11)"),
        ("gather", "rank 1: rows has 0 rows; it needs one row for each of the 1 clients"),
        ("broadcast", "rank 0: the server's vector has 7 values, the clients expect shape (10,)"),
        ("scatter", "rank 0: the server has rows of shape (1, 10) for 2 clients of shape (10,)"),
    ],
)
def test_misuse_raises_on_every_rank(tmp_path, case, message):
    script = tmp_path / "misuse.py"
    script.write_text(SCRIPT)
    proc = run_mpi(2, [str(script), case, "3"], check=False, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}: ValueError: {message}" in proc.stdout
