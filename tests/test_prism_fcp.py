"""PRISM-FCP numerical core: exact small vectors, the paper's checkable properties and the
filter's edge cases, the calibration attacks and the settings. Statistical checks state their
false-alarm rate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from fedring.conformal import prism as pf
from fedring.conformal import split_conformal_quantile
from fedring.conformal.prism.psofed import selection_masks
from fedring.conformal.prism.settings import settings
from fedring.errors import ConfigError

R2, RH = math.sqrt(2), math.sqrt(0.5)


# ---- characterization vectors, distances, maliciousness (eqs. 9-12) -----------------------


def test_characterization_vectors_exact():
    v = pf.characterization_vectors([[0.0, 0.25, 0.9, 1.0], [0.9, 2.0], [-1.0, 0.2499]], 1.0, 4)
    # 0.25 is an edge a_1: it belongs to [a_1, a_2); 1.0 and 2.0 (clipped) fall in the
    # right-closed last bin; negative scores are clipped into the first bin.
    np.testing.assert_array_equal(v, [[0.25, 0.25, 0, 0.5], [0, 0, 0, 1], [1, 0, 0, 0]])
    v = pf.characterization_vectors(np.array([[1.0, 3.0, 5.0, 7.0]]), 8.0, 4)  # r_max scaling
    np.testing.assert_array_equal(v, [[0.25, 0.25, 0.25, 0.25]])


def test_characterization_vectors_on_simplex_and_edge_cases():
    rng = np.random.default_rng(0)
    v = pf.characterization_vectors(rng.exponential(size=(7, 333)), 2.0, 30)
    assert v.shape == (7, 30) and np.all(v >= 0)
    np.testing.assert_allclose(v.sum(axis=1), 1.0, rtol=0, atol=1e-12)  # eq. (10)
    assert pf.characterization_vectors([[], [1.0]], 1.0, 3).tolist() == [[0, 0, 0], [0, 0, 1]]
    assert pf.characterization_vectors([[0.0, 0.0]], 0.0, 3).tolist() == [[1, 0, 0]]  # r_max 0
    # efficiency attack -> e_1, coverage attack (r_max = its value) -> e_H (Fig. 2)
    assert pf.characterization_vectors([np.zeros(5), np.full(5, 4.0)], 4.0, 3).tolist() == [[1, 0, 0], [0, 0, 1]]


def test_distances_and_maliciousness_exact():
    v = np.array([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    d = pf.pairwise_distances(v)
    expect = np.array([[0, 0, RH, R2], [0, 0, RH, R2], [RH, RH, 0, RH], [R2, R2, RH, 0]])
    np.testing.assert_allclose(d, expect, rtol=0, atol=1e-15)
    # eq. (12), 2 farthest neighbours (K_b - 1 with K = 4, B = 1)
    np.testing.assert_allclose(pf.maliciousness_scores(d, 2), [R2 + RH, R2 + RH, 2 * RH, 2 * R2], atol=1e-15)
    np.testing.assert_allclose(pf.maliciousness_scores(d, 3), [R2 + RH, R2 + RH, 3 * RH, 2 * R2 + RH], atol=1e-15)
    assert pf.maliciousness_scores(d, 0).tolist() == [0, 0, 0, 0]
    np.testing.assert_allclose(pf.maliciousness_scores(d, 99), pf.maliciousness_scores(d, 3))
    flagged, m = pf.filter_clients(v, np.ones(4, bool), "known", 1)
    assert flagged.tolist() == [False, False, False, True]
    np.testing.assert_allclose(m, [R2 + RH, R2 + RH, 2 * RH, 2 * R2], atol=1e-15)


def test_flag_largest_breaks_ties_by_index():
    assert pf.flag_largest(np.array([1.0, 3.0, 3.0, 3.0, 0.0]), 2).tolist() == [False, True, True, False, False]
    assert pf.flag_largest(np.array([1.0, 2.0]), 0).tolist() == [False, False]


def test_mad_rule_exact():
    t = np.array([0.1, 0.2, 0.3, 0.4, 1.0])
    v = np.column_stack([1 - t, t])
    # median vector (0.7, 0.3); rho = sqrt2 * |t - 0.3|; med = MAD = sqrt2 * 0.1;
    # z = [0.674, 0, -0.674, 0, 4.047]: only the last exceeds 2.5
    assert pf.flag_mad(v).tolist() == [False, False, False, False, True]
    assert pf.flag_mad(v, threshold=0.6).tolist() == [True, False, False, False, True]
    assert not pf.flag_mad(np.tile([0.5, 0.5], (6, 1))).any()  # MAD = 0, all equal


# ---- filtering edge cases: never removes all, single and empty clients ---------------------


def test_filter_never_removes_all_clients():
    rng = np.random.default_rng(1)
    for K in range(1, 8):
        for B in range(0, K + 3):
            v = rng.dirichlet(np.ones(5), size=K)
            for rule in pf.FILTERS:
                flagged, _ = pf.filter_clients(v, np.ones(K, bool), rule, B)
                assert (~flagged).sum() >= 1
                if rule == "known":
                    assert flagged.sum() == min(B, max(K - 1, 0)) if K > 1 else not flagged.any()
    # MAD flags only clients strictly above the median distance: at most half
    v = np.vstack([np.tile([1.0, 0.0], (3, 1)), np.tile([0.0, 1.0], (3, 1))])
    assert pf.flag_mad(v).sum() <= 3


def test_single_and_empty_clients():
    s = np.linspace(0.01, 1.0, 100)
    one = pf.robust_calibrate([s], 0.1, "known", n_byzantine=5, bins=10)
    assert not one.flagged.any() and one.q == split_conformal_quantile(s, 0.1)
    mixed = pf.robust_calibrate([[], s, [], s, s, s * 10], 0.1, "known", n_byzantine=1, bins=10)
    assert mixed.flagged.tolist() == [False, False, False, False, False, True]  # empties: neither
    assert np.isnan(mixed.malice[[0, 2]]).all()
    assert mixed.q == split_conformal_quantile(np.concatenate([s, s, s]), 0.1)
    empty = pf.robust_calibrate([[], []], 0.1, "mad")
    assert empty.q == math.inf and not empty.flagged.any()
    assert pf.robust_calibrate([[0.5]], 0.1, None).q == math.inf  # too few scores: +inf


# ---- calibration attacks and the sanity checks C1-C3 implied by Table I ----------------------------------------


def test_attacks_exact():
    s = np.array([[0.1, 0.3], [1.0, 3.0]])
    assert pf.EfficiencyAttack()(s, None).tolist() == [[0, 0], [0, 0]]
    assert pf.CoverageAttack(10)(s, None).tolist() == [[2, 2], [20, 20]]
    assert pf.CoverageAttack(10)(s, None, benign_mean=0.5).tolist() == [[5, 5], [5, 5]]
    r = pf.RandomAttack(0.5)(np.zeros((1, 10000)), np.random.default_rng(3))
    assert r.min() == 0.0 and (r == 0).mean() > 0.45  # clipped at 0 (about half)
    np.testing.assert_array_equal(
        pf.RandomAttack(0.5)(s, np.random.default_rng(4)),
        np.maximum(s + math.sqrt(0.5) * np.random.default_rng(4).standard_normal(s.shape), 0),
    )
    for bad in (lambda: pf.CoverageAttack(0), lambda: pf.RandomAttack(-1)):
        with pytest.raises(ConfigError):
            bad()


def _benign_and_byzantine(attack, K=100, B=20, N=1000, seed=0):
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.1, 0.3, K)  # the synthetic setup's score scale
    true = np.abs(rng.standard_normal((K, N))) * scales[:, None]
    byz = np.zeros(K, bool)
    byz[rng.choice(K, B, replace=False)] = True
    rep = true.copy()
    if attack is not None:
        rep[byz] = attack(true[byz], np.random.default_rng(seed + 1))
    return true, rep, byz


@pytest.mark.parametrize("attack", [pf.EfficiencyAttack(), pf.CoverageAttack(10), pf.RandomAttack(0.5)])
def test_attacks_flagged_and_retained_quantile_exact(attack):
    true, rep, byz = _benign_and_byzantine(attack)
    res = pf.robust_calibrate(rep, 0.1, "known", n_byzantine=20)
    assert res.flagged.tolist() == byz.tolist()  # 20/20 TP, 0 FP
    assert res.q == split_conformal_quantile(true[~byz], 0.1)  # C3: only benign scores used
    mad = pf.robust_calibrate(rep, 0.1, "mad")
    assert mad.flagged[byz].all()  # recall 1


def test_fcp_efficiency_and_coverage_attacks_C1_C2():
    true, rep, byz = _benign_and_byzantine(pf.EfficiencyAttack())
    q = pf.robust_calibrate(rep, 0.1, None).q
    # C1: rank ceil(0.9 * 100001) = 90001 of the pool = the 70001-th benign score
    assert q == np.sort(true[~byz].ravel())[70000]
    assert np.count_nonzero(true[~byz] <= q) == 70001
    true, rep, byz = _benign_and_byzantine(pf.CoverageAttack(10))
    q = pf.robust_calibrate(rep, 0.1, None).q
    # C2: the rank exceeds the 80000 benign scores, so q is a Byzantine value (10x a mean)
    assert q in set((10 * true[byz].mean(axis=1)).tolist())
    assert q == np.sort(10 * true[byz].mean(axis=1))[10]  # 11th of 20 (ranks 80001..100000)


# ---- the paper's properties ---------------------------------------------------------------------


def test_P1_partial_sharing_attenuates_injected_energy():
    """Eqs. (23)-(24): E||S delta||^2 = M sigma_B^2, E||tau S delta||^2 = p_a M sigma_B^2."""
    D, M, var, pa, n = 50, 15, 0.1, 0.25, 100_000
    rng = np.random.default_rng(11)
    idx = selection_masks(rng, n, D, M)
    delta = math.sqrt(var) * rng.standard_normal((n, D))
    energy = (np.take_along_axis(delta, idx, axis=1) ** 2).sum(axis=1)
    full = (delta**2).sum(axis=1)
    tau = rng.random(n) < pa
    # 99.9% two-sided normal bands (the CLT is accurate at n = 1e5)
    z = stats.norm.ppf(1 - 1e-3 / 2)
    for sample, mean in ((energy, M * var), (full, D * var), (tau * energy, pa * M * var)):
        assert abs(sample.mean() - mean) < z * sample.std() / math.sqrt(n)
    assert abs(energy.mean() / full.mean() - M / D) < 0.01 * M / D


def test_selection_masks_are_uniform_M_subsets():
    rng = np.random.default_rng(5)
    idx = selection_masks(rng, 20000, 10, 3)
    assert idx.shape == (20000, 3) and np.all(np.diff(idx, axis=1) > 0)
    freq = np.bincount(idx.ravel(), minlength=10) / 20000  # each coordinate w.p. M/D = 0.3
    assert np.all(np.abs(freq - 0.3) < 4.5 * math.sqrt(0.3 * 0.7 / 20000))  # 1e-5 per coordinate
    assert selection_masks(rng, 2, 4, 4).tolist() == [[0, 1, 2, 3]] * 2
    rr = selection_masks(np.random.default_rng(0), 5, 10, 3, "roundrobin")
    for a, b in itertools.pairwise(rr):  # S_{n+1} is S_n shifted by M (original PSO-Fed)
        assert set(b.tolist()) == {(i + 3) % 10 for i in a.tolist()}


def test_P3_residual_is_lipschitz_in_the_model():
    rng = np.random.default_rng(2)
    x, w, ws = rng.standard_normal((3, 1000, 8)) * rng.uniform(0.01, 10, (3, 1000, 1))
    y = rng.standard_normal(1000)
    lhs = np.abs(np.abs(y - (w * x).sum(1)) - np.abs(y - (ws * x).sum(1)))
    assert np.all(lhs <= np.linalg.norm(x, axis=1) * np.linalg.norm(w - ws, axis=1) * (1 + 1e-12))


def test_P8_histogram_concentration():
    """Lemma 6: P(||v - p|| >= eps) <= 2H exp(-N eps^2 / 3) (half-normal scores, exact p)."""
    H, N, trials = 20, 200, 2000
    edges = np.arange(H + 1) / H * 3.0
    p = np.diff(2 * stats.norm.cdf(edges) - 1)
    p[-1] += 1 - p.sum()  # mass beyond r_max is clipped into the last bin
    rng = np.random.default_rng(8)
    dev = np.linalg.norm(pf.characterization_vectors(np.abs(rng.standard_normal((trials, N))), 3.0, H) - p, axis=1)
    for eps in (0.1, 0.2, 0.3):
        bound = 2 * H * math.exp(-N * eps**2 / 3)
        freq = (dev >= eps).mean()
        assert freq <= min(bound, 1.0) + 4 * math.sqrt(0.25 / trials)


def test_P9_drift_bound():
    """Lemma 7 (eq. 28): ||p_k - p*|| <= 2 sqrt(2(H+1)) f_max L_x ||e|| with Gaussian data.

    r(w) = |nu - x^T e| is half-normal with variance sigma^2 + s^2 ||e||^2, so both
    histograms are exact; f_max = sqrt(2/pi)/sigma, L_x = s sqrt(D)."""
    H, D, sigma, s, r_max = 100, 50, 0.1, 1.0, 1.0
    edges = np.arange(H + 1) / H * r_max

    def hist(sd):
        p = np.diff(2 * stats.norm.cdf(edges / sd) - 1)
        p[-1] += 1 - p.sum()
        return p

    rng = np.random.default_rng(9)
    for norm_e in (1e-4, 1e-3, 1e-2, 0.1, 1.0):
        e = rng.standard_normal(D)
        e *= norm_e / np.linalg.norm(e)
        gap = np.linalg.norm(hist(math.sqrt(sigma**2 + s**2 * norm_e**2)) - hist(sigma))
        bound = 2 * math.sqrt(2 * (H + 1)) * math.sqrt(2 / math.pi) / sigma * s * math.sqrt(D) * norm_e
        assert gap <= bound


def test_P11_theorem3_exact_filtering():
    """Eq. (34): histograms meeting the separation condition are filtered exactly."""
    rng = np.random.default_rng(10)
    K, B, H = 100, 20, 30
    Kb = K - B
    p_star = rng.dirichlet(np.ones(H))
    q = np.zeros(H)
    q[0] = 1.0
    delta = np.linalg.norm(q - p_star)
    for _ in range(20):
        r_b, r_a = 0.2 * delta * rng.uniform(0.1, 1), 0.05 * delta * rng.uniform(0, 1)
        gamma, Gamma = delta - r_a - r_b, delta + r_a + r_b
        assert (Kb - 1) * gamma > B * Gamma + (Kb - 1 - B) * 2 * r_b  # condition (34)

        def around(c, radius, n):
            d = rng.standard_normal((n, H))
            d -= d.mean(axis=1, keepdims=True)  # stay on the sum-1 plane
            return c + d / np.linalg.norm(d, axis=1, keepdims=True) * radius * rng.uniform(0, 1, (n, 1))

        v = np.vstack([around(p_star, r_b, Kb), around(q, r_a, B)])
        perm = rng.permutation(K)
        flagged, m = pf.filter_clients(v[perm], np.ones(K, bool), "known", B)
        assert flagged.tolist() == (perm >= Kb).tolist()
        assert m[perm >= Kb].min() >= (Kb - 1) * gamma  # Appendix A, step 4
        assert m[perm < Kb].max() <= B * Gamma + (Kb - 1 - B) * 2 * r_b  # step 5


def test_P13_coverage_bounds_monotone_and_vacuous():
    lo0, hi0 = pf.coverage_bounds(0.0, 100, 80, 100, 1000)
    lo1, hi1 = pf.coverage_bounds(0.1, 100, 80, 100, 1000)
    assert lo1 > lo0 and hi1 > hi0  # Corollary 5: increasing in eps
    assert lo0 == pytest.approx(1 / 1080 + 11.905, abs=2e-3) and lo0 > 1  # vacuous at the paper's settings
    assert hi0 - lo0 == pytest.approx(80 / 1080 - 1 / 1080)


# ---- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,kw",
    [
        ("prism.shared", {"shared": 0}),
        ("prism.shared", {"shared": 51}),
        ("prism.participants", {"participants": 101}),
        ("prism.byzantine", {"byzantine": 100}),
        ("prism.step", {"step": -1.0}),
        ("prism.alpha", {"alpha": 1.0}),
        ("prism.filter", {"filter": "krum"}),
        ("prism.byz_persist", {"byz_persist": "yes"}),
        ("prism.bins", {"bins": 0}),
        ("prism.attack_prob", {"attack_prob": 2.0}),
        ("prism.coverage_on", {"coverage_on": "some"}),
        ("prism.input_var", {"input_var": [0.2]}),
        ("prism.noise_var", {"noise_var": [0.02, 0.01]}),
        ("prism.calib_attack", {"calib_attack": "coverag"}),
        ("prism.dim", {"dataset": "uci", "dim": 50, "standin": True}),
    ],
)
def test_config_errors_name_the_setting(key, kw):
    with pytest.raises(ConfigError) as e:
        settings(**kw)
    assert e.value.key == key


def test_profiles():
    assert settings(profile="stable").step == 0.01
    fit = settings()
    assert (fit.profile, fit.step, fit.byz_persist, fit.local_updates) == ("paper-fit", 0.06, "sent", False)
    assert settings(profile="paper-match", step=0.03).step == 0.03
    with pytest.raises(ConfigError):
        settings(profile="fast")
    with pytest.raises(ConfigError) as e:
        settings(dataset="uci")
    assert e.value.key == "prism.data_dir"
    uci = settings(dataset="uci", standin=True)
    assert (uci.profile, uci.dim, uci.shared, uci.participants, uci.step) == ("uci", 81, 20, 20, 0.01)
    # the random attack's sigma_C^2: a variance of 0.5, or (paper-fit) a standard deviation of 0.5
    assert settings(profile="stable").attack_params("random") == {"variance": 0.5}
    assert fit.attack_params("random") == {"variance": 0.25}
    assert fit.attack_params("random", {"variance": 1.0}) == {"variance": 1.0}
    assert fit.attack_params("coverage", {"factor": 5}) == {"factor": 5}


def test_calibration_attack_registry():
    assert list(pf.CALIB_ATTACKS) == ["coverage", "efficiency", "random"]
    assert pf.make_calib_attack("none") is None
    assert pf.make_calib_attack("random", {"variance": 0.25}).std == 0.5
    benign = pf.make_calib_attack("coverage", {"mean": "benign"})
    assert benign.knowledge == "omniscient" and pf.make_calib_attack("coverage").knowledge == "own"
    for name, params, key in (
        ("coverage", {"factr": 1.0}, "coverage.factr"),
        ("coverage", {"mean": "all"}, "coverage.mean"),
        ("random", {"variance": -1.0}, "random.variance"),
        ("krum", {}, "prism.calib_attack"),
    ):
        with pytest.raises(ConfigError) as e:
            pf.make_calib_attack(name, params)
        assert e.value.key == key
