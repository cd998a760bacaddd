"""Deterministic tests of DP-FedCP's numerical core (fedring.conformal.labelshift).

Property numbers P1..P16 label the properties these tests and test_fcp_label_shift_coverage.py
check (docs/labelshift.md lists them); lemma and theorem numbers are the paper's.
"""

import math

import numpy as np
import pytest

from fedring.conformal import labelshift as ls
from fedring.errors import ConfigError

# ----------------------------------------------------------------------------- scores


def test_aps_hand_values_and_ties():
    p = np.array([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.0, 1.0, 0.0]])
    u = np.array([0.5, 0.25, 1.0])
    # rho = mass strictly above p[y]; V = rho + u p[y]
    assert ls.aps_scores(p, np.array([1, 0, 2]), u).tolist() == pytest.approx([0.5 + 0.15, 0.0 + 0.1, 1.0 + 0.0])
    full = ls.aps_scores(p, None, u)
    assert full[1].tolist() == pytest.approx([0.1, 0.1, 0.8 + 0.05])  # tied classes share rho = 0
    # the matrix form reuses one u per row for every label (nested sets)
    for y in range(3):
        assert np.allclose(full[:, y], ls.aps_scores(p, np.full(3, y), u))


def test_aps_random_matches_bruteforce_and_lies_in_unit_interval():
    rng = np.random.default_rng(1)
    p = ls.softmax(rng.normal(size=(200, 7)) * 3, 1.0).astype(np.float32)
    p[:20, 1] = p[:20, 2]  # ties
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random(200)
    got = ls.aps_scores(p, None, u)
    pp = p.astype(np.float64)
    brute = (pp[:, None, :] * (pp[:, None, :] > pp[:, :, None])).sum(axis=2) + u[:, None] * pp
    assert np.allclose(got, brute, atol=1e-12)
    assert got.min() >= 0 and got.max() <= 1 + 1e-12


def test_softmax_temperature():
    z = np.array([[1.0, 2.0, 3.0]])
    assert np.allclose(ls.softmax(z, 2.0), ls.softmax(z / 2.0))
    with pytest.raises(ConfigError):
        ls.softmax(z, 0.0)


# ----------------------------------------------------------------------------- quantiles


def test_weighted_quantile_hand_values_and_infinity():
    v, w = [0.3, 0.1, 0.2, 1.0], [0.25, 0.25, 0.25, 0.25]
    assert ls.weighted_quantile(v, w, 0.5) == 0.2
    assert ls.weighted_quantile(v, w, 0.75) == 0.3
    assert ls.weighted_quantile(v, w, 0.76) == 1.0
    # 9 atoms of 1/10: the 0.9 level is reached at the 9th despite float rounding
    assert ls.weighted_quantile(np.arange(1.0, 11.0), np.full(10, 0.1), 0.9) == 9.0
    # mass missing from the finite atoms sits at +inf (Tibshirani et al. 2019)
    assert ls.weighted_quantile([0.1, 0.2], [0.45, 0.45], 0.9) == 0.2
    assert ls.weighted_quantile([0.1, 0.2], [0.45, 0.44], 0.9) == math.inf
    assert ls.weighted_quantile([0.1, math.inf], [0.5, 0.5], 0.9) == math.inf
    assert ls.weighted_quantile([], [], 0.5) == math.inf
    with pytest.raises(ValueError):
        ls.weighted_quantile([0.1], [1.2], 0.5)


def test_label_shift_thresholds_match_weighted_quantile():
    rng = np.random.default_rng(2)
    for _ in range(50):
        m, c = rng.integers(0, 30), 4
        s, lab = rng.random(m), rng.integers(0, c, m)
        w = rng.random(c) * rng.integers(0, 2, c)  # some labels weigh 0
        got = ls.label_shift_thresholds(s, lab, w, 0.1)
        for y in range(c):
            z = w[lab].sum() + w[y]
            if z == 0:
                assert got[y] == 1.0
            else:
                want = ls.weighted_quantile(np.append(s, 1.0), np.append(w[lab], w[y]) / z, 0.9)
                assert got[y] == want


def test_label_shift_thresholds_infinite_test_atom():
    """Unbounded scores: the test point's atom at +inf makes the threshold +inf when it must."""
    s, lab = np.array([0.2, 0.5, 3.0]), np.array([0, 0, 1])
    w = np.array([1.0, 4.0])
    # label 0: Z = 1 + 1 + 4 + 1 = 7, the finite atoms reach 6/7 < 0.9 -> +inf
    # label 1: Z = 1 + 1 + 4 + 4 = 10, cumulative 0.1, 0.2, 0.6 < 0.9 -> +inf
    assert ls.label_shift_thresholds(s, lab, w, 0.1, test_atom=math.inf).tolist() == [math.inf, math.inf]
    assert ls.label_shift_thresholds(s, lab, w, 0.5, test_atom=math.inf).tolist() == [3.0, 3.0]


def test_unweighted_threshold_is_conformal_rank_with_test_atom():
    s = np.random.default_rng(3).random(19)
    # ceil(0.9 * 20) = 18th smallest of the 19 scores and the atom at 1
    assert ls.unweighted_threshold(s, 0.1) == np.sort(s)[17]
    assert ls.unweighted_threshold(s[:5], 0.1) == 1.0
    assert ls.label_shift_thresholds(s, np.zeros(19, int), np.ones(1), 0.1)[0] == np.sort(s)[17]


def test_p1_discrete_quantile_sandwich():
    """Lemma C.1: 1 - a <= mu(V <= Q_{1-a}) < 1 - a + max_k p_k."""
    rng = np.random.default_rng(4)
    for _ in range(300):
        k = rng.integers(1, 40)
        v, p = np.sort(rng.random(k)), rng.dirichlet(np.full(k, 0.5))
        a = rng.uniform(0.01, 0.5)
        q = ls.weighted_quantile(v, p, 1 - a)
        mass = p[v <= q].sum()
        assert 1 - a - 1e-9 <= mass < 1 - a + p.max() + 1e-12


# ----------------------------------------------------------------------------- Moreau envelope


def test_p2_moreau_closed_form_gradient_range_lipschitz():
    alpha = 0.1
    for gamma in (0.5, 0.05):
        v = 0.37
        qs = np.linspace(-1, 2, 301)
        grid = np.linspace(-2, 3, 400001)
        pin = (1 - alpha) * (v - grid) * (v >= grid) + alpha * (grid - v) * (grid > v)
        brute = np.array([np.min(pin + (grid - q) ** 2 / (2 * gamma)) for q in qs])
        assert np.allclose(ls.moreau_pinball(qs, v, alpha, gamma), brute, atol=1e-8)
        h = 1e-6
        fd = (ls.moreau_pinball(qs + h, v, alpha, gamma) - ls.moreau_pinball(qs - h, v, alpha, gamma)) / (2 * h)
        g = ls.moreau_pinball_grad(qs, v, alpha, gamma)
        assert np.allclose(g, fd, atol=1e-6)
        assert g.min() >= -(1 - alpha) and g.max() <= alpha
        assert np.all(np.abs(np.diff(g)) <= np.diff(qs) / gamma + 1e-12)


def test_atomrows_gradient_equals_sum_of_atom_gradients():
    rng = np.random.default_rng(5)
    rows_v, rows_w = [], []
    for _ in range(12):
        k = int(rng.integers(0, 25))
        rows_v.append(rng.random(k) * 1.5 - 0.2)
        rows_w.append(rng.random(k))
    rows = ls.AtomRows(rows_v, rows_w, 0.1, 0.03)
    for q in (rng.normal(0.5, 1.0, 12), np.full(12, 50.0), np.full(12, -50.0)):
        want = [np.sum(w * ls.moreau_pinball_grad(qq, v, 0.1, 0.03)) for v, w, qq in zip(rows_v, rows_w, q)]
        assert np.allclose(rows.grad(q), want, atol=1e-12)


def test_p3_p4_smoothed_minimiser_within_moreau_band():
    """Lemma A.2 / Theorem A.3: Q - gamma (1 - a) <= Q^gamma <= Q + gamma a; F' formula off atoms."""
    rng = np.random.default_rng(6)
    alpha = 0.1
    for _ in range(40):
        k = rng.integers(2, 60)
        v, p = np.sort(rng.random(k)), rng.dirichlet(np.ones(k))
        q = ls.weighted_quantile(v, p, 1 - alpha)
        # P3: F'(q) = sum_{v_k < q} p_k - (1 - alpha) between atoms; the minimiser of F is Q
        mid = (v[:-1] + v[1:]) / 2
        fprime = np.array([p[v < m].sum() for m in mid]) - (1 - alpha)
        assert np.all((fprime < 0) == (mid < q))
        for gamma in (0.1, 0.01, 0.001):
            qg = ls.smoothed_quantile(v, p, alpha, gamma)
            assert q - gamma * (1 - alpha) - 1e-12 <= qg <= q + gamma * alpha + 1e-12


# ----------------------------------------------------------------------------- weights


def test_mle_weights_eq10_and_oracle():
    counts = np.array([[800, 100, 100], [5, 5, 40]])
    w = ls.mle_weights(counts, 1)
    m, my, ms = 1050, np.array([805, 105, 140]), 50
    assert np.allclose(w, m * counts[1] / (ms * my))
    assert ls.mle_weights(np.array([[3, 0], [1, 0]]), 1).tolist() == [1.0, 0.0]  # M_y = 0 -> 0
    with pytest.raises(ValueError):
        ls.mle_weights(np.array([[3, 1], [0, 0]]), 1)
    w_or = ls.oracle_weights(np.array([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]]), np.array([1000, 50]), 1)
    assert np.allclose(w_or, [0.1 / (23 / 30), 1.0, 6.0])  # P_Y^cal = (0.7667, 0.1, 0.1333)


def test_discrete_gaussian_and_floor():
    rng = np.random.default_rng(7)
    z = ls.discrete_gaussian(3.0, 200000, rng)
    assert z.dtype.kind == "i"
    assert abs(z.mean()) < 0.05 and abs(z.var() - 9.0) < 0.15  # var of N_Z(0, 9) is 9 to 1e-30
    assert ls.discrete_gaussian(0.0, 5, rng).tolist() == [0] * 5
    counts = np.array([0, 1, 50])
    assert ls.privatise_counts(counts, 0.0, rng).tolist() == [0, 1, 50]  # no floor without noise
    assert ls.privatise_counts(counts, 100.0, rng).min() >= 1


def test_p10_lemma_2_3_weight_error_bounds_any_set():
    rng = np.random.default_rng(8)
    for _ in range(200):
        c = rng.integers(2, 8)
        p_star, p_cal = rng.dirichlet(np.ones(c)), rng.dirichlet(np.ones(c))
        w_hat = rng.random(c) * 3
        r = ls.weight_error(p_star, w_hat, p_cal)
        cy = rng.random(c)  # c_y = P(y in C(X) | Y = y) for some fixed set-valued map
        q = w_hat * p_cal / (w_hat * p_cal).sum()
        assert abs(p_star @ cy - q @ cy) <= r + 1e-12


# ----------------------------------------------------------------------------- decomposition


def _instance(rng, sizes, c=3):
    scores = [rng.random(s) for s in sizes]
    labels = [rng.integers(0, c, s) for s in sizes]
    return scores, labels


def test_p5_decomposition_sums_to_global_measure():
    rng = np.random.default_rng(9)
    sizes = np.array([40, 0, 7, 25])
    scores, labels = _instance(rng, sizes)
    w_hat = np.array([0.4, 1.3, 2.0])
    sel = [rng.random(s) < 0.5 for s in sizes]
    y = 2
    parts = [ls.local_measure(scores[i], labels[i], sel[i], w_hat, y, sizes[i], sizes.sum()) for i in range(4)]
    d = np.array([[p[2] - sizes[i] * w_hat[y] / sizes.sum()] * 3 for i, p in enumerate(parts)])
    z, _, lam = ls.query_decomposition(w_hat, sizes, d)
    assert lam[:, y].sum() == pytest.approx(1.0)
    assert lam[1, y] == 0.0  # the empty agent carries no weight (its test-atom share is N^i/N = 0)
    # sum_i lambda^i mu^i = mu_y atom by atom (eq. 14)
    vals = np.concatenate([p[0] for p in parts])
    wts = np.concatenate([lam[i, y] * p[1] / p[2] if p[2] > 0 else 0 * p[1] for i, p in enumerate(parts)])
    glob_v = np.append(np.concatenate([scores[i][sel[i]] for i in range(4)]), 1.0)
    glob_w = np.append(np.concatenate([w_hat[labels[i][sel[i]]] for i in range(4)]), w_hat[y]) / z[y]
    for atom in np.unique(glob_v):
        assert wts[vals == atom].sum() == pytest.approx(glob_w[glob_v == atom].sum(), abs=1e-12)
    # and the gradients: sum_i lambda^i grad S^i = grad S
    rows = ls.AtomRows([p[0] for p in parts], [p[1] / p[2] if p[2] > 0 else 0 * p[1] for p in parts], 0.1, 0.02)
    whole = ls.AtomRows([glob_v], [glob_w], 0.1, 0.02)
    for q in np.linspace(-0.2, 1.2, 57):
        assert lam[:, y] @ rows.grad(np.full(4, q)) == pytest.approx(whole.grad(np.array([q]))[0], abs=1e-12)


# ----------------------------------------------------------------------------- Algorithm 1


def _two_agent_rows(rng, alpha=0.1, gamma=0.01):
    v1, v2 = np.sort(rng.random(300)), np.sort(rng.beta(5, 2, 40))
    a1, a2 = rng.random(300), rng.random(40)
    lam = np.array([a1.sum(), a2.sum()]) / (a1.sum() + a2.sum())
    rows = ls.AtomRows([v1, v2], [a1 / a1.sum(), a2 / a2.sum()], alpha, gamma)
    glob = (np.concatenate([v1, v2]), np.concatenate([a1, a2]) / (a1.sum() + a2.sum()))
    return rows, lam, glob


def test_p6_k1_noiseless_is_centralised_gradient_descent():
    rng = np.random.default_rng(10)
    rows, lam, (gv, gw) = _two_agent_rows(rng)
    whole = ls.AtomRows([gv], [gw], 0.1, 0.01)
    eta, rounds = 1e-3, 300
    got = ls.dp_fedavgqe(rows, lam[:, None], q0=np.array([0.9]), rounds=rounds, local_steps=1, eta=eta)
    q, iterates = 0.9, []
    for _ in range(rounds):
        q -= eta * whole.grad(np.array([q]))[0]
        iterates.append(q)
    assert got[0] == pytest.approx(np.mean(iterates), abs=1e-13)


def test_p6_single_agent_k_local_steps_are_gd_steps():
    v = np.sort(np.random.default_rng(11).random(50))
    rows = ls.AtomRows([v], [np.full(50, 1 / 50)], 0.1, 0.05)
    dq, dqbar = ls.fedavgqe_local_round(np.array([0.2]), rows, 7, 0.004)
    q, path = 0.2, []
    for _ in range(7):
        q -= 0.004 * rows.grad(np.array([q]))[0]
        path.append(q)
    assert dq[0, 0] == pytest.approx(q - 0.2, abs=1e-14)
    assert dqbar[0, 0] == pytest.approx(np.mean(path), abs=1e-14)


def test_p6_converges_to_smoothed_quantile():
    rng = np.random.default_rng(12)
    rows, lam, (gv, gw) = _two_agent_rows(rng)
    got = ls.dp_fedavgqe(rows, lam[:, None], q0=np.array([0.9]), rounds=2000, local_steps=10, eta=1e-3)
    assert abs(got[0] - ls.smoothed_quantile(gv, gw, 0.1, 0.01)) < 5e-3


def test_partial_participation_scales_by_n_over_s():
    """With identical agents, sampling 1 of 2 with the n/|S| factor is the full-participation update."""
    v = np.linspace(0, 1, 30)
    rows = ls.AtomRows([v, v], [np.full(30, 1 / 30)] * 2, 0.1, 0.05)
    lam = np.array([[0.5], [0.5]])
    full = ls.dp_fedavgqe(rows, lam, q0=np.array([0.3]), rounds=50, local_steps=3, eta=0.005)
    rng = np.random.default_rng(0)

    def one_of_two(t):
        m = np.zeros((2, 1), bool)
        m[rng.integers(2), 0] = True
        return m

    part = ls.dp_fedavgqe(rows, lam, q0=np.array([0.3]), rounds=50, local_steps=3, eta=0.005, participation=one_of_two)
    assert part[0] == pytest.approx(full[0], abs=1e-13)


# ----------------------------------------------------------------------------- privacy


@pytest.mark.parametrize(
    "row, want",
    [  # (eps, delta, T, K, S, n, lambda_max) -> sigma_g min, by Theorem 4.4's formula
        ((1, 1e-5, 1000, 10, 11, 11, 0.5), 332.3261),
        ((1, 1e-5, 100, 1, 10, 10, 1.0), 69.1385),
        ((10, 1e-5, 1000, 10, 11, 11, 0.5), 31.5715),
        ((1, 1e-5, 1000, 10, 5, 100, 0.05), 18.0760),
    ],
)
def test_p14_sigma_g_min_table(row, want):
    assert round(ls.sigma_g_min(*row), 4) == want
    assert ls.epsilon_for_sigma(ls.sigma_g_min(*row), *row[1:]) == pytest.approx(row[0], rel=1e-9)


def test_p14_sigma_g_min_by_hand():
    # eps=4, delta=0.01, T=1, K=1, S=n=1, lambda=1: delta_bar = 1 - 0.99/3 = 0.67;
    # sigma = 2 sqrt((1/4)(1 + 24 log(1/0.67) / 4)) = sqrt(1 + 6 log(1/0.67))
    assert ls.sigma_g_min(4.0, 0.01, 1, 1, 1, 1, 1.0) == pytest.approx(math.sqrt(1 + 6 * math.log(1 / 0.67)), rel=1e-14)


def test_p14_domain_and_monotonicity():
    # 1 - (1 + sqrt(1)) (1 - 5/100)^10 = -0.197 < 0: no delta is allowed
    with pytest.raises(ConfigError, match="delta"):
        ls.sigma_g_min(1.0, 1e-5, 10, 10, 5, 100, 0.5)
    base = dict(epsilon=1.0, delta=1e-5, rounds=1000, local_steps=10, participants=5, n_agents=100, lam_max=0.5)
    s0 = ls.sigma_g_min(**base)
    assert ls.sigma_g_min(**{**base, "epsilon": 2.0}) < s0
    assert ls.sigma_g_min(**{**base, "rounds": 2000}) > s0
    assert ls.sigma_g_min(**{**base, "local_steps": 20}) > s0
    assert ls.sigma_g_min(**{**base, "lam_max": 0.6}) > s0
    assert ls.epsilon_for_sigma(0.0, 1e-5, 1000, 10, 5, 100, 0.5) == math.inf
    # T = 10: delta_bar < 1 needs (1 - delta) / (1 + sqrt(eps)) > 0.95^10, i.e. eps < 0.449
    assert ls.epsilon_for_sigma(1e-3, 1e-5, 10, 10, 5, 100, 0.5) == math.inf
    assert ls.epsilon_for_sigma(1e4, 1e-5, 10, 10, 5, 100, 0.5) < 0.449


def test_count_noise_epsilon_by_hand():
    # rho = 1 / (2 * 25) = 0.02; eps = rho + 2 sqrt(rho log(1/delta))
    assert ls.count_noise_epsilon(5.0, 1e-6) == pytest.approx(0.02 + 2 * math.sqrt(0.02 * math.log(1e6)), rel=1e-14)
    assert ls.count_noise_epsilon(0.0, 1e-6) == math.inf


# ----------------------------------------------------------------------------- Algorithm 2 API


def test_dp_fedcp_single_agent_and_empty_agents():
    rng = np.random.default_rng(13)
    s, lab = rng.random(400), rng.integers(0, 3, 400)
    # one agent: w_hat = 1, the method is split conformal on a floor(N/2) subsample
    one = ls.dp_fedcp_thresholds([s], [lab], 0, 3, rounds=300)
    assert np.allclose(one["weights"], 1.0) and np.allclose(one["lam"], 1.0)
    assert np.all(np.abs(one["threshold"] - one["exact_threshold"]) < 0.05)
    # empty agents are carried with zero weight and change nothing (same seeds: same subsets)
    with_empty = ls.dp_fedcp_thresholds(
        [s, np.zeros(0), np.zeros(0)], [lab, np.zeros(0, int), np.zeros(0, int)], 0, 3, rounds=300
    )
    assert np.all(with_empty["lam"][1:] == 0.0)
    assert np.array_equal(with_empty["exact_threshold"], one["exact_threshold"])
    assert np.allclose(with_empty["threshold"], one["threshold"], atol=1e-12)
    with pytest.raises(ConfigError, match="star"):
        ls.dp_fedcp_thresholds([s, np.zeros(0)], [lab, np.zeros(0, int)], 1, 3)
    with pytest.raises(ConfigError, match="scores"):
        ls.dp_fedcp_thresholds([s + 1], [lab], 0, 3)


def test_dp_fedcp_epsilon_sets_noise_by_theorem_4_4():
    rng = np.random.default_rng(14)
    scores = [rng.random(300), rng.random(60)]
    labels = [rng.integers(0, 3, 300), rng.integers(0, 3, 60)]
    res = ls.dp_fedcp_thresholds(scores, labels, 1, 3, epsilon=5.0, delta=1e-5, rounds=50, local_steps=2)
    for y in range(3):
        want = ls.sigma_g_min(5.0, 1e-5, 50, 2, 2, 2, res["lam"][:, y].max())
        assert res["sigma_g"][y] == pytest.approx(want)
    assert np.all(res["epsilon"] == 5.0)
    same = ls.dp_fedcp_thresholds(scores, labels, 1, 3, epsilon=5.0, delta=1e-5, rounds=50, local_steps=2)
    assert np.array_equal(res["threshold"], same["threshold"])  # seeded


def test_predict_sets():
    q = np.array([0.5, 1.0, 0.0])
    v = np.array([[0.5, 0.99, 0.0], [0.51, 1.0, 0.01]])
    assert ls.predict_sets(v, q).tolist() == [[True, True, True], [False, True, False]]


def test_subsample_sizes_and_subset():
    rng = np.random.default_rng(15)
    nb = ls.subsample_sizes(np.array([10, 0, 31]), rng, 5)
    assert nb.shape == (5, 3) and np.all(nb.sum(axis=1) == 20) and np.all(nb[:, 1] == 0)
    mask = ls.select_subset(10, 25, rng)
    assert mask.all()
    assert ls.select_subset(10, 4, rng).sum() == 4
    assert ls.select_subset(0, 3, rng).size == 0


def test_atomrows_rows_are_independent_bit_for_bit():
    """A row's gradient must not depend on the other rows (ranks and batches hold different rows)."""
    rng = np.random.default_rng(16)
    v = [rng.random(50), rng.random(8)]
    w = [rng.random(50), rng.random(8)]
    alone = ls.AtomRows(v, w, 0.1, 0.01)
    others = [rng.random(30) * 7 - 3 for _ in range(40)]
    mixed = ls.AtomRows(others + v, [np.ones(30)] * 40 + w, 0.1, 0.01)
    # include q exactly on atoms and on the band edges q -+ gamma alpha, q + gamma (1 - alpha)
    for q in (v[0][:2], np.array([v[0][3] + 0.001, v[1][0] - 0.009]), rng.random(2)):
        got = mixed.grad(np.concatenate([np.zeros(40), q]))[40:]
        assert np.array_equal(alone.grad(q), got)


def test_exact_weighted_thresholds_100_agents_by_1000_scores_fast():
    """100 agents x 1000 scores: the exact eq. (8) thresholds for 100 x 1000 scores (0.01 s measured)."""
    import time

    rng = np.random.default_rng(17)
    labels = rng.integers(0, 10, 100_000)
    scores = rng.random(100_000)
    counts = np.array([ls.label_counts(lab, 10) for lab in labels.reshape(100, 1000)])
    start = time.perf_counter()
    ls.label_shift_thresholds(scores, labels, ls.mle_weights(counts, 0), 0.1)
    assert time.perf_counter() - start < 1.0
