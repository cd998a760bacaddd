"""Network.gather_blocks: rank 0 receives every client's row, one rank's block at a time."""

import pytest
from conftest import run_mpi

SCRIPT = """
import numpy as np
from fedring.comm import Layout, Network

net = Network(Layout(7))  # 3 ranks: clients 0-2, 3-4, 5-6
lay = net.layout
rows = np.arange(lay.lo * 4, lay.hi * 4, dtype=np.float32).reshape(-1, 4)  # client c's row: 4c .. 4c + 3
got = [(first, block.copy()) for first, block in net.gather_blocks(rows, "adversary")]
if lay.rank == 0:
    assert [first for first, _ in got] == [0, 3, 5], got
    assert [len(block) for _, block in got] == [3, 2, 2], got
    whole = np.concatenate([block for _, block in got])
    assert np.array_equal(whole, np.arange(28, dtype=np.float32).reshape(7, 4)), whole
else:
    assert got == [], got
assert net.ledger.clients["adversary"][lay.lo : lay.hi].tolist() == [16] * (lay.hi - lay.lo)
print(f"rank {lay.rank}: ok", flush=True)
"""


@pytest.mark.mpi
def test_rank_0_gets_every_block_in_client_order(tmp_path):
    script = tmp_path / "blocks.py"
    script.write_text(SCRIPT)
    proc = run_mpi(3, [str(script)], timeout=60)
    for rank in range(3):
        assert f"rank {rank}: ok" in proc.stdout, proc.stdout + proc.stderr
