"""Rows on the device (docs/arrays.md, "Rows and the ring on the device"): the communication layer
on torch tensor rows against numpy rows (the same bits, the same ledger, on 1 to 3 ranks), and
training on the device path (``Trainer(host_path=False)``, torch CPU tensors) against itself on 1,
2 and 4 ranks and against the host path."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import file_datasets, path_runs, run_mpi

COMM_SCRIPT = """
import numpy as np
import torch
from mpi4py import MPI
from fedring.comm import Layout, Network, all_gather, block_bounds, reduce_scatter, ring_allreduce
from fedring.comm.ring import RingAllReduce

world = MPI.COMM_WORLD

def ledger(net):
    clients = {p: net.ledger.phase_bytes(p).tolist() for p in sorted(net.ledger.clients)}
    return clients, dict(net.ledger.server)

def same(a, b):  # a numpy array and a tensor of the same bits
    assert isinstance(b, torch.Tensor) and b.dtype == torch.from_numpy(a).dtype, type(b)
    assert a.shape == tuple(b.shape) and a.tobytes() == b.numpy().tobytes()

def offset(rows):  # a contiguous tensor that does not start its storage: strided views must add the offset
    buffer = torch.zeros((len(rows) + 1, *rows.shape[1:]), dtype=torch.from_numpy(rows).dtype)
    buffer[1:] = torch.from_numpy(rows)
    return buffer[1:]

def idle(k, c):  # an ahead with no work: ring_step takes its hop-by-hop loop
    return ()

checked = 0
for n in [1, 2, 3, 5, 8]:
    if n < world.size:
        continue
    lay = Layout(n)
    for d in sorted({1, n, 3 * n + 2, 1000}):
        rng = np.random.default_rng([n, d])
        floats = rng.standard_normal((n, d)).astype(np.float32)
        counts = rng.integers(-128, 128, (n, d), dtype=np.int8)  # sums wrap alike
        for X in (floats, counts):
            for segment, ahead in ((0, None), (64, None), (0, idle)):
                nets = Network(lay, segment=segment), Network(lay, segment=segment)
                host, dev = X[lay.lo : lay.hi].copy(), offset(X[lay.lo : lay.hi])
                bounds = block_bounds(d, n)
                for net, rows in zip(nets, (host, dev)):
                    reduce_scatter(net, rows, bounds, ahead=ahead)
                    all_gather(net, rows, bounds, ahead=ahead)
                same(host, dev)
                assert ledger(nets[0]) == ledger(nets[1])
                checked += 1
        host, dev = floats[lay.lo : lay.hi].copy(), offset(floats[lay.lo : lay.hi])
        nets = Network(lay), Network(lay)
        same(ring_allreduce(nets[0], host.copy()), ring_allreduce(nets[1], dev.clone()))
        same(RingAllReduce(n).aggregate(nets[0], host).update, RingAllReduce(n).aggregate(nets[1], dev).update)
        assert ledger(nets[0]) == ledger(nets[1])

        # the server's messages: every client, a subset, block by block, down to all, down to some
        nets = Network(lay), Network(lay)
        subset = np.flatnonzero(rng.random(n) < 0.5)
        mine = subset[(subset >= lay.lo) & (subset < lay.hi)]
        for clients, local in ((None, floats[lay.lo : lay.hi]), (subset, floats[mine])):
            up = [net.gather_to_server(rows, "up", clients) for net, rows in zip(nets, (local, offset(local)))]
            if lay.rank == 0:
                same(*up)
            else:
                assert up == [None, None]
            if lay.size == 1 and clients is None:  # one rank: the server's own rows, not a copy
                rows = torch.from_numpy(local.copy())
                assert nets[1].gather_to_server(rows, "up") is rows
                nets[0].gather_to_server(local, "up")
        blocks = [list(net.gather_blocks(rows, "blocks")) for net, rows in zip(nets, (host, dev))]
        assert [first for first, _ in blocks[0]] == [first for first, _ in blocks[1]]
        for (_, a), (_, b) in zip(*blocks):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        ref = torch.zeros(1)
        vec = floats[0] if lay.rank == 0 else None
        down = nets[0].broadcast_from_server(vec, "down", (d,), np.float32)
        same(down, nets[1].broadcast_from_server(None if vec is None else torch.from_numpy(vec), "down", (d,), np.float32, ref=ref))
        some = floats[subset] if lay.rank == 0 else None
        back = nets[0].scatter_from_server(some, subset, "some", (d,), np.float32)
        dev_some = None if some is None else torch.from_numpy(some)
        same(back, nets[1].scatter_from_server(dev_some, subset, "some", (d,), np.float32, ref=ref))
        assert ledger(nets[0]) == ledger(nets[1])
        checked += 1

# a strided tensor is refused on every rank, as a strided numpy array is
try:
    Network(Layout(world.size)).check_rows(torch.zeros(1, 6)[:, ::2])
except ValueError as e:
    assert "C-contiguous" in str(e), e
else:
    raise AssertionError("a non-contiguous tensor passed check_rows")
if world.rank == 0:
    print("CHECKED", checked)
"""


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi), pytest.param(3, marks=pytest.mark.mpi)])
def test_comm_on_tensor_rows_is_the_numpy_bits_and_ledger(tmp_path, ranks):
    """The ring (hops at once, segmented, hop by hop), the ring mean, and the server's gather, blocks,
    broadcast and scatter on torch CPU tensors (views that do not start their storage) give the numpy
    rows' bits and byte counts, on float32 and wrapping int8 rows: every element gets the same
    operation on the same operands, in the ring's order, on either kind."""
    script = tmp_path / "comm.py"
    script.write_text(COMM_SCRIPT)
    out = run_mpi(ranks, [str(script)]).stdout
    assert int(out.split("CHECKED")[1].split()[0]) > 0


CONFIGS = {
    "ring-mean": ["--clients", "8", "--set", "momentum=0.9"],
    "ring-mean-cohort": ["--clients", "8", "--set", "participation=3"],  # ranks without a member: bystanders
    # chunks of 3: on one rank two full groups (gradients in the rows, batches gathered at once) and a
    # padded one; on 2 and 4 ranks groups split across ranks; every client clips and keeps momentum
    "ring-mean-batched": [
        *("--clients", "8", "--set", "batched_clients=3", "--set", "momentum=0.9", "--set", "clip_norm=0.5"),
    ],
    "ring-mean-alie": ["--clients", "8", "--byzantine", "2", "--attack", "alie"],
    "ring-brace": [
        "--clients",
        "8",
        "--aggregator",
        "brace",
        "--lr",
        "0.01",
        "--byzantine",
        "2",
        "--attack",
        "signflip",
    ],
    "server-median": ["--clients", "8", "--topology", "server", "--aggregator", "median"],
    "server-median-alie": [
        *("--clients", "8", "--topology", "server", "--aggregator", "median", "--byzantine", "2", "--attack", "alie"),
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return path_runs(
        tmp_path_factory.mktemp("rows_on_device"),
        CONFIGS,
        ["--dataset", "synthetic", "--model", "mlp", "--rounds", "4", "--eval-every", "2", "--quiet"],
        [("device", 1), ("device", 2), ("device", 4), ("host", 1)],
    )


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_path_gives_the_same_file_on_1_2_and_4_ranks(runs, name):
    """The device path's results (every dataset: model, metrics, ledger, per-round rows) are the same
    bytes on any number of ranks: a ring chunk is summed in ring order whether its hops are on one
    rank's device or cross ranks through host buffers, and the server stacks the rows in client order."""
    one = file_datasets(runs / f"{name}-device1.h5")
    assert "model/final" in one
    for ranks in (2, 4):
        other = file_datasets(runs / f"{name}-device{ranks}.h5")
        assert one.keys() == other.keys()
        for key in one:
            assert one[key].tobytes() == other[key].tobytes(), (ranks, key)


#: configs whose device path is the host path's bits: the clients' updates are the same torch ops,
#: the ring's sums the same float32 additions in the same order, its mean an IEEE division, BRACE's
#: votes integer arithmetic on either kind of rows, and the median on tensors picks (and for an even
#: count averages in float32) the same values
EXACT = ("ring-mean", "ring-mean-cohort", "ring-brace", "server-median")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_device_path_is_the_host_paths_bits(runs, name):
    device, host = file_datasets(runs / f"{name}-device1.h5"), file_datasets(runs / f"{name}-host1.h5")
    assert device.keys() == host.keys()
    for key in host:
        assert host[key].tobytes() == device[key].tobytes(), key


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring-mean-alie", "server-median-alie", "ring-mean-batched"])
def test_device_path_under_alie_within_the_reductions_rounding(runs, name):
    """ALIE crafts ``mean + z * std`` of the honest rows in float64 (fedring.attacks.alie), and
    clipping takes each row's norm in float64 (``ring-mean-batched``), on tensors
    with torch's reductions: torch may sum the rows in another order than numpy (its kernels split a
    reduction for vector lanes and threads), a difference of about 1e-16 relative that the cast to
    float32 rounds away or moves by one ulp (6e-8 relative) in a few coordinates; four rounds of SGD
    carry that to the weights. Bound: 1e-5 of the largest value of each float dataset, far below what
    a wrong row or a wrong round (O(lr x gradient) = O(1e-2) per step) would move. Everything else
    (bytes, cohorts, nonfinite flags) is the same bytes. Measured: equal bit for bit on these runs (6
    honest rows, which both sum in row order)."""
    device, host = file_datasets(runs / f"{name}-device1.h5"), file_datasets(runs / f"{name}-host1.h5")
    assert device.keys() == host.keys()
    for key in host:
        if host[key].dtype.kind == "f":
            bound = 1e-5 * max(1.0, float(np.abs(host[key]).max()))
            assert np.abs(host[key] - device[key]).max() <= bound, key
        else:
            assert host[key].tobytes() == device[key].tobytes(), key


def test_rows_of_a_dtype_numpy_lacks_are_refused_before_any_message():
    """A bfloat16 tensor has float16's size but not its format: the rows check names it instead of
    moving its bits as another type."""
    import torch
    from mpi4py import MPI

    from fedring.comm import Layout, Network

    net = Network(Layout(2, MPI.COMM_SELF))
    with pytest.raises(ValueError, match=r"rows must be numeric, got dtype torch\.bfloat16"):
        net.check_rows(torch.zeros((2, 4), dtype=torch.bfloat16))
    net.check_rows(torch.zeros((2, 4), dtype=torch.float16))
