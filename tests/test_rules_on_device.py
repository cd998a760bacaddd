"""The server rules and pre-aggregators on torch tensors (docs/arrays.md, "Rules on the device").

CI has no GPU, so the rows are CPU tensors: the tensor kernels (fedring/aggregators/_kernels_torch.py)
run exactly as they would on a device, and every rule is compared with its numpy path on the same
input. Tolerances, per family (justified in docs/arrays.md):

- host-only rules (``on_device = False``), and rules that only copy rows or count signs (median,
  krum, signsgd, rlr): the same bits.
- every other rule: the same ``selected`` when it is a 0/1 selection or an integer count, weights
  within :data:`WEIGHT_ATOL` when they are smooth functions of the Gram matrix, and a vector within
  ``2 n u max|X|`` (u = 2^-24): two float32 evaluations, in different orders, of sums of at most n
  rows with weights of total magnitude at most 1 each lie within ``n u max|X|`` of the exact sum.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, make_aggregator  # noqa: E402
from fedring.aggregators import _kernels as K  # noqa: E402
from fedring.aggregators.probe import LinearProbe  # noqa: E402

#: rules whose tensor path selects and copies the same float32 values, or counts signs exactly
EXACT = {"median", "krum", "signsgd", "rlr"}
#: rules and pre-aggregators that must run on the rows' device (docs/arrays.md)
ON_DEVICE = {
    *("mean", "median", "trimmed_mean", "krum", "multikrum", "geomed", "huber", "cclip", "fedseca", "bulyan"),
    *("mda", "monna", "meamed", "caf", "smea", "signsgd", "rlr", "ties", "mca", "fltrust", "hplus", "zenopp"),
    *("copod", "crfl", "normclipping"),
}
PRE_ON_DEVICE = {"nnm", "bucketing", "clipping", "arc"}
#: Weiszfeld, clipping and filtering weights are smooth in the float64 Gram entries, which differ by
#: the float32 rounding of the blocked products (measured up to 9e-7 on these inputs)
WEIGHT_ATOL = 1e-5
U32 = 2.0**-24


def rows(n: int, d: int = 3000, seed: int = 0) -> np.ndarray:
    """n float32 rows around a common point, row 1 forty times larger and row 4 reflected and shifted."""
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n, d)) + 0.5 * rng.normal(size=d)).astype(np.float32)
    X[1] *= 40
    X[4] = -3 * X[4] + 5
    return X


def assert_same_result(name: str, X: np.ndarray, res_np, res_t, exact: bool) -> None:
    assert isinstance(res_t.vector, torch.Tensor) and res_t.vector.dtype == torch.float32
    assert res_t.vector.device == torch.device("cpu") and tuple(res_t.vector.shape) == (X.shape[1],)
    vector = res_t.vector.numpy()
    if exact:
        np.testing.assert_array_equal(vector, res_np.vector, err_msg=name)
    else:
        atol = 2 * X.shape[0] * U32 * float(np.abs(X[np.isfinite(X).all(axis=1)]).max())
        np.testing.assert_allclose(vector, res_np.vector, rtol=0, atol=atol, err_msg=name)
    assert (res_t.selected is None) == (res_np.selected is None)
    if res_np.selected is not None:
        assert isinstance(res_t.selected, np.ndarray)
        zero_one = np.isin(res_np.selected, (0.0, 1.0)).all()
        if exact or zero_one or name == "fedseca":  # fedseca's rho: integer votes / n
            np.testing.assert_array_equal(res_t.selected, res_np.selected, err_msg=name)
        else:
            np.testing.assert_allclose(res_t.selected, res_np.selected, rtol=0, atol=WEIGHT_ATOL, err_msg=name)
    for a, b in ((res_np.excluded, res_t.excluded),):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def run_both(a, b, X: np.ndarray, rounds: int = 2):
    """Two rounds of ``a`` on numpy and ``b`` on a CPU tensor, state and rng as the loop passes them."""
    n, d = X.shape
    honest = np.delete(X, [1, 4], axis=0)
    ref = honest[np.isfinite(honest).all(axis=1)].mean(axis=0)
    s_np, s_t = a.init_state(n, d), b.init_state(n, d)
    probe = LinearProbe(np.zeros(d), 0.1, (d // 2 - 1,)) if a.needs_probe else None  # DeepSight's model
    for t in range(rounds):
        r_np = a.aggregate(X, state=s_np, reference=ref, rng=np.random.default_rng(t), probe=probe)
        r_t = b.aggregate(
            torch.from_numpy(X.copy()),
            state=s_t,
            reference=torch.from_numpy(ref),
            rng=np.random.default_rng(t),
            probe=probe,
        )
        yield r_np, r_t, s_np, s_t


@pytest.mark.parametrize("n", [11, 12])
@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_rule_on_tensor_matches_numpy(name, n):
    X = rows(n)
    a, b = make_aggregator(name, 2, {}), make_aggregator(name, 2, {})
    exact = name in EXACT or not b.on_device
    for r_np, r_t, s_np, s_t in run_both(a, b, X):
        assert_same_result(name, X, r_np, r_t, exact)
        assert s_t.keys() == s_np.keys()
        for key in s_np:  # numpy, or (the center of cclip) a tensor of the same dtype on the rows' device
            if name == "cclip":
                assert isinstance(s_t[key], torch.Tensor) and s_t[key].dtype == torch.float64
            else:
                assert isinstance(s_t[key], np.ndarray) and s_t[key].dtype == s_np[key].dtype
            np.testing.assert_allclose(
                np.asarray(s_t[key]), s_np[key], rtol=0, atol=2 * n * U32 * float(np.abs(X).max())
            )


@pytest.mark.parametrize("pre", sorted(PRE_AGGREGATORS))
@pytest.mark.parametrize("name", ["mean", "krum", "median"])
def test_pipeline_on_tensor_matches_numpy(pre, name):
    X = rows(10, seed=1)
    a, b = make_aggregator(name, 1, {}, pre=[pre]), make_aggregator(name, 1, {}, pre=[pre])
    assert b.on_device == (b.rule.on_device and PRE_AGGREGATORS[pre].on_device)
    for r_np, r_t, _, _ in run_both(a, b, X):
        # krum and median copy a pre-aggregated row, which the pre-aggregator's products rounded, or
        # scaled by factors from the row norms, which the two paths sum in different orders
        assert_same_result(b.name, X, r_np, r_t, exact=pre == "bucketing" and name == "median")


@pytest.mark.parametrize("bucketing", ["none", "random", "sequential"])
def test_cclip_on_tensor_matches_numpy(bucketing, blocks):
    """Centered clipping's device path (distances from the differences to each iterate; the bucket
    means made once) against the host's Gram pass, over three rounds from a center that moves, with
    a radius that clips some rows and not others (``selected`` strictly between 0 and 1 for them)."""
    X = rows(11, seed=7)
    a, b = (make_aggregator("cclip", 2, {"tau": 60.0, "bucketing": bucketing}) for _ in range(2))
    clipped = False
    for r_np, r_t, s_np, s_t in run_both(a, b, X, rounds=3):
        assert_same_result("cclip", X, r_np, r_t, exact=False)
        clipped |= bool(((r_np.selected > 0) & (r_np.selected < 1)).any() and (r_np.selected == 1).any())
        np.testing.assert_allclose(s_t["center"].numpy(), s_np["center"], rtol=0, atol=2 * 11 * U32 * np.abs(X).max())
    assert clipped


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "bulyan", "multikrum", "cclip", "fedseca", "ties", "rlr"])
def test_rule_on_tensor_in_many_blocks(name, blocks):
    X = rows(11, seed=6)
    a, b = make_aggregator(name, 2, {}), make_aggregator(name, 2, {})
    for r_np, r_t, _, _ in run_both(a, b, X):
        assert_same_result(name, X, r_np, r_t, exact=name in EXACT)


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_nonfinite_rows_on_tensor(name):
    """The non-finite policy on tensors: the same rows left out, the same result."""
    X = rows(12, seed=2)
    X[7, 5] = np.nan
    X[9, 0] = -np.inf
    a, b = make_aggregator(name, 2, {}), make_aggregator(name, 2, {})
    for r_np, r_t, _, _ in run_both(a, b, X, rounds=1):
        np.testing.assert_array_equal(r_t.excluded, [i in (7, 9) for i in range(12)])
        assert_same_result(name, X, r_np, r_t, exact=name in EXACT or not b.on_device)


@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n", [10, 11])
def test_bucketing_then_mean_on_tensor(n, bad):
    """On a device bucketing then the mean is one weighted mean of the rows (an odd n leaves a bucket
    of one, whose client weighs twice the others), its check read off its result: a non-finite row
    rewinds the generator, so the buckets of the finite rows are those the host draws, and the
    generator ends where the host's does."""
    X = rows(n, seed=4)
    if bad is not None:
        X[3, 7] = bad
    a, b = make_aggregator("mean", 1, {}, pre=["bucketing"]), make_aggregator("mean", 1, {}, pre=["bucketing"])
    for seed in range(3):
        rng_np, rng_t = np.random.default_rng(seed), np.random.default_rng(seed)
        r_np, r_t = a.aggregate(X, rng=rng_np), b.aggregate(torch.from_numpy(X.copy()), rng=rng_t)
        assert rng_np.bit_generator.state == rng_t.bit_generator.state
        if bad is None:
            assert r_t.excluded is None and r_np.excluded is None
        else:
            np.testing.assert_array_equal(r_t.excluded, np.arange(n) == 3)
        assert_same_result(b.name, X, r_np, r_t, exact=False)


def test_monna_trusted_client_on_tensor():
    X = rows(11, seed=3)
    X[2, 0] = np.nan
    for idx, zero in ((5, False), (2, True)):
        a = make_aggregator("monna", 2, {"idx": idx})
        r_np, r_t = a.aggregate(X), a.aggregate(torch.from_numpy(X))
        assert isinstance(r_t.vector, torch.Tensor) and bool((r_t.vector == 0).all()) == zero
        np.testing.assert_array_equal(r_t.selected, r_np.selected)
        np.testing.assert_allclose(r_t.vector.numpy(), r_np.vector, rtol=0, atol=2 * 11 * U32 * np.nanmax(np.abs(X)))


def test_on_device_flags():
    assert {k for k in AGGREGATORS if AGGREGATORS[k].on_device} >= ON_DEVICE - {"hplus"}
    assert make_aggregator("hplus", 2, {}).on_device and not make_aggregator("hplus", 2, {"base": "flame"}).on_device
    assert {k for k in PRE_AGGREGATORS if PRE_AGGREGATORS[k].on_device} == PRE_ON_DEVICE
    for name in AGGREGATORS:  # a host-only rule says why
        if not make_aggregator(name, 2, {}).on_device:
            assert "Runs on the host:" in " ".join((AGGREGATORS[name].__doc__ or "").split()), name


def test_host_only_rule_returns_a_tensor_on_the_rows_device(monkeypatch):
    X = rows(11, seed=4)
    a = make_aggregator("foolsgold", 2, {})
    assert not a.on_device
    seen = []
    inner = type(a)._aggregate
    monkeypatch.setattr(type(a), "_aggregate", lambda self, Y, *args: seen.append(type(Y)) or inner(self, Y, *args))
    T = torch.from_numpy(X.copy())
    res = a.aggregate(T, state=a.init_state(11, X.shape[1]))
    assert seen == [np.ndarray]  # the rule saw one host copy
    assert isinstance(res.vector, torch.Tensor) and res.vector.device == T.device and res.vector.dtype == T.dtype
    np.testing.assert_array_equal(res.vector.numpy(), a.aggregate(X, state=a.init_state(11, X.shape[1])).vector)


def test_tensor_dtypes_and_reference_kinds():
    X = rows(11, seed=5)
    a = make_aggregator("fltrust", 2, {})
    ref = X[5:].mean(axis=0)
    out64 = a.aggregate(torch.from_numpy(X.astype(np.float64)), reference=ref).vector
    assert out64.dtype == torch.float64
    atol = 2 * 11 * 2.0**-53 * np.abs(X).max()  # the float64 form of the Gram-family bound
    np.testing.assert_allclose(
        out64.numpy(), a.aggregate(X.astype(np.float64), reference=ref).vector, rtol=0, atol=atol
    )
    ints = torch.arange(12).reshape(3, 4)
    assert make_aggregator("mean", 0, {}).aggregate(ints).vector.dtype == torch.float64
    # a tensor reference with numpy rows, and a numpy reference with tensor rows
    np.testing.assert_array_equal(
        a.aggregate(X, reference=torch.from_numpy(ref)).vector, a.aggregate(X, reference=ref).vector
    )
    with pytest.raises(ValueError, match=r"\(n, d\) matrix"):
        make_aggregator("mean", 0, {}).aggregate(torch.ones(3))
    with pytest.raises(ValueError, match="reference must have shape"):
        a.aggregate(torch.ones((3, 2)), reference=np.ones(3))


# --------------------------------------------------------------------------------------
# the kernels: tensors against numpy
# --------------------------------------------------------------------------------------


@pytest.fixture(params=["one block", "many blocks"])
def blocks(request, monkeypatch):
    """The tensor kernels with their default block budget, and with blocks of 256 columns (the
    test's inputs fit one default block; a device's large ones take many)."""
    if request.param == "many blocks":
        from fedring.aggregators import _kernels_torch

        monkeypatch.setattr(_kernels_torch, "DEVICE_BYTES", 1024)
    return request.param


def test_gram_and_row_stats_integer_exact(blocks):
    """Integer rows: every block product and sum is an integer below 2^24 (float32) or 2^53 (float64),
    so the tensor kernels equal the numpy kernels exactly, whatever the order of the sums."""
    rng = np.random.default_rng(6)
    X = rng.integers(-20, 21, size=(9, 4000)).astype(np.float32)  # |x - p| <= 40: C_ij <= 1600 d < 2^24
    extra = rng.integers(-20, 21, size=(1, 4000)).astype(np.float64)
    T = torch.from_numpy(X)
    assert K.pivot_row(T) == K.pivot_row(X)
    for ext in (None, extra):
        G_np = K.gram(X, ext)
        G_t = K.gram(T, None if ext is None else torch.from_numpy(ext))
        assert isinstance(G_t.C, np.ndarray) and G_t.C.dtype == np.float64 and isinstance(G_t.pp, float)
        np.testing.assert_array_equal(G_t.C, G_np.C)
        np.testing.assert_array_equal(G_t.h, G_np.h)
        assert G_t.pp == G_np.pp
    sq_np, dots_np = K.row_stats(X, extra)
    sq_t, dots_t = K.row_stats(T, extra)
    # the tensor path's squares sum exactly too (integers below 2^24), into a norm rounded once to
    # float32 (u = 2^-24) and squared exactly in float64: within (1 + u)^2 - 1 < 2^-22 relative
    np.testing.assert_allclose(sq_t, sq_np, rtol=2.0**-22, atol=0)
    np.testing.assert_array_equal(dots_t, dots_np)
    w = np.array([[1, 0, 2, 0, 0, -1, 0, 0, 3, 1], [0] * 9 + [1]], np.float64)
    out = K.combine(w, T, extra)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), K.combine(w, X, extra))


def test_products_split_over_columns_exact():
    """Blocks wider than ``SPLIT`` columns take batched products of column slices plus the rest;
    on integer rows every partial sum is an integer below 2^24, so the Gram pass and the sign Gram
    still equal numpy's exactly."""
    from fedring.aggregators import _kernels_torch

    rng = np.random.default_rng(10)
    d = 2 * _kernels_torch.SPLIT + 123
    X = rng.integers(-5, 6, size=(7, d)).astype(np.float32)  # |x - p| <= 10: C_ij <= 100 d < 2^24
    T = torch.from_numpy(X)
    G_np, G_t = K.gram(X), K.gram(T)
    np.testing.assert_array_equal(G_t.C, G_np.C)
    np.testing.assert_array_equal(G_t.h, G_np.h)
    np.testing.assert_array_equal(K.sign_gram(T), K.sign_gram(X))
    B = torch.from_numpy(rng.normal(size=(4, d)).astype(np.float32))
    np.testing.assert_allclose(_kernels_torch.products(B).numpy(), (B.double() @ B.double().T).numpy(), rtol=1e-5)


def test_sign_kernels_exact(blocks):
    rng = np.random.default_rng(7)
    X = rng.normal(size=(10, 5001)).astype(np.float32)
    X[0, :50] = 0
    X[3, 7:90] = -0.0
    T = torch.from_numpy(X)
    S = K.sign_gram(T)
    assert S.dtype == np.int64
    np.testing.assert_array_equal(S, K.sign_gram(X))
    np.testing.assert_array_equal(K.column_sign_sum(T).numpy(), K.column_sign_sum(X))
    np.testing.assert_array_equal(K.column_count(T > 0).numpy(), K.column_count(X > 0))
    np.testing.assert_array_equal(K.signs(T, torch.float32).numpy(), K.signs(X, np.float32))


def test_nonfinite_rows_quantiles_and_sorted_columns_exact(blocks):
    rng = np.random.default_rng(8)
    X = rng.normal(size=(6, 3001)).astype(np.float32)
    X[1, 5] = np.nan
    X[3, 3000] = np.inf
    X[4, :] = 3e38  # finite rows whose sums overflow
    T = torch.from_numpy(X)
    bad = K.nonfinite_rows(T)
    assert bad.dtype == bool
    np.testing.assert_array_equal(bad, K.nonfinite_rows(X))
    Y = np.delete(X, [1, 3, 4], axis=0)  # the finite rows, without overflowing ones
    for q in (0.0, 0.3, 0.9, 0.999, 1.0):
        np.testing.assert_array_equal(K.abs_row_quantiles(torch.from_numpy(Y), q), K.abs_row_quantiles(Y, q))
    scale = np.linspace(0.5, 2.0, Y.shape[0])
    for sc in (None, scale):
        got = {}
        for kind, Z in (("np", Y), ("t", torch.from_numpy(Y))):
            out = got[kind] = np.empty((Y.shape[1], Y.shape[0]), np.float32)
            K.for_sorted_columns(Z, lambda sl, Tb, out=out: out.__setitem__(sl, np.asarray(Tb)), sc)
        np.testing.assert_array_equal(got["t"], got["np"])


def test_row_stats_of_rows_beyond_float32_squares(blocks):
    """Rows whose float32 squares or products overflow get numpy's finite float64 figures; rows
    holding NaN or an infinity stay non-finite, as numpy's do."""
    rng = np.random.default_rng(9)
    X = rng.normal(size=(5, 3001)).astype(np.float32)
    X[1] *= np.float32(1e25)  # squares beyond float32's 3.4e38, norm 5.5e26
    X[2, 7] = np.float32(3e38)
    X[3, 0] = np.nan
    X[4, 9] = -np.inf
    R = rng.normal(size=(2, 3001)) * np.array([[1.0], [1e20]])  # products of row 1 with R[1] overflow
    sq_np, dots_np = K.row_stats(X, R)
    sq_t, dots_t = K.row_stats(torch.from_numpy(X), R)
    np.testing.assert_array_equal(np.isfinite(sq_t), [True, True, True, False, False])
    np.testing.assert_array_equal(np.isnan(sq_t), np.isnan(sq_np))
    np.testing.assert_allclose(sq_t[:3], sq_np[:3], rtol=1e-6)
    np.testing.assert_allclose(dots_t[:3], dots_np[:3], rtol=1e-5, atol=1e-5 * np.abs(dots_np[:3]).max())


def test_sqdist_to_from_differences(blocks):
    """The tensor path's distances to a vector or a row agree with the host's, both from the
    differences, to float32 rounding of the block norms; a row that overflows float32's squares
    gets finite figures on both (taken again in float64)."""
    X = rows(9, d=3000, seed=11)
    v = np.random.default_rng(11).normal(size=3000)
    T = torch.from_numpy(X)
    for kw in ({"v": v}, {"idx": 3}):
        host, dev = K.sqdist_to(X, **kw), K.sqdist_to(T, **kw)
        np.testing.assert_allclose(dev, host, rtol=1e-5)
    assert K.sqdist_to(T, idx=3)[3] == 0.0
    X[5] *= np.float32(1e25)  # float32 products overflow
    d2 = K.sqdist_to(torch.from_numpy(X), idx=0)
    host = K.sqdist_to(X, idx=0)
    assert np.isfinite(d2).all() and d2[5] > 1e50 and np.isfinite(host).all()
    np.testing.assert_allclose(d2, host, rtol=1e-5)
    assert np.argsort(d2, kind="stable").tolist() == np.argsort(host, kind="stable").tolist()
    with pytest.raises(ValueError, match="not both or neither"):
        K.sqdist_to(T)


def test_importing_the_rules_does_not_import_torch():
    code = "import sys, fedring.aggregators as a; a.make_aggregator('krum', 1, {}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
