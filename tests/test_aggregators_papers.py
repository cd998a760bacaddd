"""FedSECA, H+ and FL-Detector: hand-computed vectors, the papers' switches, derived properties."""

from __future__ import annotations

import numpy as np
import pytest

from fedring.aggregators import make_aggregator
from fedring.aggregators.fedseca import ABLATIONS
from fedring.aggregators.fldetector import (
    FLDetector,
    gap_statistic_k,
    kmeans_1d,
    lbfgs_coefficients,
)
from fedring.aggregators.hplus import anomaly_scores, similarity_h
from fedring.errors import ConfigError

# K = 3, D = 4. Signs: g1 (+,-,+,+), g2 (+,-,+,-), g3 (-,+,-,+).
# omega: (1,2) = 2/4 > 0, (1,3) = -2/4 < 0, (2,3) = -4/4 < 0  ->  rho = (1/3, 1/3, 0)      (Eqs. 4-5)
# election s = sgn(s1 + s2) = (+, -, +, 0)                                                  (Eq. 6)
# norms sqrt(22), sqrt(10), sqrt(70): tau = sqrt(22), g3 scaled by sqrt(22/70)             (Eq. 8)
# mu = column medians of |clipped| = (4, 1, 1, 1); clamp raw: g1 (4,-1,1,1), g2 (2,-1,1,-1), g3 (-4,1,-1,1)
# gamma = 0.5: quantile of 4 magnitudes = mean of the 2nd and 3rd = 1.5 for every client; keep |g| >= 1.5:
#   g1'' = (4,0,1,0), g2'' = (2,-1,0,0), g3'' = (-4,0,0,1)                                 (Eqs. 9-10)
# sign-aligned means: (mean(4,2), -1, 1, 0) = (3, -1, 1, 0); momentum 0.5 -> (1.5, -0.5, 0.5, 0)
G3 = np.array([[4.0, -1, 2, 1], [2, -2, 1, -1], [-8, 1, -1, 2]])


def fedseca(X, state=None, **params):
    return make_aggregator("fedseca", 0, {"gamma": 0.5, **params}).aggregate(np.asarray(X, float), state=state)


def test_fedseca_hand_computed():
    res = fedseca(G3)
    np.testing.assert_array_equal(res.vector, [1.5, -0.5, 0.5, 0])
    np.testing.assert_allclose(res.selected, [1 / 3, 1 / 3, 0])


def test_fedseca_momentum_state():
    a = make_aggregator("fedseca", 0, {"gamma": 0.5})
    st = a.init_state(3, 4)
    a.aggregate(G3, state=st)
    np.testing.assert_array_equal(a.aggregate(G3, state=st).vector, [2.25, -0.75, 0.75, 0])  # 0.5*1.5 + 0.5*3
    np.testing.assert_array_equal(st["momentum"], [2.25, -0.75, 0.75, 0])


@pytest.mark.parametrize(
    "ablation,expected",
    [
        ("no_momentum", [3, -1, 1, 0]),
        ("no_rho", [1.5, -0.5, 0.5, 0.5]),  # unweighted vote: s = (+,-,+,+), col3: g3'' = 1 agrees
        ("no_coordwise", [1.5, -0.25, 0.25, 0]),  # rho-weighted mean (g1'' + g2'')/2 = (3,-0.5,0.5,0)
        ("no_crise", [1 / 3, -1 / 6, 1 / 6, 1 / 6]),  # plain mean of the VRS gradients (2,-1,1,1)/3
        ("no_vrs", [1.5, -0.75, 0.75, 0]),  # sign-aligned mean of raw g: (3, -1.5, 1.5, 0)
        ("no_sparsification", [1.5, -0.5, 0.5, 0]),  # clamped g: (mean(4,2), -1, mean(1,1), 0)
        ("no_clip", [1.5, -0.5, 0.5, 0]),  # mu from raw magnitudes: (4, 1, 1, 1) again
        ("no_clamp", [1.5, -1.0, 1.0, 0]),  # raw values survive: (3, -2, 2, 0)
        ("no_clip_clamp", [1.5, -1.0, 1.0, 0]),
    ],
)
def test_fedseca_table1_rows(ablation, expected):
    np.testing.assert_allclose(fedseca(G3, ablation=ablation).vector, expected, rtol=1e-12)


def test_fedseca_ablation_presets_and_overrides():
    a = make_aggregator("fedseca", 0, {"ablation": "no_clip_clamp"})
    assert (a.clip, a.clamp, a.rho, a.gamma, a.beta) == (False, False, True, 0.9, 0.5)
    a = make_aggregator("fedseca", 0, {"ablation": "no_sparsification", "gamma": 0.5})
    assert a.gamma == 0.5
    assert set(ABLATIONS) == {
        "full", "no_rho", "no_coordwise", "no_crise", "no_vrs", "no_sparsification",
        "no_clip_clamp", "no_clip", "no_clamp", "no_momentum",
    }  # fmt: skip


def test_fedseca_clamp_source_switch():
    # norms sqrt(8), sqrt(2), sqrt(901): tau = sqrt(8) scales g3 by sqrt(8/901) -> (2.83, 0.094);
    # mu = (2, 1). Algorithm 1 clamps raw g3 to (2, 1); Eq. 9 clamps the clipped (2, 0.094).
    X = np.array([[2.0, 2], [1, 1], [30, 1]])
    np.testing.assert_allclose(fedseca(X, gamma=0.0, beta=0.0).vector, [5 / 3, 1.0])
    np.testing.assert_allclose(
        fedseca(X, gamma=0.0, beta=0.0, clamp_source="clipped").vector, [5 / 3, (2 + np.sqrt(8 / 901)) / 3]
    )


def test_fedseca_election_source_switch():
    # rho ablated; gamma = 0.5 keeps coordinate 1 of clients 0, 1 and coordinate 0 of client 2:
    # VRS gradients (0,4), (0,4), (-1,0) after clamping to mu = (1, 4). Raw signs elect + on
    # coordinate 0 (nobody agrees -> 0); the VRS signs elect - (client 2 agrees -> -1).
    X = np.array([[1.0, 4], [1, 4], [-4, 1]])
    np.testing.assert_array_equal(fedseca(X, beta=0.0, rho=False).vector, [0, 4])
    np.testing.assert_array_equal(fedseca(X, beta=0.0, rho=False, election_source="vrs").vector, [-1, 4])


def test_fedseca_sparsify_and_median_switches():
    X = np.array([[1.0, 2, 3, 4], [1, 2, 3, 4]])
    # gamma = 0.5: quantile 2.5, no ties, both comparisons agree; gamma = 1/3: quantile exactly 2
    np.testing.assert_array_equal(fedseca(X, gamma=1 / 3, beta=0.0).vector, [0, 2, 3, 4])
    np.testing.assert_array_equal(fedseca(X, gamma=1 / 3, beta=0.0, sparsify=">").vector, [0, 0, 3, 4])
    # even K = 4, mu of column 0 = lower median of (1, 2, 3, 4) = 2, average median 2.5
    Y = np.array([[1.0, 1], [2, 1], [3, 1], [4, 1]])
    np.testing.assert_allclose(fedseca(Y, gamma=0.0, beta=0.0, clip=False).vector, [(1 + 2 + 2 + 2) / 4, 1])
    np.testing.assert_allclose(
        fedseca(Y, gamma=0.0, beta=0.0, clip=False, median="average").vector, [(1 + 2 + 2.5 + 2.5) / 4, 1]
    )


def test_fedseca_ipm_separation():
    # property 11: honest clients pairwise concordant, Byzantines anti-concordant with them -> rho = (H - B)/K, 0
    honest = np.array([[1.0, 1, 1], [1, 1, 2], [2, 1, 1]])
    byz = np.array([[-1.0, -1, -1], [-2, -1, -1]]) * 1.3
    res = fedseca(np.vstack([honest, byz]))
    np.testing.assert_allclose(res.selected, [0.2, 0.2, 0.2, 0, 0])


def test_fedseca_properties():
    rng = np.random.default_rng(21)
    X = rng.normal(size=(6, 500))
    X[4:] *= 50.0  # scaled Byzantines
    a = make_aggregator("fedseca", 0, {"beta": 0.0})
    res = a.aggregate(X)
    # rho and the election are invariant to positive per-coordinate rescaling of any client (property 9)
    Y = X * rng.uniform(0.1, 10, size=X.shape)
    np.testing.assert_array_equal(a.aggregate(Y).selected, res.selected)
    # output bound (property 14): |g~| <= mu <= max honest |clipped g| on every coordinate
    honest_max = np.abs(X[:4]).max(axis=0)
    assert np.all(np.abs(res.vector) <= honest_max + 1e-12)
    # sparsity (property 15): at most K (1 - gamma) D nonzeros
    assert np.count_nonzero(res.vector) <= 6 * 50


# --------------------------------------------------------------------------------------
# H+
# --------------------------------------------------------------------------------------


def test_h_derived_values():
    x = np.array([1.0, -2, 3, 0.5])
    np.testing.assert_allclose(similarity_h(x, np.zeros(4)), 0.5)  # zero upload
    np.testing.assert_allclose(similarity_h(x, -x), 1 / 3)  # sign flip
    np.testing.assert_allclose(similarity_h(x, 2 * x), 0.5)
    np.testing.assert_allclose(similarity_h(x, -3 * 7 * x), 1 / (2 + 3 * 7))  # -3(M-B) times, M - B = 7
    np.testing.assert_allclose(similarity_h(x, x), 1.0)
    np.testing.assert_allclose(similarity_h(np.zeros(4), x), 0.0)  # asymmetric
    np.testing.assert_allclose(similarity_h(np.zeros(4), np.zeros(4)), 1.0)  # 0/0 terms count as 1
    np.testing.assert_allclose(similarity_h(3 * x, 3 * np.ones(4)), similarity_h(x, np.ones(4)))  # scale invariance


def test_anomaly_score():
    # H = 1, segment norm sqrt(2): penalty max(sqrt 2, 100 / sqrt 2) = 70.71..., rho = 0.1
    np.testing.assert_allclose(anomaly_scores(np.ones(2), np.ones((1, 2)), 0.1, 100.0), [1 - 10 / np.sqrt(2)])
    assert anomaly_scores(np.ones(2), np.zeros((1, 2)), 0.1, 100.0)[0] == -np.inf


# Reference = coordinate-wise median (0.95, 0.9). With rho = 0, scores are H:
# 0.925, (0.95/1.2 + 0.9)/2 = 0.8458, (0.95 + 0.9/1.1)/2 = 0.8841, (0.95/4.9 + 0.9/4.8)/2 = 0.1907.
HX = np.array([[1.0, 1], [1.2, 0.8], [0.9, 1.1], [-3, -3]])


def test_hplus_selection_hand_computed():
    res = make_aggregator("hplus", 1, {"rho": 0.0}).aggregate(HX, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(res.selected, [1, 1, 1, 0])
    np.testing.assert_allclose(res.vector, [3.1 / 3, 2.9 / 3])
    res = make_aggregator("hplus", 0, {"rho": 0.0, "N": 2, "K": 1}).aggregate(HX, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(res.selected, [1, 0, 1, 0])
    np.testing.assert_allclose(res.vector, [0.95, 1.05])


def test_hplus_clean_mode_and_penalty():
    a = make_aggregator("hplus", 1, {"mode": "clean", "rho": 1.0, "tau": 1.0})
    assert a.needs_reference and not make_aggregator("hplus", 1, {}).needs_reference
    # penalty max(n, 1/n) is smallest at norm 1: the huge upload and the zero upload lose
    X = np.array([[0.6, 0.8], [0.8, 0.6], [60.0, 80.0], [0, 0], [0.7, 0.7]])
    res = make_aggregator("hplus", 2, {"mode": "clean", "rho": 1.0, "tau": 1.0}).aggregate(
        X, reference=np.array([0.7, 0.7]), rng=np.random.default_rng(0)
    )
    np.testing.assert_array_equal(res.selected, [1, 1, 0, 0, 1])
    with pytest.raises(ValueError, match="reference"):
        a.aggregate(X)


def test_hplus_empty_intersection_returns_reference():
    # client 0 best on coordinate 0, client 1 best on coordinate 1; N = 1 and many single-coordinate
    # segments: with probability 1 - 2^-19 both coordinates are drawn, the intersection is empty
    X = np.array([[1.0, 5], [5, 1], [3, 3]])
    ref = np.array([1.0, 1.0])
    res = make_aggregator("hplus", 0, {"mode": "clean", "rho": 0.0, "K": 20, "r": 1, "N": 1}).aggregate(
        X, reference=ref, rng=np.random.default_rng(3)
    )
    np.testing.assert_array_equal(res.vector, ref)
    np.testing.assert_array_equal(res.selected, [0, 0, 0])


def test_hplus_segments():
    a = make_aggregator("hplus", 0, {"K": 3, "r": 50})
    segs = a.draw_segments(10_000_000, np.random.default_rng(0))
    allidx = np.concatenate(segs)
    assert [len(s) for s in segs] == [50] * 3 and len(np.unique(allidx)) == 150  # disjoint
    c = make_aggregator("hplus", 0, {"segments": "contiguous", "r": 5}).draw_segments(100, np.random.default_rng(0))
    assert all(np.array_equal(s, np.arange(s[0], s[0] + 5)) for s in c)


def test_hplus_with_stateful_base():
    a = make_aggregator("hplus", 1, {"base": "cclip"}, sections={"cclip": {"tau": 1.0}})
    assert a.base_rule.tau == 1.0
    st = a.init_state(4, 2)
    a.aggregate(HX, state=st, rng=np.random.default_rng(0))
    assert np.any(st["center"] != 0)


# --------------------------------------------------------------------------------------
# FL-Detector
# --------------------------------------------------------------------------------------


def test_kmeans_1d_exact():
    W, split = kmeans_1d(np.array([10.0, 0, 11, 1]), 3)
    np.testing.assert_allclose(W, [101.0, 1.0, 0.5])  # (0,1 | 10,11), then a singleton split
    assert split == 2


def test_gap_statistic():
    rng = np.random.default_rng(0)
    two = np.concatenate([rng.normal(0, 0.01, 12), rng.normal(1, 0.01, 4)])
    assert gap_statistic_k(two, np.random.default_rng(1), nrefs=10, kmax=10) >= 2
    assert gap_statistic_k(np.linspace(0, 1, 16), np.random.default_rng(1), nrefs=10, kmax=10) == 1
    assert gap_statistic_k(np.ones(5), np.random.default_rng(1), nrefs=10, kmax=4) == 1


def test_gap_statistic_forms_decide_differently():
    # Ten scores, ten reference sets from seed 0 (values in gap_statistic_k's docstring): Gap(1) = -0.756 and
    # Gap(2) - s_2 = -0.806 in Tibshirani's form (mean of log W*: one cluster), -0.714 and -0.663 in the
    # FLDetector code's form (log of mean W*: more than one, an attack).
    x = np.array([0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.9, 0.9, 1.0, 1.0])
    assert gap_statistic_k(x, np.random.default_rng(0), nrefs=10, kmax=24) == 1
    assert gap_statistic_k(x, np.random.default_rng(0), nrefs=10, kmax=24, form="authors") == 2
    X = np.arange(20.0).reshape(10, 2)
    for gap, kept in (("tibshirani", np.ones(10)), ("authors", (x < 0.5).astype(float))):
        a = FLDetector(window=1, gap=gap)
        st = a.init_state(10, 2)
        st["scores"][0], st["nscores"][...] = x, 1  # one round of suspicion scores already recorded
        res = a.aggregate(X, state=st, rng=np.random.default_rng(0))
        np.testing.assert_array_equal(res.selected, kept)
        np.testing.assert_allclose(res.vector, X[kept == 1].mean(axis=0))
    with pytest.raises(ConfigError, match=r"fldetector\.gap"):
        FLDetector(gap="tibshirany")


def _bfgs_dense(S, Y, sigma):
    B = sigma * np.eye(S.shape[1])
    for s, y in zip(S, Y):
        Bs = B @ s
        B = B - np.outer(Bs, Bs) / (s @ Bs) + np.outer(y, y) / (y @ s)
    return B


def test_lbfgs_matches_dense_bfgs():
    # gradient descent with unit step on a quadratic: a_k = (I - H) a_{k-1}, so the pairs
    # s_k = -a_{k-1}, y_k = a_k - a_{k-1} = H s_k have positive curvature
    rng = np.random.default_rng(2)
    d = 5
    Q = rng.normal(size=(d, d))
    H = (Q @ Q.T + d * np.eye(d)) / (4 * d)
    A = np.empty((4, d))
    A[0] = rng.normal(size=d)
    for k in range(1, 4):
        A[k] = A[k - 1] - H @ A[k - 1]
    S = -A[:-1]
    Y = np.diff(A, axis=0)
    np.testing.assert_allclose(Y, S @ H)
    c = lbfgs_coefficients(A @ A.T)
    sigma = (Y[-1] @ S[-1]) / (S[-1] @ S[-1])
    np.testing.assert_allclose(c @ A, _bfgs_dense(S, Y, sigma) @ (-A[-1]), rtol=1e-8)


def test_fldetector_flags_an_unpredictable_client():
    # quadratic loss: honest gradients g_i = H w + b_i move predictably; client 4 sends noise
    rng = np.random.default_rng(4)
    n, d = 6, 20
    H = np.diag(np.linspace(0.1, 0.5, d))
    b = rng.normal(size=(n, d)) * 0.1
    w = rng.normal(size=d)
    a = make_aggregator("fldetector", 0, {"window": 3})
    st = a.init_state(n, d)
    gen = np.random.default_rng(5)
    kept = []
    for _ in range(9):
        G = w @ H + b
        G[4] = rng.normal(size=d) * 3
        res = a.aggregate(G, state=st, rng=gen)
        kept.append(res.selected)
        w = w - res.vector
    assert all(k.all() for k in kept[:4])  # scores from round 2 on; detection once 3 rounds of scores exist
    np.testing.assert_array_equal(kept[-1], [1, 1, 1, 1, 0, 1])
    assert int(st["round"]) == 9
