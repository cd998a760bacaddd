"""BRACE, signSGD and RLR on device rows (docs/arrays.md, "Rows and the ring on the device"): torch CPU
tensor rows against the same rows as numpy arrays, on 1, 2 and 3 ranks.

Sign voting is integer arithmetic (votes in the count type, sums of at most ``n`` of them, integer
thresholds, bit packing), and the decoded update takes its values in {-1, 0, +1}: every comparison
here is exact (bytes, not a tolerance)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import run_mpi
from mpi4py import MPI
from test_brace import CONFIGS, expected, sign_matrix

from fedring.comm import Layout, Network, block_bounds
from fedring.comm import brace as brace_module
from fedring.comm._brace_torch import packbits, unpackbits
from fedring.comm.brace import Packing, SignVote, quantize

#: relay attacks and the check, with each sign_zero and both Share-Only encodings
ATTACKS = [
    ("brace", {"relay_attack": "bias", "relay_bias": 3, "sign_zero": 1, "check": "on", "relay_clients": [1, 4]}),
    ("brace", {"relay_attack": "bias", "relay_bias": 2, "check": "on", "relay_clients": [0, 1, 6]}),
    ("brace", {"relay_attack": "bias", "relay_bias": -200, "relay_clients": [3]}),  # saturates, unchecked
    ("brace", {"relay_attack": "flip", "relay_flip_prob": 0.5, "check": "on", "relay_clients": [0, 2, 3]}),
    ("brace", {"relay_attack": "flip", "rule": "symmetric", "lambda": 1, "relay_clients": [5]}),
    ("signsgd", {"relay_attack": "flip", "relay_flip_prob": 0.3, "relay_clients": [1, 7]}),
    ("rlr", {"relay_attack": "bias", "check": "on", "sign_zero": -1, "relay_clients": [2]}),
    ("rlr", {"check": True}),
]


def ledger(net: Network) -> dict:
    return {p: net.ledger.phase_bytes(p).tolist() for p in sorted(net.ledger.clients)}


def rounds(rule: str, n: int, params: dict, G: np.ndarray, lay: Layout, t: int = 2) -> list:
    """Round ``t`` of ``rule`` on this rank's rows of ``G`` as numpy rows and as tensor rows: per kind, the
    update, its bytes, the figures, the per-client rows, the ledger and the centralized rule's bytes."""
    out = []
    for kind in (np.asarray, torch.from_numpy):
        vote, net = SignVote(rule, n, params), Network(lay)
        res = vote.aggregate(net, kind(G[lay.lo : lay.hi].copy()), t)
        central = vote.centralized(kind(G.copy()))
        out.append(
            (
                type(res.update),
                np.asarray(res.update).tobytes(),
                res.figures,
                {k: v.tolist() for k, v in res.rows.items()},
                ledger(net),
                type(central),
                np.asarray(central).tobytes(),
            )
        )
    return out


def with_nonfinite(G: np.ndarray) -> np.ndarray:
    """``G`` with a NaN and both infinities (votes of ``sign_zero``) where it has room for them."""
    G = G.copy()
    n, d = G.shape
    for value, (i, j) in zip((np.nan, np.inf, -np.inf), ((0, 0), (n - 1, d - 1), (1 % n, d // 2))):
        G[i, j] = value
    return G


# ---------------------------------------------------------------- the torch helpers


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 13, 64, 1001])
def test_packbits_is_numpys_on_odd_sizes(size):
    """MSB first, each row padded to a byte, as ``np.packbits(axis=-1)``; and back."""
    rng = np.random.default_rng(size)
    for shape in ((size,), (3, size), (2, 2, size)):
        bits = rng.random(shape) < 0.5
        packed = packbits(torch.from_numpy(bits))
        assert packed.dtype == torch.uint8
        assert packed.numpy().tobytes() == np.packbits(bits, axis=-1).tobytes()
        raw = rng.integers(0, 256, (*shape[:-1], -(-size // 8)), dtype=np.uint8)
        for count in sorted({0, size, 8 * raw.shape[-1]}):
            got = unpackbits(torch.from_numpy(raw), count)
            assert got.dtype == torch.bool
            assert np.array_equal(got.numpy(), np.unpackbits(raw, axis=-1, count=count).view(bool))
        assert np.array_equal(unpackbits(packed, size).numpy(), bits)


@pytest.mark.parametrize("dtype", [np.int8, np.int16])
@pytest.mark.parametrize("sign_zero", [0, 1, -1])
def test_quantize_on_the_host_is_the_formula(monkeypatch, dtype, sign_zero):
    """Numpy's votes (int8: computed in the votes' own bytes) are sign(x), sign_zero at 0, -0.0 and every
    non-finite value, across passes (a small BLOCK, so the last pass is partial) and into ``out``."""
    monkeypatch.setattr(brace_module, "BLOCK", 8)
    x = np.array([2.5, 0.0, -0.0, -1e-30, 1e-45, np.nan, np.inf, -np.inf, -3.0, 7.0, -np.nan, 0.5, -2.0], np.float32)
    want = np.where(np.isfinite(x) & (x != 0), np.sign(np.nan_to_num(x)), sign_zero).astype(dtype)
    assert quantize(x, sign_zero, dtype).tobytes() == want.tobytes()
    out = np.full(x.size, 99, dtype)
    assert np.shares_memory(quantize(x, sign_zero, dtype, out=out), out)
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
@pytest.mark.parametrize("sign_zero", [0, 1, -1])
def test_quantize_on_tensors(monkeypatch, dtype, sign_zero):
    """The votes of a tensor are numpy's, in the count type, non-finite values voting ``sign_zero``;
    across passes (a small DEVICE_BLOCK) and into an ``out`` buffer."""
    monkeypatch.setattr(brace_module, "DEVICE_BLOCK", 7)
    G = with_nonfinite(sign_matrix(3, 20, 0))
    G[2, 3] = -0.0
    want = quantize(G, sign_zero, dtype)
    got = quantize(torch.from_numpy(G), sign_zero, dtype)
    assert got.dtype == getattr(torch, np.dtype(dtype).name)
    assert got.numpy().tobytes() == want.tobytes()
    out = torch.empty(G.shape, dtype=got.dtype)
    assert quantize(torch.from_numpy(G), sign_zero, dtype, out=out) is out
    assert out.numpy().tobytes() == want.tobytes()


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("n,d", [(1, 5), (3, 1), (4, 10), (5, 23), (7, 1000), (8, 64)])
def test_packing_encode_and_decode_on_tensors(n, d, planes):
    """Chunks of odd sizes (array_split's two sizes, empty chunks when d < n): the same bytes, and a
    packed row decodes to the same float32 bits (zeros +0.0) on either kind."""
    rng = np.random.default_rng([n, d])
    bounds = block_bounds(d, n)
    packing = Packing(bounds, planes)
    values = rng.integers(-1 if planes == 2 else 0, 2, d)
    values[values == 0] = -1 if planes == 1 else 0
    row = []
    for c in range(n):
        chunk = values[bounds[c] : bounds[c + 1]]
        positive, nonzero = chunk > 0, (chunk != 0 if planes == 2 else None)
        host = packing.encode(positive, nonzero)
        tensor = packing.encode(torch.from_numpy(positive), None if nonzero is None else torch.from_numpy(nonzero))
        assert tensor.numpy().tobytes() == host.tobytes()
        row.append(host)
    row = np.concatenate(row)
    assert len(row) == packing.byte_bounds[-1]
    want = packing.decode(row)
    assert np.array_equal(want, values.astype(np.float32))
    got = packing.decode(torch.from_numpy(row))
    assert isinstance(got, torch.Tensor) and got.numpy().tobytes() == want.tobytes()
    for c in range(n):
        seg = row[packing.byte_bounds[c] : packing.byte_bounds[c + 1]]
        assert np.array_equal(packing.nonzero(torch.from_numpy(seg), c).numpy(), packing.nonzero(seg, c))


# ---------------------------------------------------------------- whole rounds, one rank


def test_sign_rules_run_on_device():
    assert all(SignVote(rule, 4).on_device for rule in ("brace", "signsgd", "rlr"))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("rule,params", CONFIGS)
def test_one_rank_tensor_rows_give_the_numpy_round(n, rule, params):
    """Every consensus map on every chunk layout (d < n, d not a multiple of n or 8), with non-finite
    entries: the update (a tensor, for tensor rows), figures, rows, ledger and centralized rule."""
    lay = Layout(n, MPI.COMM_SELF)
    for d in (2, 3 * n + 5, 301):
        G = with_nonfinite(sign_matrix(n, d, [n, d]))
        host, device = rounds(rule, n, params, G, lay)
        assert host[0] is np.ndarray and host[5] is np.ndarray
        assert device[0] is torch.Tensor and device[5] is torch.Tensor
        assert host[1:5] == device[1:5] and host[6] == device[6], (n, d)
        honest = np.nan_to_num(G, nan=0.0, posinf=0.0, neginf=0.0)  # non-finite entries vote sign_zero
        assert np.array_equal(np.frombuffer(device[1], np.float32), expected(rule, params, honest))


@pytest.mark.parametrize("rule,params", ATTACKS)
def test_one_rank_relay_attacks_and_check_on_tensor_rows(rule, params):
    """The bias (checked, unchecked and saturating) and flip attacks: the same tampering, detections,
    flips (the same numpy draws), observed replica and bytes on tensor rows."""
    n, lay = 8, Layout(8, MPI.COMM_SELF)
    for d, t in ((301, 0), (1000, 5), (6, 1)):
        host, device = rounds(rule, n, params, sign_matrix(n, d, [d, t]), lay, t)
        assert host[1:5] == device[1:5] and host[6] == device[6], (d, t)
    if "relay_attack" in params:  # the relays did tamper
        assert host[2]["relay_tampered_hops"] > 0


def host_reads(monkeypatch, rule: str, n: int, params: dict) -> int:
    """How often one round on tensor rows reads a tensor's value on the host (each one would wait for
    a GPU): ``bool``, ``int``, ``float``, ``item`` and the numpy conversion of a tensor."""
    reads = [0]
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "__array__"):
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):
            reads[0] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    G = torch.from_numpy(sign_matrix(n, 40 * n + 3, n))
    SignVote(rule, n, params).aggregate(Network(Layout(n, MPI.COMM_SELF)), G, 3)
    monkeypatch.undo()
    return reads[0]


@pytest.mark.parametrize("rule,params", [a for a in ATTACKS if "relay_attack" in a[1] or a[1].get("check")])
def test_the_check_and_the_relays_read_the_device_a_fixed_number_of_times(monkeypatch, rule, params):
    """The integrity check and the relay attacks read their tallies once a round, not once a hop: as
    many host reads with 8 clients as with 16 (twice the hops)."""
    assert host_reads(monkeypatch, rule, 8, params) == host_reads(monkeypatch, rule, 16, params)


def test_int16_counts_on_tensor_rows():
    """Past 127 clients the counts are int16 on the device too."""
    n = 130
    host, device = rounds("brace", n, {"lambda": 3, "check": "on"}, sign_matrix(n, 157, 3), Layout(n, MPI.COMM_SELF))
    assert host[1:5] == device[1:5] and host[6] == device[6]
    assert SignVote("brace", n).dtype == np.int16


def test_a_second_round_reuses_the_device_buffers_and_numpy_rows_afterwards():
    """The rule's work buffers follow the kind of its rows from round to round."""
    n, G = 4, sign_matrix(4, 50, 9)
    vote, lay = SignVote("rlr", n, {"theta": 2}), Layout(n, MPI.COMM_SELF)
    want = vote.aggregate(Network(lay), G.copy()).update.copy()
    for kind in (torch.from_numpy, torch.from_numpy, np.asarray):
        got = vote.aggregate(Network(lay), kind(G.copy())).update
        assert np.asarray(got).tobytes() == want.tobytes()


def test_numpy_rows_import_no_torch():
    """A round on numpy rows, the flip attack and the check included, leaves torch unimported."""
    code = (
        "import sys, numpy as np\n"
        "from mpi4py import MPI\n"
        "from fedring.comm import Layout, Network\n"
        "from fedring.comm.brace import SignVote\n"
        "G = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)\n"
        "for p in ({}, {'rule': 'symmetric', 'check': 'on', 'relay_attack': 'flip', 'relay_clients': [1]}):\n"
        "    SignVote('brace', 4, p).aggregate(Network(Layout(4, MPI.COMM_SELF)), G.copy())\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------- several MPI ranks

MPI_SCRIPT = """
import sys, numpy as np
from mpi4py import MPI
sys.path.insert(0, "tests")
from fedring.comm import Layout
from test_brace import CONFIGS, expected_bytes, sign_matrix
from test_brace_on_device import ATTACKS, rounds, with_nonfinite
comm = MPI.COMM_WORLD
checked = 0
for n in [3, 5, 8]:
    if n < comm.size:
        continue
    lay = Layout(n)
    for d in (2, 301):
        G = with_nonfinite(sign_matrix(n, d, [n, d]))
        for rule, params in CONFIGS + (ATTACKS if n == 8 else []):
            host, device = rounds(rule, n, params, G, lay, t=4)
            assert host[1:5] == device[1:5] and host[6] == device[6], (n, d, rule, params)
            assert all(o == host[1] for o in comm.allgather(device[1])), "ranks disagree"
            alone = rounds(rule, n, params, G, Layout(n, MPI.COMM_SELF), t=4)[1]
            assert alone[1:4] == device[1:4], (n, d, rule, params)  # the update, figures, rows of one rank
            sent = np.sum(comm.allgather(np.sum(list(device[4].values()), axis=0)), axis=0)
            bits = 2 if params.get("rule") == "symmetric" or rule != "brace" else 1
            assert np.array_equal(sent, expected_bytes(n, d, bits, 1)), (n, d, rule)
            checked += 1
if comm.rank == 0:
    print("CHECKED", checked)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_over_mpi_ranks_tensor_rows_give_the_numpy_round(tmp_path, ranks):
    """On 2 and 3 ranks (chunks crossing ranks through host buffers, the flip observer's row broadcast):
    the numpy round's update, figures, rows and ledger, and the one-rank round's update."""
    script = tmp_path / "brace_on_device.py"
    script.write_text(MPI_SCRIPT)
    out = run_mpi(ranks, [str(script)], timeout=240).stdout
    assert int(out.split("CHECKED")[1].split()[0]) > 0
