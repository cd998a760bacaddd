"""Ring all-reduce: exact sums, exact byte counts, any client count and size, any rank count."""

import json

import numpy as np
import pytest
from conftest import fedring, run_mpi

from fedring.comm import Layout, Network, block_bounds
from fedring.comm.ring import ring_allreduce

SIZES = [0, 1, 2, 17, 17**2, 17**3]
CLIENTS = [1, 2, 3, 5, 8, 17]


def expected_bytes(n: int, d: int, itemsize: int) -> np.ndarray:
    """Client i never sends chunk i+1 in reduce-scatter nor chunk i+2 in all-gather (docs/brace.md)."""
    sizes = np.diff(block_bounds(d, n))
    i = np.arange(n)
    return itemsize * ((d - sizes[(i + 1) % n]) + (d - sizes[(i + 2) % n])) * (n > 1)


@pytest.mark.parametrize("n", CLIENTS)
@pytest.mark.parametrize("d", SIZES)
def test_ring_equals_direct_sum_on_integers(n, d):
    X = np.random.default_rng([n, d]).integers(-1000, 1000, (n, d))
    net = Network(Layout(n))
    rows = X.copy()
    ring_allreduce(net, rows)
    np.testing.assert_array_equal(rows, np.broadcast_to(X.sum(0), X.shape))
    np.testing.assert_array_equal(net.ledger.client_bytes(), expected_bytes(n, d, X.itemsize))


@pytest.mark.parametrize("n", [3, 8, 17, 100])
def test_ring_float_within_reordering_tolerance(n):
    d = 1000
    X = np.random.default_rng(n).standard_normal((n, d)).astype(np.float32)
    rows = X.copy()
    ring_allreduce(Network(Layout(n)), rows)
    exact = X.astype(np.float64).sum(0)
    # each of n-1 additions may round once: |error| <= (n-1) eps sum|x|
    bound = (n - 1) * np.finfo(np.float32).eps * np.abs(X).astype(np.float64).sum(0)
    assert np.all(np.abs(rows - exact) <= bound)
    assert np.all(rows == rows[0])


def test_bytes_when_n_divides_d():
    n, d = 8, 8 * 125
    rows = np.ones((n, d), np.float32)
    net = Network(Layout(n))
    ring_allreduce(net, rows)
    assert np.all(net.ledger.client_bytes() == 2 * (n - 1) * d * 4 // n)


def test_brace_paper_figure_1():
    rows = np.array([[5, 2, -10], [8, -4, 7], [9, 3, 8]])
    ring_allreduce(Network(Layout(3)), rows)
    assert rows.tolist() == [[22, 1, 5]] * 3
    attacked = np.array([[5, 2, -200], [8, -4, 7], [9, 3, 8]])
    ring_allreduce(Network(Layout(3)), attacked)
    assert attacked[0].tolist() == [22, 1, -185]


def test_block_bounds():
    assert block_bounds(10, 4).tolist() == [0, 3, 6, 8, 10]
    assert block_bounds(2, 3).tolist() == [0, 1, 2, 2]


RING_SCRIPT = """
import sys, numpy as np
from fedring.comm import Layout, Network, block_bounds
from fedring.comm.ring import ring_allreduce
n, d = int(sys.argv[1]), int(sys.argv[2])
lay = Layout(n); net = Network(lay)
X = np.random.default_rng([n, d]).integers(-1000, 1000, (n, d)).astype(np.int32)
rows = X[lay.lo:lay.hi].copy()
ring_allreduce(net, rows)
assert (rows == X.sum(0)).all()
F = np.random.default_rng([n, d, 1]).standard_normal((n, d)).astype(np.float32)
frows = F[lay.lo:lay.hi].copy()
ring_allreduce(Network(lay), frows)
ref = F.copy(); ring_allreduce(Network(Layout(n, comm=__import__('mpi4py').MPI.COMM_SELF)), ref)
assert (frows == ref[0]).all(), "float ring must be bit-identical to the one-rank ring"
total, _ = net.gather_ledger()
if lay.rank == 0:
    print("BYTES", " ".join(map(str, total)))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,n,d", [(2, 2, 17), (3, 5, 17**2), (4, 8, 3), (4, 17, 17**3), (2, 7, 0)])
def test_ring_over_mpi(tmp_path, ranks, n, d):
    script = tmp_path / "ring.py"
    script.write_text(RING_SCRIPT)
    out = run_mpi(ranks, [str(script), str(n), str(d)]).stdout
    counted = [int(v) for v in out.split("BYTES")[1].split()]
    assert counted == expected_bytes(n, d, 4).tolist()


HOPS_SCRIPT = """
import itertools

import numpy as np
import torch
from mpi4py import MPI
from fedring.comm import Layout, Network, all_gather, block_bounds, network, reduce_scatter

def idle(k, c):  # an ahead with no work: ring_step takes its hop-by-hop loop
    return ()

def ring(rows, n, bounds, hops_at_once):  # the owned chunks after reduce-scatter, and the bytes
    net = Network(Layout(n))
    ahead = None if hops_at_once else idle
    reduce_scatter(net, rows, bounds, ahead=ahead)
    owned = [np.asarray(rows[k, bounds[(i + 1) % n] : bounds[(i + 1) % n + 1]]).tobytes()
             for k, i in enumerate(net.layout.local_clients)]
    all_gather(net, rows, bounds, ahead=ahead)
    return owned, {p: net.ledger.phase_bytes(p) for p in ("reduce_scatter", "all_gather")}

checked = 0
for n, padded in itertools.product([1, 2, 3, 4, 5, 6, 7, 13, 100], [0, 1 << 40]):  # reduce_owned's two paths
    network.PADDED_BYTES = {"host": padded, "device": padded}
    if n < MPI.COMM_WORLD.size:
        continue
    lay = Layout(n)
    for d in sorted({1, 5, n - 1, n, 3 * n + 2, 1000}):
        rng = np.random.default_rng([n, d])
        irregular = np.concatenate([[0], np.sort(rng.integers(0, d + 1, n - 1)), [d]])
        floats = rng.standard_normal((n, d)).astype(np.float32)
        counts = rng.integers(-128, 128, (n, d), dtype=np.int8)  # sums wrap alike
        cases = [(floats, block_bounds(d, n)), (floats, irregular), (counts, block_bounds(d, n))]
        cases += [(torch.from_numpy(X), bounds) for X, bounds in cases]  # the device path's kernels, on the CPU
        for X, bounds in cases:
            fast, slow = (X[lay.lo : lay.hi].clone() if torch.is_tensor(X) else X[lay.lo : lay.hi].copy()
                          for _ in range(2))
            (fast_owned, fast_bytes), (slow_owned, slow_bytes) = (ring(fast, n, bounds, True),
                                                                  ring(slow, n, bounds, False))
            assert fast_owned == slow_owned, (n, d, X.dtype, bounds, padded)
            assert np.asarray(fast).tobytes() == np.asarray(slow).tobytes(), (n, d, X.dtype, bounds)
            for phase in fast_bytes:
                assert np.array_equal(fast_bytes[phase], slow_bytes[phase]), (n, d, phase)
            checked += 1
if MPI.COMM_WORLD.rank == 0:
    print("CHECKED", checked)
"""


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi), pytest.param(3, marks=pytest.mark.mpi)])
def test_hops_at_once_equal_the_hop_by_hop_loop(tmp_path, ranks):
    """A step's hops within a rank, applied at once (on one rank: every step of reduce-scatter at once,
    ``Network.reduce_owned``, and of all-gather, ``Network.spread_owned``), give the loop's owned
    chunks, rows and byte counts bit for bit, on numpy and on (CPU) tensors."""
    script = tmp_path / "hops.py"
    script.write_text(HOPS_SCRIPT)
    out = run_mpi(ranks, [str(script)]).stdout
    assert int(out.split("CHECKED")[1].split()[0]) > 0


@pytest.mark.mpi
def test_bench_comm_measures_every_ring_rule_with_exact_bytes(tmp_path):
    """``bench comm`` on 2 ranks: per rank, the float32 ring sends d/2 floats in each phase (4d
    bytes); BRACE d/2 int8 counts then d/2 one-bit signs; signSGD and RLR two bit planes."""
    out = tmp_path / "bench.json"
    fedring(2, "bench", "comm", "--min-exp", "10", "--max-exp", "10", "--repeats", "1", "--json", str(out))
    sent = {r["impl"]: r["bytes_per_rank"] for r in json.loads(out.read_text())}
    assert sent == {"native": 4096, "ring": 4096, "brace": 512 + 64, "signsgd": 512 + 128, "rlr": 512 + 128}
