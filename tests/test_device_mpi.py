"""How device rows cross ranks (docs/arrays.md, "How device rows cross ranks"): through the reused host
buffers of an injected allocator, each segment sent as soon as it is copied, or straight from device
memory (``FEDRING_DEVICE_MPI=on``, torch CPU tensors through DLPack here), against numpy rows: the
same bits and ledger bytes on 2 and 3 ranks; the setting and its errors; the buffers' reuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_mpi
from mpi4py import MPI

from fedring.comm import Layout, Network
from fedring.comm.network import Transfers, device_mpi, pageable
from fedring.errors import ConfigError
from fedring.train.device import Staging, pinned

#: Run with FEDRING_DEVICE_MPI=on: every protocol on numpy rows, on tensor rows through host buffers
#: (an allocator that records its calls) and on tensor rows straight to MPI (the environment's
#: setting; an allocator that refuses, a synchronize that counts), compared by bytes and ledger.
SCRIPT = """
import sys

import numpy as np
import torch
from mpi4py import MPI
from fedring.comm import Layout, Network, all_gather, block_bounds, reduce_scatter, ring_allreduce
from fedring.comm.brace import SignVote
from fedring.comm.network import Transfers
from fedring.comm.ring import RingAllReduce

world = MPI.COMM_WORLD
allocated, synced = [], [0]

def recording(nbytes):
    allocated.append(nbytes)
    return np.empty(nbytes, np.uint8)

def refusing(nbytes):
    raise AssertionError("the direct path allocated a host buffer")

def sync():
    synced[0] += 1

def ledger(net):
    return {p: net.ledger.phase_bytes(p).tolist() for p in sorted(net.ledger.clients)}, dict(net.ledger.server)

def raw(x):  # the bytes and kind of a result
    return None if x is None else (type(x).__name__, np.asarray(x).dtype.str, tuple(x.shape), np.asarray(x).tobytes())

def offset(rows):  # a contiguous tensor that does not start its storage
    buffer = torch.zeros((len(rows) + 1, *rows.shape[1:]), dtype=torch.from_numpy(rows).dtype)
    buffer[1:] = torch.from_numpy(rows)
    return buffer[1:]

def idle(k, c):  # an ahead with no work: ring_step's hop-by-hop loop
    return ()

def protocols(lay, kind, transfers, X, n, d, seed):
    # every protocol on this rank's rows of X as ``kind``: (results, ledgers)
    rng = np.random.default_rng(seed)
    out, ledgers = [], []
    for segment, ahead in ((0, None), (64, None), (64, idle)):
        net = Network(lay, segment=segment, transfers=transfers)
        rows = kind(X[lay.lo : lay.hi])
        reduce_scatter(net, rows, block_bounds(d, n), ahead=ahead)
        all_gather(net, rows, block_bounds(d, n), ahead=ahead)
        out.append(raw(rows))
        ledgers.append(ledger(net))
    if X.dtype != np.float32:
        return out, ledgers
    net = Network(lay, segment=64, transfers=transfers)
    out.append(raw(ring_allreduce(net, kind(X[lay.lo : lay.hi]))))
    out.append(raw(RingAllReduce(n).aggregate(net, kind(X[lay.lo : lay.hi])).update))
    res = SignVote("brace", n, {"lambda": 1, "check": "on"}).aggregate(net, kind(X[lay.lo : lay.hi]), 2)
    out += [raw(res.update), res.figures, {k: v.tolist() for k, v in res.rows.items()}]
    subset = np.flatnonzero(rng.random(n) < 0.5)
    mine = subset[(subset >= lay.lo) & (subset < lay.hi)]
    out.append(raw(net.gather_to_server(kind(X[lay.lo : lay.hi]), "up")))
    out.append(raw(net.gather_to_server(kind(X[mine]), "some", subset)))
    out += [(first, np.asarray(b).tobytes()) for first, b in net.gather_blocks(kind(X[lay.lo : lay.hi]), "blocks")]
    vec = kind(X[0]) if lay.rank == 0 else None
    ref = None if kind is np.array else torch.zeros(1)
    out.append(raw(net.broadcast_from_server(vec, "down", (d,), np.float32, ref=ref)))
    ledgers.append(ledger(net))
    return out, ledgers

checked = 0
for n in [world.size, 5, 8]:
    lay = Layout(n)
    for d in sorted({1, 3 * n + 2, 1000}):
        rng = np.random.default_rng([n, d])
        for X in (rng.standard_normal((n, d)).astype(np.float32), rng.integers(-128, 128, (n, d), dtype=np.int8)):
            host = protocols(lay, np.array, None, X, n, d, [n, d])  # copies: the protocols work in place
            staged = protocols(lay, offset, Transfers(recording, direct=False), X, n, d, [n, d])
            direct_transfers = Transfers(refusing, sync)
            assert direct_transfers.direct  # FEDRING_DEVICE_MPI=on
            direct = protocols(lay, offset, direct_transfers, X, n, d, [n, d])
            assert host[1] == staged[1] == direct[1], (host[1], staged[1], direct[1])
            for h, s, t in zip(host[0], staged[0], direct[0]):
                if isinstance(h, tuple) and len(h) == 4:  # the numpy bytes, as a tensor on tensor rows
                    assert h[1:] == s[1:] == t[1:] and s[0] == t[0] == "Tensor", (h, s, t)
                else:
                    assert h == s == t, (h, s, t)
            checked += 1
assert allocated and synced[0] > 0, (allocated, synced)
# a file per rank: two ranks' lines on a shared stdout may interleave
with open(f"{sys.argv[1]}/rank{world.rank}.txt", "w") as report:
    print("RANK", world.rank, "CHECKED", checked, "ALLOCATED", len(allocated), "SYNCED", synced[0], file=report)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_device_rows_cross_ranks_with_the_numpy_bits_and_ledger(tmp_path, monkeypatch, ranks):
    """The ring's reduce-scatter and all-gather (whole and 64-byte segments, strided and hop-by-hop
    hops), the ring mean, BRACE with its check, the server's gather (all, a subset), blocks and
    broadcast, on float32 and wrapping int8 rows: tensor rows through the allocator's host buffers and
    tensor rows straight to MPI give the numpy rows' bytes and the same ledger; the direct path never
    allocates a host buffer and waits for the device before MPI touches its memory."""
    monkeypatch.setenv("FEDRING_DEVICE_MPI", "on")
    script = tmp_path / "device_mpi.py"
    script.write_text(SCRIPT)
    run_mpi(ranks, [str(script), str(tmp_path)])
    lines = sorted(p.read_text().split() for p in tmp_path.glob("rank*.txt"))
    assert [line[1] for line in lines] == [str(r) for r in range(ranks)]
    assert {line[3] for line in lines} == {"18"}  # 3 client counts x 3 row sizes x 2 dtypes
    assert all(int(line[5]) > 0 and int(line[7]) > 0 for line in lines)


@pytest.mark.parametrize("value", ["sometimes", "ON", "1"])
def test_a_bad_device_mpi_setting_is_refused_naming_the_variable(monkeypatch, fedring_cli, tmp_path, value):
    """``FEDRING_DEVICE_MPI`` takes auto, on or off: anything else is a ConfigError that names the
    variable and the values allowed, from the function, the network, and the command line (exit 2,
    before any file is written)."""
    message = f"FEDRING_DEVICE_MPI: must be one of auto, on, off, got {value!r}"
    with pytest.raises(ConfigError) as error:
        device_mpi(value)
    assert str(error.value) == message
    monkeypatch.setenv("FEDRING_DEVICE_MPI", value)
    with pytest.raises(ConfigError) as error:
        Network(Layout(2, MPI.COMM_SELF))
    assert str(error.value) == message
    out = tmp_path / "run.h5"
    got = fedring_cli("run", "--dataset", "synthetic", "--clients", "2", "--rounds", "1", "--out", out)
    assert got.returncode == 2
    assert got.stderr.strip() == f"fedring: error: {message}"
    assert not out.exists()


def test_device_mpi_values(monkeypatch):
    """on and off as said; auto (the default, and an empty variable) asks mpi4py, and is off where this
    mpi4py has no ``Query_cuda_support`` (this machine's MPICH build)."""
    assert device_mpi("on") is True and device_mpi("off") is False
    query = getattr(MPI, "Query_cuda_support", None)
    detected = bool(query is not None and query())
    assert device_mpi("auto") is detected
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("FEDRING_DEVICE_MPI", raising=False)
        else:
            monkeypatch.setenv("FEDRING_DEVICE_MPI", value)
        assert device_mpi() is detected
        assert Network(Layout(2, MPI.COMM_SELF)).transfers.direct is detected
    monkeypatch.setenv("FEDRING_DEVICE_MPI", "on")
    assert Transfers().direct is True and Transfers(direct=False).direct is False


def test_host_buffers_are_allocated_by_the_injected_allocator_and_reused():
    """The send and receive buffers come from ``host_buffer`` in bytes, grow only when a request is
    larger, and are views of the dtype asked for; the default allocator is numpy's."""
    calls = []

    def allocate(nbytes):
        calls.append(nbytes)
        return np.zeros(nbytes, np.uint8)

    t = Transfers(allocate, direct=False)
    a = t.send_buffer(np.dtype(np.float32), 10)
    assert (a.dtype, a.shape, calls) == (np.float32, (10,), [40])
    b = t.send_buffer(np.dtype(np.int8), 7)
    assert (b.dtype, b.shape, calls) == (np.int8, (7,), [40])
    assert np.shares_memory(a, b)
    c = t.recv_buffer(np.dtype(np.float64), 3)
    assert (c.dtype, c.shape, calls) == (np.float64, (3,), [40, 24])
    assert not np.shares_memory(a, c)
    t.send_buffer(np.dtype(np.float32), 11)
    assert calls == [40, 24, 44]
    assert Transfers(direct=False).host_buffer is pageable
    assert (pageable(5).dtype, pageable(5).shape) == (np.uint8, (5,))


def test_device_buffer_is_reused_per_dtype_and_size():
    """The direct path's receive buffer for chunks that are combined: one flat array of the rows'
    dtype on their device, replaced when the dtype changes or a larger chunk comes."""
    t = Transfers(direct=True)
    rows = torch.zeros((2, 8), dtype=torch.float32)
    a = t.device_buffer(rows, 5)
    assert (a.dtype, tuple(a.shape)) == (torch.float32, (5,))
    assert t.device_buffer(rows, 3).data_ptr() == a.data_ptr()
    b = t.device_buffer(rows.to(torch.int8), 3)
    assert (b.dtype, tuple(b.shape)) == (torch.int8, (3,))
    assert t.device_buffer(rows.to(torch.int8), 9).shape == (9,)


def test_staging_hands_the_cpu_numpys_buffers_and_no_synchronize():
    """On the CPU (either path) the network's host buffers stay numpy's, with nothing to wait for."""
    for host_path in (True, False):
        t = Staging(torch.device("cpu"), 4, host_path).transfers()
        assert t.host_buffer is pageable and t.synchronize is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned memory")
def test_pinned_buffers_and_synchronize_on_a_gpu():
    """On a GPU the buffers are page-locked, kept alive by their numpy views, and the direct path
    synchronizes the rank's device."""
    buf = pinned(100)
    assert (buf.dtype, buf.shape) == (np.uint8, (100,))
    assert isinstance(buf.base, torch.Tensor) and buf.base.is_pinned()
    t = Staging(torch.device("cuda", 0), 4).transfers()
    assert t.host_buffer is pinned
    t.ready()
