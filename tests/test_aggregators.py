"""Robust aggregation rules: hand-computed vectors, convention variants, properties, errors."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest

import fedring.aggregators as agg
from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, make_aggregator
from fedring.aggregators._kernels import abs_row_quantiles, gram, sign_gram
from fedring.aggregators.copod import copod_scores
from fedring.aggregators.krum import krum_scores
from fedring.aggregators.probe import LinearProbe
from fedring.errors import ConfigError

BYZFL = np.array([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])  # ByzFL's unit-test matrix
FEDLIB = np.array([[1.0, 2, 3], [-1, 4, -1], [2, 2, 3], [3, 1, 3]])  # fedlib's unit-test matrix, even n
SCALARS = np.array([[0.0], [1], [2], [3], [100]])  # one outlier among scalars
REF = np.array([1.0, -1, 2])


def run(name, X, f=0, reference=None, rng=None, **params):
    return make_aggregator(name, f, params).aggregate(np.asarray(X, float), reference=reference, rng=rng)


def vec(name, X, f=0, **params):
    return run(name, X, f, **params).vector


# --------------------------------------------------------------------------------------
# docstring examples are test vectors too
# --------------------------------------------------------------------------------------


def test_docstring_examples():
    for m in pkgutil.iter_modules(agg.__path__):
        mod = importlib.import_module(f"fedring.aggregators.{m.name}")
        result = doctest.testmod(mod, extraglobs={"np": np}, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, m.name


# --------------------------------------------------------------------------------------
# coordinate-wise rules
# --------------------------------------------------------------------------------------


def test_mean():
    np.testing.assert_array_equal(vec("mean", BYZFL), [4, 5, 6])
    np.testing.assert_array_equal(vec("mean", FEDLIB), [1.25, 2.25, 2.0])


def test_median_odd_and_even():
    np.testing.assert_array_equal(vec("median", BYZFL), [4, 5, 6])
    np.testing.assert_array_equal(vec("median", SCALARS), [2])
    # even n: columns sorted (-1,1,2,3), (1,2,2,4), (-1,3,3,3)
    np.testing.assert_array_equal(vec("median", FEDLIB), [1.5, 2, 3])
    np.testing.assert_array_equal(vec("median", FEDLIB, variant="lower"), [1, 2, 3])


def test_trimmed_mean_per_side_and_fraction():
    np.testing.assert_array_equal(vec("trimmed_mean", BYZFL, f=1), [4, 5, 6])
    np.testing.assert_array_equal(vec("trimmed_mean", FEDLIB, f=1), [1.5, 2, 3])
    np.testing.assert_array_equal(vec("trimmed_mean", SCALARS, f=1), [2])  # mean(1, 2, 3)
    np.testing.assert_array_equal(vec("trimmed_mean", SCALARS, trim=2), [2])
    np.testing.assert_array_equal(vec("trimmed_mean", SCALARS, fraction=0.2), [2])  # floor(0.2*5) = 1
    six = np.array([[0.0], [1], [2], [4], [8], [100]])
    np.testing.assert_array_equal(vec("trimmed_mean", six, fraction=0.2), [3.75])  # drop 0 and 100
    np.testing.assert_array_equal(vec("trimmed_mean", six, fraction=0.34), [3.0])  # floor(2.04) = 2 per side
    np.testing.assert_array_equal(vec("trimmed_mean", FEDLIB, f=0), [1.25, 2.25, 2.0])


# --------------------------------------------------------------------------------------
# Krum family
# --------------------------------------------------------------------------------------

# Seven 2-D points where the four Krum conventions pick four different clients (f = 1).
# Squared distances (row 4): 85 53 10 2 0 16 13. Paper (4 smallest): row 4 = 2+10+13+16 = 41,
# the minimum (row 2: 4+10+17+17 = 48, row 3: 2+4+17+26 = 49). ByzFL (5 smallest): row 2 = 82
# (row 3: 86, row 6: 86, row 4: 94). Plain distances, 5 smallest: row 3 = 18.72 (row 2:
# 19.24); plain, 6 smallest (all): row 6 = 26.99 (row 2: 27.30).
KRUM_CONVENTIONS = np.array([[2.0, 7], [10, 7], [9, 3], [9, 1], [8, 0], [4, 0], [5, 2]])


@pytest.mark.parametrize("variant,chosen", [("paper", 4), ("byzfl", 2), ("flpoison", 3), ("fedml", 6)])
def test_krum_conventions_pick_different_clients(variant, chosen):
    res = run("krum", KRUM_CONVENTIONS, f=1, variant=variant)
    np.testing.assert_array_equal(res.vector, KRUM_CONVENTIONS[chosen])
    np.testing.assert_array_equal(res.selected, np.eye(7)[chosen])


def test_krum_fedml_with_f_0_sums_the_n_minus_1_other_rows():
    # FedML's convention asks for n - f = n neighbours; only n - 1 exist. Plain distances of
    # row 4 to the others: 140.86 + 0.1414 + 0.1 + 0.1 = 141.24, the smallest (row 1: 141.76).
    X = np.array([[100, 100], [0, 0], [0.1, 0], [0, 0.1], [0.1, 0.1]])
    res = run("krum", X, f=0, variant="fedml")
    np.testing.assert_array_equal(res.selected, np.eye(5)[4])
    assert np.isfinite(krum_scores(gram(X).sqdist(), 0, "fedml")).all()


def test_krum_scores_hand_computed():
    D2 = gram(KRUM_CONVENTIONS).sqdist()
    np.testing.assert_array_equal(D2[4], [85, 53, 10, 2, 0, 16, 13])
    np.testing.assert_array_equal(krum_scores(D2, 1, "paper"), [216, 157, 48, 49, 41, 81, 52])
    np.testing.assert_array_equal(krum_scores(D2, 1, "byzfl"), [301, 221, 82, 86, 94, 134, 86])


def test_krum_vectors():
    np.testing.assert_array_equal(vec("krum", BYZFL, f=1, variant="byzfl"), [1, 2, 3])
    # P11: scores (5, 2, 2, 5, 19013); the tie between clients 1 and 2 goes to the lower index
    res = run("krum", SCALARS, f=1)
    np.testing.assert_array_equal(res.vector, [1])
    np.testing.assert_array_equal(krum_scores(gram(SCALARS).sqdist(), 1, "paper"), [5, 2, 2, 5, 9409 + 9604])


def test_multikrum():
    np.testing.assert_array_equal(vec("multikrum", BYZFL, f=1, variant="byzfl"), [2.5, 3.5, 4.5])
    # paper scores (5, 2, 2, 5, 19013): m = n - f = 4 keeps 0..3
    res = run("multikrum", SCALARS, f=1)
    np.testing.assert_array_equal(res.vector, [1.5])
    np.testing.assert_array_equal(res.selected, [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(vec("multikrum", SCALARS, f=1, m=2), [1.5])  # clients 1 and 2
    np.testing.assert_array_equal(vec("multikrum", KRUM_CONVENTIONS, f=1, m=2), [8.5, 1.5])  # scores 41, 48


def test_bulyan():
    X = np.array([[0.0], [1], [2], [3], [100], [4], [5]])
    res = run("bulyan", X, f=1)
    # recursive Krum picks the values 2, 3, 1, 4, 0; beta = 3 values closest to their median 2: (1, 2, 3)
    np.testing.assert_array_equal(res.vector, [2])
    np.testing.assert_array_equal(res.selected, [1, 1, 1, 1, 0, 1, 0])
    Y = np.array([[0.0, 10], [1, 11], [2, 13], [3, 12], [100, -100], [4, 14], [5, 15]])
    np.testing.assert_array_equal(vec("bulyan", Y, f=1), [2, 12])  # second column: (11, 12, 13) around 12


# --------------------------------------------------------------------------------------
# Weiszfeld-type centres
# --------------------------------------------------------------------------------------


def test_geomed_byzfl_vector_and_median_of_scalars():
    v = vec("geomed", BYZFL, iters=3, tol=0, nu=0.1, init="zero")
    np.testing.assert_allclose(v, [3.78788764, 4.78788764, 5.78788764], rtol=1e-8)
    # in one dimension the geometric median is the median
    np.testing.assert_allclose(
        vec("geomed", np.array([[0.0], [1], [10]]), iters=500, tol=1e-12, nu=1e-12), [1.0], atol=1e-6
    )
    # square corners: the centre, reached at once from the mean
    np.testing.assert_allclose(vec("geomed", np.array([[0.0, 0], [2, 0], [0, 2], [2, 2]])), [1, 1])


def test_geomed_weiszfeld_optimality_condition():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(9, 5))
    X[:2] += 50.0
    z = vec("geomed", X, iters=2000, tol=1e-13, nu=1e-12)
    U = (X - z) / np.linalg.norm(X - z, axis=1, keepdims=True)
    assert np.linalg.norm(U.sum(axis=0)) < 1e-6


def test_huber():
    np.testing.assert_allclose(vec("huber", BYZFL, tau=100.0), [4, 5, 6], rtol=1e-12)
    # scalars 0, 1, 10 with tau = 1: psi(v) + psi(v - 1) + psi(v - 10) = v + (v - 1) - 1 = 0 at v = 1
    np.testing.assert_allclose(
        vec("huber", np.array([[0.0], [1], [10]]), tau=1.0, iters=1000, tol=1e-13), [1.0], atol=1e-9
    )


def test_mca():
    np.testing.assert_allclose(vec("mca", BYZFL, sigma=1e6), [4, 5, 6], rtol=1e-9)
    # sigma = 1: the outlier at 10 has weight exp(-45) -> the centre of 0 and 1
    np.testing.assert_allclose(
        vec("mca", np.array([[0.0], [1], [10]]), sigma=1.0, tol=1e-13, iters=1000), [0.5], atol=1e-12
    )
    # default width: median distance to the medoid, here 1 (clients 0..3 around 1.5)
    res = run("mca", np.array([[0.0], [1], [2], [3], [1000]]))
    assert res.selected[4] < 1e-100 and abs(res.vector[0] - 1.5) < 1e-4


def test_cclip_plain_and_state():
    X = np.array([[3.0, 4], [0, 0.5]])
    a = make_aggregator("cclip", 0, {"tau": 1.0, "iters": 1})
    st = a.init_state(2, 2)
    res = a.aggregate(X, state=st)
    # distances from 0: 5 and 0.5 -> factors 0.2 and 1: v = ((0.6, 0.8) + (0, 0.5)) / 2
    np.testing.assert_allclose(res.vector, [0.3, 0.65])
    np.testing.assert_allclose(res.selected, [0.2, 1.0])
    np.testing.assert_allclose(st["center"], [0.3, 0.65])
    # second round starts from the previous aggregate: diffs (2.7, 3.35) and (-0.3, -0.15)
    res2 = a.aggregate(X, state=st)
    d1 = np.array([2.7, 3.35])
    np.testing.assert_allclose(res2.vector, [0.3, 0.65] + 0.5 * (d1 / np.linalg.norm(d1) + [-0.3, -0.15]))


def test_cclip_bucketing():
    X = np.array([[3.0, 4], [0, 0.5]])
    # one bucket of both clients: its mean (1.5, 2.25) clipped to norm 1 from 0
    m = np.array([1.5, 2.25])
    np.testing.assert_allclose(vec("cclip", X, tau=1.0, bucketing="random", bucket_size=2), m / np.linalg.norm(m))
    # sequential, first round: identity order, groups {0}, {1}, one bucket {0, 1}: = CClip_1
    np.testing.assert_allclose(vec("cclip", X, tau=1.0, bucketing="sequential"), [0.3, 0.65])


def test_cclip_sequential_orders_by_cosine():
    # previous aggregate e1; cosines (1, 0, -1, 0) sort the clients as (2, 1, 3, 0); S = 2 groups
    # {2, 1} and {3, 0} (each shuffled), bucket r = the r-th member of each group. With a huge
    # radius every bucket step moves to the bucket mean, so the output is the last bucket's mean:
    # one of {1, 2} with one of {0, 3}. Identity order would pair one of {0, 1} with one of {2, 3}.
    X = np.array([[2.0, 0], [0, 3], [-1, 0], [0, -5]])
    by_cosine = {(i, j): (X[i] + X[j]) / 2 for i in (1, 2) for j in (0, 3)}
    seen = set()
    for seed in range(8):
        a = make_aggregator("cclip", 0, {"tau": 1e9, "bucketing": "sequential"})
        out = a.aggregate(X, state={"center": np.array([1.0, 0.0])}, rng=np.random.default_rng(seed)).vector
        hits = [k for k, v in by_cosine.items() if np.allclose(out, v)]
        assert len(hits) == 1
        seen.add(hits[0])
    assert seen & {(1, 0), (2, 3)}  # pairs impossible under identity order


# --------------------------------------------------------------------------------------
# outlier detection and sign rules
# --------------------------------------------------------------------------------------


def test_copod_scores_hand_computed():
    # one feature (0, 1, 5): U_l = (ln 3, ln 1.5, 0), U_r = (0, ln 1.5, ln 3), positive skew -> U_r
    np.testing.assert_allclose(copod_scores(np.array([[0.0], [1], [5]])), [0.5 * np.log(3), np.log(1.5), np.log(3)])


def test_copod_dos_weights_against_direct_distances():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(6, 4))
    X[5] *= 20
    res = run("copod", X)
    norms = np.linalg.norm(X, axis=1)
    MS = 1 - (X @ X.T) / np.outer(norms, norms)
    ME = np.linalg.norm(X[:, None] - X[None], axis=2)
    r = (copod_scores(MS) + copod_scores(ME)) / 2
    lam = np.exp(-r) / np.exp(-r).sum()
    np.testing.assert_allclose(res.vector, lam @ X, rtol=1e-9)
    np.testing.assert_allclose(res.selected, lam / lam.max(), rtol=1e-9)
    assert res.selected.argmin() == 5
    lam2 = np.exp(-2 * r) / np.exp(-2 * r).sum()
    np.testing.assert_allclose(vec("copod", X, variant="code"), lam2 @ X, rtol=1e-9)


def test_ties():
    X = np.array([[1.0, -2, 3], [2, 2, -1], [4, -1, 1]])
    # gamma = 0: each client drops the coordinates at its minimum magnitude 1
    # V = [[0,-2,3],[2,2,0],[4,0,0]], u = (+,-,+): col0 mean(2,4), col1 -2, col2 3
    np.testing.assert_array_equal(vec("ties", X, gamma=0.0), [3, -2, 3])
    # gamma = 0.5 on 4 coordinates: quantile = midpoint of the 2nd and 3rd magnitudes
    Y = np.array([[4.0, -1, 2, 1], [2, -2, 1, -1], [-8, 1, -1, 2]])
    # V = [[4,0,2,0],[2,-2,0,0],[-8,0,0,2]] (strict >, quantiles 1.5, 1.5, 1.5)
    # sign election u = (+, -, +, +); col0 mean(4, 2); col1 -2; col2 2; col3 2
    np.testing.assert_array_equal(vec("ties", Y, gamma=0.5), [3, -2, 2, 2])
    # magnitude election (code): col0 sum 4+2-8 = -2 -> "-": -8
    np.testing.assert_array_equal(vec("ties", Y, gamma=0.5, election="magnitude"), [-8, -2, 2, 2])


def test_signsgd_and_rlr():
    X = np.array([[1.0, -2, 3, 1], [2, 2, -1, 1], [-4, 1, 0, 1], [3, 5, 0, -1]])  # S = (2, 2, 0, 2)
    np.testing.assert_array_equal(vec("signsgd", X), [1, 1, 0, 1])
    np.testing.assert_array_equal(vec("rlr", X, theta=2), [1, 1, 0, 1])
    np.testing.assert_array_equal(vec("rlr", X, theta=3), [-1, -1, 0, -1])
    np.testing.assert_array_equal(vec("rlr", X), [1, 1, 0, 1])  # theta = ceil(0.2 * 4) = 1
    # BRACE P10: theta > n reverses signSGD; sign rules ignore magnitudes
    np.testing.assert_array_equal(vec("rlr", X, theta=5), -vec("signsgd", X) + 0.0)
    np.testing.assert_array_equal(vec("signsgd", X * [[1, 100, 3, 7]]), vec("signsgd", X))


def test_fltrust_and_zenopp():
    X = np.array([[3.0, 4], [-3, -4], [0, 10]])
    ref = np.array([0.0, 1])
    res = run("fltrust", X, reference=ref)
    np.testing.assert_allclose(res.vector, [0.48 / 1.8, 1.64 / 1.8])  # (0.8*(0.6,0.8) + (0,1)) / 1.8
    np.testing.assert_allclose(res.selected, [0.8, 0, 1])
    res = run("zenopp", X, reference=ref)
    np.testing.assert_allclose(res.vector, [0.3, 0.9])  # scores 0.799, -0.801, 0.999 vs -0.1
    np.testing.assert_array_equal(res.selected, [1, 0, 1])
    # nothing trusted or accepted -> no step
    np.testing.assert_array_equal(vec("fltrust", X[1:2], reference=np.array([3.0, 4])), [0, 0])
    assert run("zenopp", X[1:2], reference=np.array([3.0, 4])).selected.sum() == 0
    with pytest.raises(ValueError, match="reference"):
        run("fltrust", X)


# --------------------------------------------------------------------------------------
# pre-aggregators and composition
# --------------------------------------------------------------------------------------


def test_preaggregators():
    Y, owner = PRE_AGGREGATORS["nnm"](1).transform(BYZFL, None)
    np.testing.assert_array_equal(Y, [[2.5, 3.5, 4.5], [2.5, 3.5, 4.5], [5.5, 6.5, 7.5]])
    Y, _ = PRE_AGGREGATORS["clipping"](0, c=2.0).transform(BYZFL, None)
    np.testing.assert_allclose(
        Y,
        [
            [0.53452248, 1.06904497, 1.60356745],
            [0.91168461, 1.13960576, 1.36752692],
            [1.00514142, 1.14873305, 1.29232469],
        ],
    )
    Y, owner = PRE_AGGREGATORS["bucketing"](0, s=2).transform(FEDLIB, np.random.default_rng(0))
    assert Y.shape == (2, 3)
    for b in range(2):
        np.testing.assert_allclose(Y[b], FEDLIB[owner == b].mean(axis=0))
    np.testing.assert_allclose(Y.mean(axis=0), FEDLIB.mean(axis=0))


def test_pipeline_composition_and_selected_mapping():
    np.testing.assert_array_equal(make_aggregator("mean", 1, {}, pre=["nnm"])(BYZFL), [3.5, 4.5, 5.5])
    a = make_aggregator("krum", 0, {"variant": "byzfl"}, ["clipping", "bucketing"], {"bucketing": {"s": 2}})
    assert a.name == "clipping+bucketing+krum"
    res = a.aggregate(FEDLIB, rng=np.random.default_rng(1))
    assert res.selected.shape == (4,) and res.selected.sum() == 2  # the chosen bucket's two clients
    assert a.check(4) is None
    assert "krum (byzfl variant) sums n - f - 1 = 0 neighbours" in a.check(2)  # 2 clients -> 1 bucket


# --------------------------------------------------------------------------------------
# configuration errors and check() messages
# --------------------------------------------------------------------------------------


def test_config_errors_name_the_setting():
    with pytest.raises(
        ConfigError, match=r"aggregator: unknown aggregator 'krumm'; did you mean 'krum'\? allowed: .*krum"
    ):
        make_aggregator("krumm", 1, {})
    with pytest.raises(
        ConfigError,
        match=r"krum\.varient: unknown parameter of aggregator krum; did you mean 'variant'\? allowed: variant",
    ):
        make_aggregator("krum", 1, {"varient": "paper"})
    with pytest.raises(
        ConfigError, match=r"krum\.variant: 'squared' is not allowed; allowed: paper, byzfl, flpoison, fedml"
    ):
        make_aggregator("krum", 1, {"variant": "squared"})
    with pytest.raises(ConfigError, match=r"trimmed_mean\.fraction: must be in \[0.0, 0.5\), got 0.5"):
        make_aggregator("trimmed_mean", 1, {"fraction": 0.5})
    with pytest.raises(ConfigError, match="either trim"):
        make_aggregator("trimmed_mean", 1, {"trim": 1, "fraction": 0.1})
    with pytest.raises(ConfigError, match="pre_aggregators: unknown pre-aggregator 'nmm'; did you mean 'nnm'"):
        make_aggregator("mean", 1, {}, pre=["nmm"])
    with pytest.raises(ConfigError, match=r"bucketing\.s: must be >= 1"):
        make_aggregator("mean", 1, {}, ["bucketing"], {"bucketing": {"s": 0}})
    with pytest.raises(ConfigError, match=r"hplus\.base: 'hplus' is not allowed"):
        make_aggregator("hplus", 1, {"base": "hplus"})
    with pytest.raises(ConfigError, match=r"krum\.variant"):
        make_aggregator("hplus", 1, {"base": "krum"}, sections={"krum": {"variant": "nope"}})
    with pytest.raises(ConfigError, match=r"^f: must be >= 0"):
        make_aggregator("median", -1, {})
    with pytest.raises(ConfigError, match=r"geomed\.iters: must be an integer"):
        make_aggregator("geomed", 0, {"iters": 2.5})


def test_check_messages():
    assert make_aggregator("krum", 2, {}).check(6) == (
        "krum needs n > 2f + 2 (Blanchard et al.), got n=6, f=2: use at least 7 clients or a smaller f"
    )
    assert make_aggregator("krum", 2, {}).check(7) is None
    assert make_aggregator("krum", 1, {"variant": "byzfl"}).check(3) is None
    assert "2f < n" in make_aggregator("krum", 2, {"variant": "byzfl"}).check(4)
    assert "n >= 4f + 3" in make_aggregator("bulyan", 2, {}).check(10)
    assert make_aggregator("bulyan", 2, {}).check(11) is None
    assert "leaves nothing" in make_aggregator("trimmed_mean", 2, {}).check(4)
    assert "m=5" in make_aggregator("multikrum", 0, {"m": 5}).check(4)
    assert "N=0" in make_aggregator("hplus", 4, {}).check(4)
    assert "base rule of hplus: krum needs" in make_aggregator("hplus", 2, {"base": "krum"}).check(6)
    assert "n >= 2" in make_aggregator("fldetector", 0, {}).check(1)
    for name in AGGREGATORS:
        assert make_aggregator(name, 0, {}).check(0) is not None
    with pytest.raises(ValueError, match="krum needs n > 2f"):
        make_aggregator("krum", 2, {}).aggregate(np.ones((5, 3)))


def test_bad_input_shapes():
    with pytest.raises(ValueError, match=r"\(n, d\) matrix"):
        make_aggregator("mean", 0, {}).aggregate(np.ones(3))
    with pytest.raises(ValueError, match="reference must have shape"):
        make_aggregator("fltrust", 0, {}).aggregate(np.ones((3, 2)), reference=np.ones(3))


# --------------------------------------------------------------------------------------
# properties over every rule
# --------------------------------------------------------------------------------------

DETERMINISTIC = [
    ("mean", {}),
    ("median", {}),
    ("trimmed_mean", {}),
    ("krum", {}),
    ("multikrum", {}),
    ("bulyan", {}),
    ("geomed", {}),
    ("huber", {}),
    ("mca", {}),
    ("cclip", {}),
    ("copod", {}),
    ("ties", {}),
    ("signsgd", {}),
    ("rlr", {}),
    ("fltrust", {}),
    ("zenopp", {}),
    ("fedseca", {}),
    ("hplus", {"K": 1, "r": 1000}),  # one segment covering every coordinate: no randomness
]


@pytest.mark.parametrize("name,params", DETERMINISTIC)
def test_permutation_invariance(name, params):
    rng = np.random.default_rng(11)
    X = rng.normal(size=(11, 7))
    X[:2] *= 30
    ref = rng.normal(size=7)
    perm = rng.permutation(11)
    a = make_aggregator(name, 2, params)
    r1 = a.aggregate(X, reference=ref)
    r2 = a.aggregate(X[perm], reference=ref)
    np.testing.assert_allclose(r1.vector, r2.vector, rtol=1e-9, atol=1e-12)
    if r1.selected is not None:
        np.testing.assert_allclose(r1.selected[perm], r2.selected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "name", ["mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan", "geomed", "huber", "mca"]
)
def test_translation_equivariance(name):
    rng = np.random.default_rng(12)
    X = rng.normal(size=(11, 6))
    c = rng.normal(size=6) * 10
    a = make_aggregator(name, 2, {})
    np.testing.assert_allclose(a(X + c), a(X) + c, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum", "multikrum", "bulyan"])
def test_stays_in_honest_range_under_huge_outliers(name):
    rng = np.random.default_rng(13)
    honest = rng.normal(size=(9, 5))
    bad = np.array([[1e9, -1e9, 1e9, 1e9, -1e9], [-1e9, 1e9, 1e9, -1e9, 1e9]])
    X = np.vstack([honest[:4], bad, honest[4:]])
    out = make_aggregator(name, 2, {})(X)
    assert np.all(out >= honest.min(axis=0)) and np.all(out <= honest.max(axis=0))
    if name == "krum":
        assert any(np.array_equal(out, h) for h in honest)


def probe_for(rule, d):
    """A probe of a softmax regression with 2 classes (d even) for a rule that inspects the model (DeepSight)."""
    return LinearProbe(np.zeros(d), 0.1, (d // 2 - 1,)) if rule.needs_probe else None


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_float32_in_float32_out(name):
    rng = np.random.default_rng(14)
    X = rng.normal(size=(9, 40)).astype(np.float32)
    a = make_aggregator(name, 1, {})
    X64 = X.astype(np.float64)
    ref = X64.mean(axis=0)
    probe = probe_for(a, 40)
    out32 = a.aggregate(X, reference=ref, rng=np.random.default_rng(0), probe=probe).vector
    out64 = make_aggregator(name, 1, {}).aggregate(X64, reference=ref, rng=np.random.default_rng(0), probe=probe).vector
    assert out32.dtype == np.float32 and out64.dtype == np.float64 and out32.shape == (40,)
    np.testing.assert_allclose(out32, out64, rtol=2e-4, atol=2e-5)


def test_same_rng_same_result():
    X = np.random.default_rng(15).normal(size=(10, 30))
    for name, params in [("hplus", {}), ("cclip", {"bucketing": "random"}), ("mean", {})]:
        a = make_aggregator(name, 2, params, pre=["bucketing"] if name == "mean" else ())
        outs = [a.aggregate(X, rng=np.random.default_rng(7)).vector for _ in range(2)]
        np.testing.assert_array_equal(*outs)


# --------------------------------------------------------------------------------------
# kernels against direct computations
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_gram_distances_match_direct_even_with_huge_rows(dtype, rtol):
    rng = np.random.default_rng(16)
    X = rng.normal(size=(8, 30000)).astype(dtype)
    X[6] *= 1e6
    D2 = gram(X).sqdist()
    X64 = X.astype(np.float64)
    direct = ((X64[:, None] - X64[None]) ** 2).sum(axis=2)
    # pivoting keeps nearby (honest) pairs accurate relative to their own distance, not to 1e12
    np.testing.assert_allclose(D2[:6, :6], direct[:6, :6], rtol=rtol)
    np.testing.assert_allclose(D2, direct, rtol=rtol)
    # integer inputs give integer-exact distances in either precision
    Z = rng.integers(-50, 50, size=(5, 1000)).astype(dtype)
    Z64 = Z.astype(np.float64)
    np.testing.assert_array_equal(gram(Z).sqdist(), ((Z64[:, None] - Z64[None]) ** 2).sum(axis=2))


def test_abs_row_quantiles_and_sign_gram():
    rng = np.random.default_rng(17)
    X = rng.normal(size=(4, 1001))
    for q in (0.0, 0.3, 0.9, 0.999, 1.0):
        np.testing.assert_array_equal(abs_row_quantiles(X, q), [np.quantile(np.abs(x), q) for x in X])
    X[0, :10] = 0
    S = np.sign(X)
    np.testing.assert_array_equal(sign_gram(X), (S @ S.T).astype(np.int64))


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_three_rounds_like_the_training_loop(name):
    """State, rng and reference as the loop passes them; honest clients drive a quadratic down."""
    rng = np.random.default_rng(18)
    n, d, f = 11, 50, 2
    target = rng.normal(size=d)
    w = np.zeros(d, np.float32)
    a = make_aggregator(name, f, {"theta": 1} if name == "rlr" else {}, pre=["clipping"] if name == "mean" else ())
    assert a.check(n) is None
    state = a.init_state(n, d)
    shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
    loss0 = np.linalg.norm(w - target)
    for t in range(3):
        G = (w - target) + 0.01 * rng.normal(size=(n, d))
        G[:f] = -10 * (w - target)  # Byzantine clients push uphill
        G = G.astype(np.float32)
        ref = (w - target).astype(np.float32)
        res = a.aggregate(G, state=state, reference=ref, rng=np.random.default_rng([5, t]), probe=probe_for(a, d))
        assert res.vector.shape == (d,) and res.vector.dtype == np.float32 and np.all(np.isfinite(res.vector))
        assert res.selected is None or (
            res.selected.shape == (n,) and np.all((res.selected >= 0) & (res.selected <= 1))
        )
        w = w - 0.1 * res.vector
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == shapes
    # every rule but four makes progress despite the attackers: cclip's default radius 100 exceeds
    # these distances (it is the mean here) and FL-Detector averages everyone until it has a window;
    # CRFL clips the mean (uphill here), not the uploads, and SimpleClustering's DBSCAN radius 0.05
    # is below the honest clients' spread (about 0.1), so every client is noise and nothing moves
    if name in ("cclip", "fldetector"):
        assert np.linalg.norm(w - target) > loss0
    elif name in ("crfl", "simpleclustering"):
        assert np.linalg.norm(w - target) >= loss0
    else:
        assert np.linalg.norm(w - target) < 0.95 * loss0
