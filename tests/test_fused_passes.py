"""Rules that find the non-finite rows in a pass they make anyway (``Aggregator._aggregate_checked``).

The mean and CRFL read finiteness off the mean (``_kernels.mean``, one parallel pass);
NormClipping, ARC-then-mean and clipping-then-mean off the row norms; and ARC or static clipping
then the mean run as one scaled mean (``_kernels.scaled_mean``) without the clipped copy. Each
must give the bits of the plain path: the separate ``nonfinite_rows`` pass, then the rule on the
rows (for a pre-aggregator: ``transform``, then ``Mean``), whether the rows are finite, hold NaN
or an infinity, or are finite with squares or column sums that overflow.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, base, make_aggregator, monna, preaggregators
from fedring.aggregators import _kernels as K
from fedring.aggregators._clustering import centred_column_gram
from fedring.aggregators.base import Aggregator, GramRule, PreAggregator, nonfinite_from_norms
from fedring.aggregators.coordinatewise import Median, TrimmedMean
from fedring.aggregators.meamed import Meamed
from fedring.aggregators.monna import MoNNA
from fedring.aggregators.preaggregators import NNM, Bucketing


def rows(n: int, d: int, dtype=np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)) * rng.uniform(0.1, 100.0, (n, 1))
    return X.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "shape", [(20, 70001), (64, 1), (64, 2), (64, 3), (3, 5), (1, 7), (7, 262145), (2, 262145), (16, 262145)]
)
def test_scaled_mean_is_the_mean_of_the_scaled_copy(shape, dtype):
    # numpy reduces axis 0 row after row for d > 1 and pairwise for d = 1 (n = 64 tells them apart);
    # 262145 columns end in a block of one column (ROW_RUN_BYTES, in both dtypes)
    X = rows(*shape, dtype=dtype)
    scale = np.random.default_rng(1).uniform(0.1, 1.0, shape[0])
    scale[::3] = 1.0
    want = (X * scale[:, None].astype(dtype)).mean(axis=0)
    got = K.scaled_mean(X, scale)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(K.mean(X), X.mean(axis=0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,k", [((20, 70001), 0), ((20, 70001), 1), ((3, 5), 2), ((7, 262145), 0), ((40, 300), 3)])
def test_row_stats_has_the_bits_of_the_float64_copy_per_block(shape, k, dtype):
    # the reused buffer must give the bits of X[:, sl].astype(float64) block by block, summed in
    # the order of map_blocks' runs (blocks of one run in order, then the runs in order)
    X = rows(*shape, dtype=dtype)
    R = rows(k, shape[1], dtype=dtype, seed=2)
    n, d = X.shape
    width = min(d, K.block_width(n + k))
    sls = list(K.blocks(d, width))
    runs = max(1, min(len(sls), K.RUNS))
    sq, dots = np.zeros(n), np.zeros((n, k))
    for r in range(runs):
        part_sq, part_dots = np.zeros(n), np.zeros((n, k))
        for sl in sls[r * len(sls) // runs : (r + 1) * len(sls) // runs]:
            B = X[:, sl].astype(np.float64)
            part_sq += np.einsum("ij,ij->i", B, B)
            part_dots += B @ R[:, sl].astype(np.float64).T
        sq, dots = sq + part_sq, dots + part_dots
    got_sq, got_dots = K.row_stats(X, R if k else None)
    np.testing.assert_array_equal(got_sq, sq)
    if k:
        np.testing.assert_array_equal(got_dots, dots)


@pytest.mark.parametrize("shape", [(1, 700_001), (20, 70_001), (3, 5), (4, 256)])
def test_sq_norms_keep_float32_accuracy(shape):
    # a float32 dot product of K.SEGMENT = 256 values is within 256 u of the exact one in any order
    # (u = 2^-24: 1.5e-5), and the segments are added in float64
    X = rows(*shape)
    X[0, :1000] = 1.0  # equal values: the summation's worst pattern
    exact = np.array([math.fsum((r.astype(np.float64) ** 2).tolist()) for r in X])
    got = K.sq_norms(X)
    assert np.all(np.abs(got - exact) <= K.SEGMENT * 2.0**-24 * exact)
    assert np.array_equal(K.sq_norms(X.astype(np.float64)), K.row_stats(X.astype(np.float64))[0])


def test_sq_norms_take_again_the_rows_float32_cannot_square():
    X = rows(6, 9000)
    X[1, 5] = 3e20  # its float32 square overflows
    X[2] = 1e-25  # every square underflows
    X[3, 7] = np.nan
    X[4, 0] = -np.inf
    X[5] = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        want = K.row_stats(X)[0]
        got = K.sq_norms(X)
    np.testing.assert_array_equal(got[1:], want[1:])
    assert abs(got[0] - want[0]) <= 1e-6 * want[0]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_all_finite_reads_the_sum_and_checks_values_where_it_is_not_finite(kind, dtype):
    """``_kernels.all_finite`` is exact: True for finite values whose sum overflows, False for any
    NaN or infinity (the sum NaN, or an infinity of either sign), True for no values."""
    import torch

    big = float(np.finfo(dtype).max)
    cases = {
        (1.0, 2.0): True,
        (big, big): True,
        (-big, -big, 1.0): True,
        (1.0, np.inf): False,
        (-np.inf, 1.0): False,
        (np.inf, -np.inf): False,
        (np.nan,): False,
        (big, np.nan): False,
        (): True,
    }
    for values, expected in cases.items():
        a = np.array(values, dtype)
        assert K.all_finite(a if kind == "numpy" else torch.from_numpy(a)) is expected, (values, kind, dtype)


@pytest.mark.parametrize("kind", ["numpy", "torch, the sum", "torch, the extremes"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nonfinite_flags_are_the_rows_with_a_nan_or_an_infinity(kind, dtype):
    """``_kernels.nonfinite_flags`` (an array of the rows' kind, unread) flags exactly the rows
    holding a NaN or an infinity, by either form on tensors: not rows of finite values whose sum
    overflows, nor a row without values."""
    import torch

    from fedring.aggregators import _kernels_torch

    big = float(np.finfo(dtype).max)
    rows = {
        (1.0, 2.0, 3.0): False,
        (big, big, big): False,
        (-big, -big, 1.0): False,
        (1.0, np.inf, 0.0): True,
        (-np.inf, 1.0, 2.0): True,
        (np.inf, -np.inf, 0.0): True,
        (np.nan, 0.0, 0.0): True,
        (big, np.nan, -big): True,
        (0.0, -0.0, 5e-324 if dtype == "float64" else 1e-45): False,
    }
    X = np.array(list(rows), dtype)
    for x in (X, X[:, :0]):
        expected = [bool(v) and x.shape[1] > 0 for v in rows.values()]
        if kind == "numpy":
            got = K.nonfinite_flags(x)
            assert isinstance(got, np.ndarray)
        else:
            got = _kernels_torch.nonfinite_flags(torch.from_numpy(x), extremes=kind.endswith("extremes"))
            assert got.dtype == torch.bool and got.device == torch.device("cpu")
        assert np.asarray(got).tolist() == expected, (kind, dtype, x.shape)


def test_nonfinite_from_norms_checks_overflowing_rows_value_by_value():
    X = np.array([[1.0, 2.0], [np.nan, 0.0], [1e200, 0.0], [-np.inf, 1.0]])
    with np.errstate(over="ignore", invalid="ignore"):
        sq = K.row_stats(X)[0]
    assert np.isinf(sq[2])
    assert nonfinite_from_norms(X, sq).tolist() == [False, True, False, True]


def plain(name: str, f: int, X: np.ndarray, seed: int):
    """The rule's result by the plain path: the non-finite rows left out, then the rule's passes."""
    bad = K.nonfinite_rows(X)
    keep = np.flatnonzero(~bad)
    rng = np.random.default_rng(seed)
    f = max(f - int(bad.sum()), 0)
    Y = X[keep]
    if name in ("arc+mean", "clipping+mean"):
        stage = PRE_AGGREGATORS["arc"](f) if name == "arc+mean" else PRE_AGGREGATORS["clipping"](f)
        return AGGREGATORS["mean"]().aggregate(stage.transform(Y, rng)[0]).vector, bad
    if name == "mean":
        return Y.mean(axis=0), bad
    if name == "normclipping":
        factor = np.minimum(1.0, 3.0 / (np.sqrt(K.row_stats(Y)[0]) + 1e-6))
        return K.combine(factor, Y) / Y.shape[0], bad
    mean = Y.mean(axis=0)  # CRFL: the mean clipped to norm 3, plus N(0, 0.001^2) drawn in float64
    norm = float(np.sqrt(np.dot(mean.astype(np.float64), mean.astype(np.float64))))
    out = mean * X.dtype.type(min(1.0, 3.0 / (norm + 1e-10)))
    return out + (0.001 * rng.standard_normal(X.shape[1])).astype(X.dtype), bad


def fused(name: str, f: int, X: np.ndarray, seed: int):
    pre = name.removesuffix("+mean")
    rule = make_aggregator("mean", f, {}, (pre,)) if name.endswith("+mean") else make_aggregator(name, f)
    return rule.aggregate(X, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("name", ["mean", "crfl", "normclipping", "arc+mean", "clipping+mean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["finite", "nan-and-inf", "overflow"])
def test_fused_check_gives_the_plain_paths_bits(name, dtype, case):
    X = rows(20, 4099, dtype=dtype)
    X[:2] *= 10
    if case == "nan-and-inf":
        X[3, 100] = np.nan
        X[11, 0] = -np.inf
    elif case == "overflow":  # finite rows whose squares (float64) or column sums (float32) overflow
        X[5, 7] = X[6, 7] = 0.75 * np.finfo(np.float32).max if dtype == np.float32 else 1e200
        with np.errstate(over="ignore"):
            assert np.isinf(X.sum(axis=0)[7] if dtype == np.float32 else X[5, 7] ** 2)
    with np.errstate(over="ignore", invalid="ignore"):
        want, bad = plain(name, 4, X, seed=3)
        res = fused(name, 4, X, seed=3)
    assert (res.excluded is None) == (not bad.any())
    if bad.any():
        assert res.excluded.tolist() == bad.tolist()
    assert res.vector.dtype == dtype
    np.testing.assert_array_equal(res.vector, want)


GRAM_RULES = sorted(n for n in AGGREGATORS if issubclass(AGGREGATORS[n], GramRule))


def gram_rule(name: str, f: int):
    if name == "nnm+mean":
        return make_aggregator("mean", f, {}, ("nnm",))
    if name == "geomed-zero":  # a Gram with an extra row
        return make_aggregator("geomed", f, {"init": "zero"})
    if name == "monna-0":  # ByzFL's form: the distances to row 0
        return make_aggregator("monna", f, {"idx": 0})
    return make_aggregator(name, f)


def reference(X):
    return np.linspace(-1.0, 1.0, X.shape[1]).astype(X.dtype)


def test_the_gram_rules_are_those_whose_first_pass_is_the_gram():
    assert GRAM_RULES == [
        "bulyan", "caf", "cclip", "copod", "geomed", "huber", "krum", "mca", "mda", "multikrum",
        "simpleclustering", "smea",
    ]  # fmt: skip


@pytest.mark.parametrize("name", [*GRAM_RULES, "geomed-zero", "monna", "monna-0", "nnm+mean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["finite", "nan-and-inf", "overflow", "pivot-nan", "row-0-nan"])
def test_gram_rules_read_finiteness_off_their_gram_with_the_plain_paths_bits(name, dtype, case, monkeypatch):
    # the plain path: nonfinite_rows' own pass, then the rule (its Gram pass) on the finite rows
    X = rows(12, 5003, dtype=dtype)
    if case == "nan-and-inf":
        X[3, 100] = np.nan
        X[11, 0] = -np.inf
    elif case == "overflow":  # a finite row whose squares overflow (float32 in the Gram's products)
        X[5, 7] = 3e30 if dtype == np.float32 else 1e200
    elif case == "pivot-nan":  # the pivot itself is bad: every distance is NaN
        X[K.pivot_row(X), 4000] = np.nan
    elif case == "row-0-nan":  # monna-0's trusted row: its own distance is 0, every other one NaN
        X[0, 10] = np.nan
    f = 2 if name == "bulyan" else 3

    def run():
        try:
            return gram_rule(name, f).aggregate(X, reference=reference(X), rng=np.random.default_rng(3))
        except (np.linalg.LinAlgError, ValueError) as e:  # CAF, SMEA, SimpleClustering: float64 overflow
            return type(e)

    with np.errstate(all="ignore"):  # COPOD's logs of zero on the overflowing float64 row
        res = run()
        monkeypatch.setattr(GramRule, "_aggregate_checked", Aggregator._aggregate_checked)
        monkeypatch.setattr(MoNNA, "_aggregate_checked", Aggregator._aggregate_checked)
        monkeypatch.setattr(NNM, "then_checked", PreAggregator.then_checked)
        want = run()
    if not isinstance(want, tuple):
        assert case == "overflow" and res is want
        return
    bad = K.nonfinite_rows(X)
    assert (res.excluded is None) == (want.excluded is None) == (not bad.any())
    if bad.any():
        assert res.excluded.tolist() == want.excluded.tolist() == bad.tolist()
    assert res.vector.dtype == dtype
    np.testing.assert_array_equal(res.vector, want.vector)
    if want.selected is not None:
        np.testing.assert_array_equal(res.selected, want.selected)


def counted(fn, key: str, calls: dict):
    def wrapper(*args, **kw):
        calls[key] += 1
        return fn(*args, **kw)

    return wrapper


@pytest.mark.parametrize("name", [*GRAM_RULES, "geomed-zero", "nnm+mean"])
def test_gram_rules_make_one_gram_pass_and_no_other_check_on_finite_rows(name, monkeypatch):
    calls = {"gram": 0, "nonfinite_rows": 0}
    real_gram, real_nonfinite = K.gram, K.nonfinite_rows
    for module in {sys.modules[AGGREGATORS[n].__module__] for n in GRAM_RULES} | {base, preaggregators}:
        if hasattr(module, "gram"):
            monkeypatch.setattr(module, "gram", counted(real_gram, "gram", calls))
        if hasattr(module, "nonfinite_rows"):
            monkeypatch.setattr(module, "nonfinite_rows", counted(real_nonfinite, "nonfinite_rows", calls))
    X = rows(12, 5003)
    gram_rule(name, 2 if name == "bulyan" else 3).aggregate(X, reference=reference(X), rng=np.random.default_rng(3))
    assert calls == {"gram": 1, "nonfinite_rows": 0}


@pytest.mark.parametrize("idx", [None, 0, 7])
def test_monna_makes_one_distance_pass_and_no_other_check_on_finite_rows(idx, monkeypatch):
    calls = {"gram": 0, "nonfinite_rows": 0, "sqdist_to": 0}
    for module in (monna, base, K):
        for key in calls:
            if hasattr(module, key):
                monkeypatch.setattr(module, key, counted(getattr(module, key), key, calls))
    X = rows(12, 5003)
    make_aggregator("monna", 3, {} if idx is None else {"idx": idx}).aggregate(X, reference=reference(X))
    assert calls == {"gram": 0, "nonfinite_rows": 0, "sqdist_to": 1}


def test_gram_takes_rows_that_overflow_float32_again_in_float64():
    # the retake is the float64 pass on the same pivot and blocks: the bits of the float64 rows' Gram
    X = rows(12, 70_001)
    X[4, :5] = 3e30
    E = rows(1, 70_001, seed=4)
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(K._gram_pass(X, None, K.pivot_row(X), wide=False).C).all()
        for extra in (None, E):
            G, want = K.gram(X, extra), K.gram(X.astype(np.float64), extra)
            assert np.isfinite(G.C).all()
            np.testing.assert_array_equal(G.C, want.C)
            np.testing.assert_array_equal(G.h, want.h)
            assert G.pp == want.pp
        cols = np.arange(0, 70_001, 3)
        K2 = centred_column_gram(X, cols)
        assert np.isfinite(K2).all()
        np.testing.assert_array_equal(K2, centred_column_gram(X.astype(np.float64), cols))
    X[7, 3] = np.nan  # a non-finite row stays non-finite: the rules leave it out
    G = K.gram(X)
    assert not np.isfinite(G.C[7, 7]) and np.isfinite(np.delete(np.diag(G.C), 7)).all()


def test_gram_on_a_tensor_takes_rows_that_overflow_float32_again_in_float64():
    torch = pytest.importorskip("torch")
    X = rows(12, 20_001)
    X[4, :5] = 3e30
    G = K.gram(torch.from_numpy(X))
    want = K.gram(torch.from_numpy(X.astype(np.float64)))
    assert np.isfinite(G.C).all()
    np.testing.assert_array_equal(G.C, want.C)


def test_crfl_leaves_the_generator_where_the_finite_rows_leave_it():
    # the noise is drawn beside the mean: a call that finds a non-finite row rewinds its draw
    X = rows(6, 1000)
    X[2, 0] = np.nan
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    make_aggregator("crfl", 1).aggregate(X, rng=rng_a)
    make_aggregator("crfl", 0).aggregate(np.delete(X, 2, axis=0), rng=rng_b)
    assert rng_a.bit_generator.state == rng_b.bit_generator.state
    assert rng_a.standard_normal() == rng_b.standard_normal()


def test_scaled_mean_on_a_tensor_within_float32_rounding():
    torch = pytest.importorskip("torch")
    X = rows(12, 3001)
    scale = np.linspace(0.2, 1.0, 12)
    got = K.scaled_mean(torch.from_numpy(X), scale)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    # two float32 sums of 12 scaled rows in different orders: each within n u max|X| of the exact sum
    atol = 2 * 12 * 2.0**-24 * float(np.abs(X).max())
    np.testing.assert_allclose(got.numpy(), K.scaled_mean(X, scale), rtol=0, atol=atol)


THREAD_PROBE = """
import hashlib, json, sys
import numpy as np
from fedring.aggregators import make_aggregator
from fedring.aggregators import _kernels as K
from fedring.aggregators._clustering import centred_column_gram

rng = np.random.default_rng(0)
X = (rng.standard_normal((20, 300_001)) * rng.uniform(0.1, 100.0, (20, 1))).astype(np.float32)
R = rng.standard_normal((2, X.shape[1])).astype(np.float32)
G = K.gram(X)
sq, dots = K.row_stats(X, R)
arrays = {"gram": G.C, "gram_h": G.h, "gram_pp": np.float64(G.pp), "row_stats": sq, "row_dots": dots,
          "sign_gram": K.sign_gram(X), "sq_norms": K.sq_norms(X)}
for name in sys.argv[1].split(","):
    pre = name.removesuffix("+mean")
    rule = make_aggregator("mean", 4, {}, (pre,)) if name.endswith("+mean") else make_aggregator(name, 4)
    arrays[name] = rule.aggregate(X, rng=np.random.default_rng(1)).vector
print(json.dumps({k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in arrays.items()}))
"""


def test_passes_give_the_same_bits_on_any_number_of_threads():
    # a job's cores, its binding or $FEDRING_THREADS must not change a results file: the runs of a
    # pass, so the order of its float64 sums, are fixed (K.RUNS); 1 thread used to sum 4 runs, 2 threads 8
    rules = (
        "krum,geomed,cclip,caf,huber,mca,foolsgold,lasa,flame,signguard,clippedclustering,fldetector,arc+mean,nnm+mean,"
        "median,trimmed_mean,meamed,bucketing+mean"
    )
    digests = []
    for threads in (1, 2, 3):
        env = {**os.environ, "FEDRING_THREADS": str(threads)}
        out = subprocess.run(
            [sys.executable, "-c", THREAD_PROBE, rules], env=env, capture_output=True, text=True, check=True
        )
        digests.append(json.loads(out.stdout))
    assert len(digests[0]) == 7 + len(rules.split(","))
    assert digests[1] == digests[0]
    assert digests[2] == digests[0]


SORTED_RULES = ["median", "trimmed_mean", "meamed", "bucketing+mean"]


@pytest.mark.parametrize("name", SORTED_RULES)
@pytest.mark.parametrize("n", [20, 30])  # the sorting network's path and the transposed sort's
@pytest.mark.parametrize("case", ["finite", "nan-and-inf", "overflow"])
def test_sorting_passes_read_finiteness_off_their_blocks_with_the_plain_paths_bits(name, n, case, monkeypatch):
    # the plain path: nonfinite_rows' own pass, then the rule on the finite rows; bucketing then the
    # mean checks its one pass's output and takes the plain path where it is not finite
    X = rows(n, 70_001, dtype=np.float32)
    if case == "nan-and-inf":
        X[3, 100] = np.nan
        X[11, 60_000] = -np.inf
    elif case == "overflow":  # finite rows whose sums overflow float32
        X[5, 7] = X[6, 7] = X[7, 7] = 0.75 * np.finfo(np.float32).max
    rule = make_aggregator("mean", 4, {}, ("bucketing",)) if name == "bucketing+mean" else make_aggregator(name, 4)

    def run():
        return rule.aggregate(X, rng=np.random.default_rng(3))

    with np.errstate(all="ignore"):
        res = run()
        for cls in (Median, TrimmedMean, Meamed):
            monkeypatch.setattr(cls, "_aggregate_checked", Aggregator._aggregate_checked)
        monkeypatch.setattr(Bucketing, "then_checked", PreAggregator.then_checked)
        want = run()
    bad = K.nonfinite_rows(X)
    assert (res.excluded is None) == (want.excluded is None) == (not bad.any())
    if bad.any():
        assert res.excluded.tolist() == want.excluded.tolist() == bad.tolist()
    assert res.vector.tobytes() == want.vector.tobytes()


@pytest.mark.parametrize("name", SORTED_RULES)
def test_sorting_passes_make_no_other_check_on_finite_rows(name, monkeypatch):
    calls = {"nonfinite_rows": 0}
    for module in (K, base, preaggregators):
        monkeypatch.setattr(module, "nonfinite_rows", counted(K.nonfinite_rows, "nonfinite_rows", calls))
    X = rows(20, 5003)
    rule = make_aggregator("mean", 4, {}, ("bucketing",)) if name == "bucketing+mean" else make_aggregator(name, 4)
    rule.aggregate(X, rng=np.random.default_rng(3))
    assert calls == {"nonfinite_rows": 0}
