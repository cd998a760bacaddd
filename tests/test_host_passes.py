"""Host passes that replace a slower numpy form of the same figures (issue 32's CPU race).

Bucketing's bucket means and Meamed's run sums keep the bits of the forms they replace, which
each test states literally and compares byte for byte. MoNNA's distances now come from the
differences instead of the Gram pass: the same figures to float32 rounding, and so the same
nearest rows unless two distances tie to that rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedring.aggregators import _kernels as K
from fedring.aggregators import make_aggregator
from fedring.aggregators.meamed import _host_run_sums
from fedring.aggregators.preaggregators import Bucketing, _bucket_means


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
                want = W.astype(dtype) @ X
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
                got = _host_run_sums(T.copy(), med, f)
            assert got.dtype == dtype and got.tobytes() == want.tobytes(), (n, f)


def test_meamed_run_sums_literal():
    # median 2; run of 4 from the left (0 and 4 equally close: the lower kept), sum 6
    # median 2.5 of (0, 2, 3, 9): |9 - 2.5| > |0 - 2.5|, so the run is (0, 2, 3), sum 5
    T = np.array([[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 3.0, 9.0, np.nan]])
    assert _host_run_sums(T[:1].copy(), np.array([2.0]), 1).tolist() == [6.0]
    T2 = np.array([[0.0, 2.0, 3.0, 9.0]])
    assert _host_run_sums(T2, np.array([2.5]), 1).tolist() == [5.0]
    assert T2.tolist() == [[0.0, 2.0, 3.0, 0.0]]  # the block is overwritten: outside the run +0


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
