"""Host passes that replace a slower numpy form of the same figures (issue 32's CPU race).

Bucketing's bucket means, Meamed's run sums, the coordinate-wise rules' sorted rows from a sorting
network and the sums of sorted rows in numpy's pairwise order keep the bits of the forms they
replace, which each test states literally and compares byte for byte. MoNNA's distances now come from the
differences instead of the Gram pass: the same figures to float32 rounding, and so the same
nearest rows unless two distances tie to that rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedring.aggregators import _kernels as K
from fedring.aggregators import make_aggregator
from fedring.aggregators.meamed import _host_run_sums
from fedring.aggregators.preaggregators import Bucketing, _bucket_means, _mean_of_bucket_means


def scaled_rows(rng, n: int, d: int, dtype) -> np.ndarray:
    """Rows of mixed magnitudes, the first two columns -0 and a +0 among -0s (BLAS starts its sums
    at +0), and rows large enough that their sums overflow."""
    big = 1e37 if dtype == np.float32 else 1e300
    X = (rng.standard_normal((n, d)) * rng.choice([1e-3, 1.0, 1e3, big], size=(n, 1))).astype(dtype)
    X[:, : min(2, d)] = -0.0
    if d > 2:
        X[0, 2] = 0.0
    return X


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_bucket_means_have_the_products_bits(dtype, s):
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 5, 20, 33, 100):
        for d in (1, 7, 5000, 300_001):
            X = scaled_rows(rng, n, d, dtype)
            b = Bucketing(s=s)
            W, owner = b.buckets(n, np.random.default_rng(5))
            with np.errstate(over="ignore"):
                # buckets of up to two rows: the product's sums (any order gives them); three or
                # more: the blocked product's order (combine)
                want = W.astype(dtype) @ X if s <= 2 else K.combine(W, X)
                want /= W.sum(axis=1, keepdims=True).astype(dtype)
                Y, got_owner = b.transform(X, np.random.default_rng(5))
                if s <= 2:
                    assert _bucket_means(X, W).tobytes() == want.tobytes()
            assert Y.dtype == dtype and Y.tobytes() == want.tobytes(), (n, d)
            assert got_owner.tolist() == owner.tolist()


def test_bucket_means_start_from_plus_zero():
    X = np.array([[-0.0, -0.0, 1.0], [-0.0, 0.0, -1.0], [-0.0, 2.0, 4.0]], np.float32)
    Y = _bucket_means(X, np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert Y.tolist() == [[0.0, 0.0, 0.0], [0.0, 2.0, 4.0]]
    assert not np.signbit(Y).any()  # -0 + -0 is -0, but BLAS's 0 + -0 + -0 is +0


def sorted_block(rng, w: int, n: int, dtype, kind: str) -> np.ndarray:
    if kind == "int":  # many ties, including at the run's boundary
        T = rng.integers(-3, 4, (w, n)).astype(dtype)
    else:
        T = rng.standard_normal((w, n)).astype(dtype)
    if kind == "special":
        T[rng.random((w, n)) < 0.1] = np.nan
        T[rng.random((w, n)) < 0.05] = np.inf
        T[rng.random((w, n)) < 0.05] = -np.inf
        T[rng.random((w, n)) < 0.1] = -0.0
    T.sort(axis=1)
    return T


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "int", "special"])
def test_meamed_run_sums_have_the_masks_bits(dtype, kind):
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 7, 20, 21, 33, 100):
        for f in range((n + 1) // 2):
            k = n - f
            T = sorted_block(rng, 300, n, dtype, kind)
            lo, hi = (n - 1) // 2, n // 2
            with np.errstate(invalid="ignore"):
                med = T[:, lo] if lo == hi else (T[:, lo] + T[:, hi]) / 2
                # the form it replaces (and the device's): a (w, n) mask of the run, then the sum
                start = np.count_nonzero(T[:, k:] - med[:, None] < med[:, None] - T[:, :f], axis=1)
                positions = np.arange(n)
                run = (positions >= start[:, None]) & (positions < start[:, None] + k)
                want = np.where(run, T, 0).sum(axis=1)
                # the network's rows (contiguous) and a transposed block's (strided)
                got = _host_run_sums([r.copy() for r in T.T], f)
                got_t = _host_run_sums(T.T, f)
            # a NaN's sign is the operand order's (never seen by a rule: rows with NaN are left out)
            nan = np.isnan(want)
            for g in (got, got_t):
                assert g.dtype == dtype and (np.isnan(g) == nan).all(), (n, f)
                assert g[~nan].tobytes() == want[~nan].tobytes(), (n, f)


def test_meamed_run_sums_literal():
    # median 2; run of 4 from the left (0 and 4 equally close: the lower kept), sum 6
    # median 2.5 of (0, 2, 3, 9): |9 - 2.5| > |0 - 2.5|, so the run is (0, 2, 3), sum 5
    S = [np.array([0.0]), np.array([1.0]), np.array([2.0]), np.array([3.0]), np.array([4.0])]
    assert _host_run_sums(S, 1).tolist() == [6.0]
    S2 = np.array([[0.0, 2.0, 3.0, 9.0]]).T
    assert _host_run_sums(S2, 1).tolist() == [5.0]
    assert S2.T.tolist() == [[0.0, 2.0, 3.0, 9.0]]  # the rows are read, not written


def test_sorting_network_sorts_every_zero_one_column():
    # the 0-1 principle (Knuth, TAOCP 5.3.4): a network that sorts every 0-1 input sorts every input
    for n in range(1, 17):
        B = ((np.arange(1 << n)[None, :] >> np.arange(n)[:, None]) & 1).astype(np.int8)
        for a, b in K.sorting_network(n):
            B[a], B[b] = np.minimum(B[a], B[b]), np.maximum(B[a], B[b])
        assert (np.diff(B, axis=0) >= 0).all(), n
    rng = np.random.default_rng(0)
    for n in range(17, K.NETWORK_MAX + 1):
        B = (rng.random((n, 1 << 16)) < rng.random((1, 1 << 16))).astype(np.int8)
        for a, b in K.sorting_network(n):
            B[a], B[b] = np.minimum(B[a], B[b]), np.maximum(B[a], B[b])
        assert (np.diff(B, axis=0) >= 0).all(), n


def test_sorting_network_sizes_and_pruning():
    # Batcher's odd-even merge sort: 19, 63 and 191 comparators on 8, 16 and 32 wires (Knuth, 5.3.4)
    assert [len(K.sorting_network(n)) for n in (1, 2, 3, 4, 8, 16, 20, 32)] == [0, 1, 3, 5, 19, 63, 103, 191]
    assert K.sorting_network(4, keep=(3,)) == ((0, 1), (2, 3), (1, 3))
    assert len(K.sorting_network(20, keep=(9, 10))) == 84
    rng = np.random.default_rng(1)
    for n in (5, 12, 20, 24):
        for keep in [(n // 2,), tuple(range(2, n - 2)), (0, n - 1)]:
            V = rng.permuted(np.tile(np.arange(n), (500, 1)), axis=1).T.copy()
            for a, b in K.sorting_network(n, keep):
                V[a], V[b] = np.minimum(V[a], V[b]), np.maximum(V[a], V[b])
            assert all((V[k] == k).all() for k in keep), (n, keep)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sorted_rows_are_the_sorts(dtype):
    rng = np.random.default_rng(2)
    for n in (1, 2, 3, 7, 20, 24, 25, 40):
        for d in (1, 5, 3000):
            X = (rng.standard_normal((n, d)) * rng.choice([1e-3, 1.0, 1e3], size=(n, 1))).astype(dtype)
            X[:, : min(3, d)] = rng.integers(-1, 2, (n, min(3, d)))  # ties, one sign of zero
            want = np.sort(X, axis=0)
            for rows in (None, [n // 2], range(n // 4, n - n // 4)):
                got = np.full_like(X, np.nan)

                def fn(sl, S, got=got, rows=rows, n=n):
                    for k in range(n) if rows is None else rows:
                        got[k, sl] = S[k]

                K.for_sorted_rows(X, fn, rows)
                for k in range(n) if rows is None else rows:
                    assert got[k].tobytes() == want[k].tobytes(), (n, d, k)
    # blocks of a wide input, a strided input, and the rows read, never written
    X = rng.standard_normal((20, 2 * K.block_width(20, 4, K.NETWORK_BYTES) + 7)).astype(np.float32)
    before = X.copy()
    for Z in (X, X[:, ::3]):
        got = np.empty(Z.shape[1], np.float32)
        K.for_sorted_rows(Z, lambda sl, S, got=got: got.__setitem__(sl, S[0]), rows=[0])
        assert got.tobytes() == Z.min(axis=0).tobytes()
    assert X.tobytes() == before.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_pairwise_sums_have_numpys_bits(dtype):
    rng = np.random.default_rng(4)
    for m in [*range(1, 42), 64, 100]:
        T = (
            scaled_rows(rng, m, 257, dtype).T.copy()
            if dtype != np.float16
            else rng.standard_normal((257, m)).astype(dtype)
        )
        T[:5] = -0.0  # a zero sum of -0s is +0: the reduction starts from the identity
        T[5:10, ::2] = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            want = T.sum(axis=1)
            got = K.pairwise_sum([r.copy() for r in T.T])
            got_rows = K.sum_rows(list(T.T), 0, m)
            got_block = K.sum_rows(T.T, 0, m)
        assert got.dtype == dtype and got.tobytes() == want.tobytes(), m
        assert got_rows.tobytes() == want.tobytes() and got_block.tobytes() == want.tobytes(), m
    assert K.pairwise_sum([np.float32([-0.0]), np.float32([-0.0])]).tolist() == [0.0]
    assert not np.signbit(K.pairwise_sum([np.float32([-0.0]), np.float32([-0.0])])).any()
    # eight running sums: 1e8 + 1 loses the 1 (float32's spacing at 1e8 is 8), the seven 1 + 1 pairs
    # add up to 14, of which 8 survive; one value after another would give 1e8
    vals = [np.float32([1e8])] + [np.float32([1.0])] * 15
    assert K.pairwise_sum(vals).tolist() == [100000008.0]


@pytest.mark.parametrize("n", [3, 4, 20, 24, 25, 33])
def test_coordinatewise_rules_keep_the_sorts_bits(n):
    # the forms the network replaced: sorted transposed blocks, numpy's reductions along their rows
    rng = np.random.default_rng(n)
    X = (rng.standard_normal((n, 4000)) * rng.choice([1e-3, 1.0, 1e3], size=(n, 1))).astype(np.float32)
    X[:, :100] = rng.integers(-2, 3, (n, 100))
    T = np.sort(np.ascontiguousarray(X.T), axis=1)  # C order, as the blocks were
    lo, hi = (n - 1) // 2, n // 2
    assert make_aggregator("median", 0)(X).tobytes() == (0.5 * (T[:, lo] + T[:, hi])).tobytes()
    assert make_aggregator("median", 0, {"variant": "lower"})(X).tobytes() == T[:, lo].tobytes()
    for b in range(1, (n + 1) // 2):
        want = T[:, b : n - b].sum(axis=1) / (n - 2 * b)
        assert make_aggregator("trimmed_mean", b)(X).tobytes() == want.tobytes(), b


def test_sqdist_to_on_the_host():
    X = np.array([[0, 0, 0], [3, 4, 0], [1, 2, 2], [-1, 0, 0]], np.float32)
    assert K.sqdist_to(X, idx=0).tolist() == [0.0, 25.0, 9.0, 1.0]
    assert K.sqdist_to(X, idx=1).tolist() == [25.0, 0.0, 12.0, 32.0]
    assert K.sqdist_to(X, v=np.array([1.0, 2.0, 2.0])).tolist() == [9.0, 12.0, 0.0, 12.0]
    rng = np.random.default_rng(7)
    Y = rng.standard_normal((9, 100_003)).astype(np.float32)
    exact = ((Y.astype(np.float64) - Y[4].astype(np.float64)) ** 2).sum(axis=1)
    np.testing.assert_allclose(K.sqdist_to(Y, idx=4), exact, rtol=2e-6)
    # a row whose float32 squares overflow, one whose differences underflow, one holding NaN:
    # the first two taken again in float64, exactly; the last stays NaN
    Y[1, :3] = 3e30
    Y[4, 0] = 0.0
    Y[2] = Y[4]
    Y[2, 0] = 1e-30  # its square underflows float32
    Y[3, 5] = np.nan
    d2 = K.sqdist_to(Y, idx=4)
    for i in (1, 2):
        diff = Y[i].astype(np.float64) - Y[4].astype(np.float64)
        assert d2[i] == float(np.dot(diff, diff)) and d2[i] > 0
    assert np.isnan(d2[3]) and d2[4] == 0.0


@pytest.mark.parametrize("idx", [None, 0, 5])
def test_monna_selects_the_rows_the_gram_pass_selected(idx):
    # the Gram pass's distances (the host's before) rank the rows as the differences do
    rng = np.random.default_rng(12)
    X = rng.standard_normal((20, 30_001)).astype(np.float32) * rng.choice([0.5, 1.0, 3.0], size=(20, 1)).astype(
        np.float32
    )
    ref = rng.standard_normal(30_001).astype(np.float32)
    rule = make_aggregator("monna", 6, {} if idx is None else {"idx": idx})
    res = rule.aggregate(X, reference=ref)
    n = X.shape[0]
    d2 = K.gram(X, ref[None, :]).sqdist()[n, :n] if idx is None else K.gram(X).sqdist()[idx]
    near = np.argsort(d2, kind="stable")[: n - 6]
    assert np.flatnonzero(res.selected).tolist() == sorted(near.tolist())
    assert res.vector.tobytes() == K.combine(res.selected / (n - 6), X).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("s", [1, 2])
def test_bucketing_then_the_mean_keeps_the_plain_paths_bits(dtype, s):
    # one pass over the rows against the plain path (bucket means written out, then the mean)
    from fedring.aggregators.base import Aggregator

    rng = np.random.default_rng(6)
    pipe = make_aggregator("mean", 1, pre=("bucketing",), sections={"bucketing": {"s": s}})
    for n in (1, 2, 3, 5, 20, 33):
        for d in (2, 7, 5000, 70_001):
            X = scaled_rows(rng, n, d, dtype)
            X[:, d // 2] = np.finfo(dtype).max / 1.5  # two of them overflow: the plain path answers
            if n > 3 and d == 7:
                X[1, 3] = np.nan  # the plain path leaves this row out
            for Z in (X, X[: max(1, n // 2)] * dtype(1e-30)):  # no overflow: the fused pass answers
                with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
                    got = pipe.aggregate(Z, rng=r1)
                    want = Aggregator._aggregate_checked(pipe, Z, {}, None, r2)
                    if not isinstance(want, type(got)):  # a non-finite row: the rule on the others
                        want = pipe._aggregate_finite_rows(Z, want, {}, None, r2)
                assert got.vector.tobytes() == want.vector.tobytes(), (n, d)
                assert r1.bit_generator.state == r2.bit_generator.state  # the same draws, or none
                with np.errstate(over="ignore", invalid="ignore"):
                    fused = pipe.pre[0].then_checked(pipe.rule, Z, {}, None, np.random.default_rng(9))
                assert (fused is None) == (not np.isfinite(Z).all() or (Z is X and n >= 2)), (n, d)
    # the bucket means' -0 (an underflow) and the mean's start from +0, literally
    X = np.array([[-1e-45, 1.0], [0.0, 1.0], [-1e-45, 3.0], [0.0, 5.0]], np.float32)
    W = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    got = _mean_of_bucket_means(X, W)
    assert got.tolist() == [0.0, 2.5] and not np.signbit(got).any()
    assert _mean_of_bucket_means(np.array([[np.inf, 1.0], [0.0, 1.0]], np.float32), np.ones((1, 2))) is None
