"""Tests of fedring.attacks: exact outputs of the deterministic attacks on hand-made inputs,
the defining constraints of the optimised ones, and the data attacks."""

import math

import numpy as np
import pytest

from fedring.attacks import (
    ALIE,
    ATTACKS,
    IPM,
    Adaptive,
    AttackContext,
    Backdoor,
    DataAttack,
    FangKrum,
    FangTrim,
    FoE,
    Gaussian,
    HPlusAttack,
    LabelFlip,
    Mimic,
    MinMax,
    MinSum,
    ModelAttack,
    Scaling,
    SignFlip,
    alie_z,
    attack_success_rate,
    make_attack,
)
from fedring.attacks.adaptive import brace_margin_flips, line_maximize
from fedring.attacks.base import std
from fedring.attacks.fang import fang_krum_lambda
from fedring.attacks.minmax import min_max_sum_gamma, perturbation
from fedring.errors import ConfigError

# -- tiny reference rules, independent of fedring.aggregators --------------------------------


def krum(G, f):
    """Blanchard et al.: squared distances, n - f - 2 nearest others; (vector, index)."""
    n = G.shape[0]
    D = ((G[:, None] - G[None]) ** 2).sum(-1)
    i = int(np.argmin(np.sort(D, 1)[:, 1 : n - f - 1].sum(1)))
    return G[i], i


def median(G):
    return np.median(G, axis=0)


def trimmed_mean(G, k):
    return np.sort(G, axis=0)[k : G.shape[0] - k].mean(axis=0)


def brace(G, lam):
    return np.where(np.sign(G).sum(0) > lam, 1.0, -1.0)


def ctx(seed=0, n=10, f=2, lr=0.1, aggregator=None):
    return AttackContext(np.random.default_rng(seed), n=n, f=f, lr=lr, round=0, aggregator=aggregator)


HONEST = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
BYZ = np.array([[1.0, -1.0, 0.5], [2.0, 0.0, -3.0]])


# -- registry and parameter checks -----------------------------------------------------------


def test_registry_names_and_knowledge():
    assert set(ATTACKS) == {
        "gaussian",
        "signflip",
        "scaling",
        "alie",
        "ipm",
        "foe",
        "fang_krum",
        "fang_trim",
        "minmax",
        "minsum",
        "mimic",
        "hplus_attack",
        "adaptive",
        "nonfinite",
        "labelflip",
        "backdoor",
        "optimal_alie",
        "optimal_ipm",
        "dba",
        "neurotoxin",
        "edgecase",
        "clippedclustering_attack",
        "signguard_attack",
        "altermin",
        "threedfed",
    }
    built = {name: make_attack(name, {}, n_clients=10) for name in ATTACKS}
    assert {n: a.knowledge for n, a in built.items() if a.knowledge != "omniscient"} == {
        "gaussian": "own",
        "signflip": "own",
        "nonfinite": "own",
        "labelflip": "own",
        "backdoor": "own",
        "dba": "own",
        "neurotoxin": "own",
        "edgecase": "own",
        "altermin": "own",
        "threedfed": "collusion",
    }
    assert {n for n, a in built.items() if isinstance(a, DataAttack)} == {
        "labelflip",
        "backdoor",
        "dba",
        "neurotoxin",
        "edgecase",
        "altermin",
    }
    assert make_attack("fang_trim", {"variant": "partial"}).knowledge == "collusion"
    assert make_attack("alie", {"stats": "byzantine"}).knowledge == "collusion"
    assert make_attack("scaling", {"source": "own"}).knowledge == "own"
    assert make_attack("none", {}) is None


@pytest.mark.parametrize(
    "name, params, key",
    [
        ("nope", {}, "attack"),
        ("gaussian", {"sd": 1.0}, "attack.sd"),
        ("gaussian", {"sigma": -1.0}, "attack.sigma"),
        ("gaussian", {"sigma": "big"}, "attack.sigma"),
        ("gaussian", {"sigma": True}, "attack.sigma"),
        ("minmax", {"perturbation": "random"}, "attack.perturbation"),
        ("minmax", {"bound": "max"}, "attack.bound"),
        ("minsum", {"bound": "mean"}, "attack.bound"),
        ("alie", {"ddof": 2}, "attack.ddof"),
        ("fang_krum", {"variant": "half"}, "attack.variant"),
        ("fang_trim", {"b": 0.5}, "attack.b"),
        ("scaling", {"factor": 0}, "attack.factor"),
        ("mimic", {"worker": 1.5}, "attack.worker"),
        ("adaptive", {"target": "krum"}, "attack.target"),
        ("adaptive", {"target": "generic", "lam": 5}, "attack.lam"),
        ("adaptive", {"evals": 4}, "attack.evals"),
        ("adaptive", {"lam": 3}, "attack.mode"),
        ("adaptive", {"mode": "margin", "budget": 0}, "attack.budget"),
        ("adaptive", {"target": "generic", "ratio": 0.5}, "attack.ratio"),
        ("labelflip", {"mapping": [0, 1]}, "attack.mapping"),
        ("labelflip", {"num_classes": 1}, "attack.num_classes"),
        ("backdoor", {"fraction": 1.5, "scale": 1}, "attack.fraction"),
        ("backdoor", {}, "attack.scale"),
        ("none", {"sigma": 1}, "attack.sigma"),
        ("hplus_attack", {"scale": 2}, "attack.scale"),
        ("labelflip", {"n_clients": 5}, "attack.n_clients"),
    ],
)
def test_bad_settings_name_the_key(name, params, key):
    with pytest.raises(ConfigError) as err:
        make_attack(name, params)
    assert err.value.key == key
    if key == "attack":
        assert "allowed: none, adaptive, alie, altermin, backdoor" in str(err.value)


def test_unknown_parameter_lists_allowed_ones():
    with pytest.raises(ConfigError, match="allowed: perturbation, gamma_init, tol, bound"):
        make_attack("minsum", {"gamma": 1})


def test_honest_gradients_hidden_from_non_omniscient_and_required_by_omniscient():
    # a wrong-shaped honest array must not matter to an attack that may not see it
    out = SignFlip()(BYZ, np.zeros((7, 99)), ctx())
    np.testing.assert_array_equal(out, -BYZ)
    with pytest.raises(ValueError, match="omniscient"):
        IPM()(BYZ, None, ctx())
    with pytest.raises(ValueError, match="honest must be"):
        IPM()(BYZ, np.zeros((3, 4)), ctx())


def test_output_dtype_and_shape_follow_byz_for_every_model_attack():
    rng = np.random.default_rng(3)
    honest, byz = rng.normal(0.2, 1, (8, 16)).astype(np.float32), rng.normal(0.2, 1, (3, 16)).astype(np.float32)
    for name in ATTACKS:
        attack = make_attack(name, {}, n_clients=11)
        if not isinstance(attack, ModelAttack) or attack.needs_model:  # tests/test_threedfed.py
            continue
        out = attack(byz, honest, ctx(n=11, f=3, aggregator=median))
        assert out.dtype == np.float32 and out.shape == byz.shape and out.flags.writeable, name
        assert np.isfinite(out).all() == (name != "nonfinite"), name  # only this one sends NaN


def test_same_seed_same_output_for_every_model_attack():
    rng = np.random.default_rng(4)
    honest, byz = rng.normal(0.2, 1, (8, 16)), rng.normal(0.2, 1, (3, 16))
    params = {"alie": {"jitter": 0.05}, "ipm": {"jitter": 0.05}, "adaptive": {"target": "generic"}}
    for name in ATTACKS:
        attack = make_attack(name, params.get(name, {}), n_clients=11)
        if not isinstance(attack, ModelAttack) or attack.needs_model:  # tests/test_threedfed.py
            continue
        a = attack(byz, honest, ctx(seed=7, n=11, f=3, aggregator=median))
        b = attack(byz, honest, ctx(seed=7, n=11, f=3, aggregator=median))
        np.testing.assert_array_equal(a, b, err_msg=name)
    c = Gaussian()(byz, None, ctx(seed=8))
    assert not np.array_equal(c, Gaussian()(byz, None, ctx(seed=7)))


# -- simple model attacks: exact values ------------------------------------------------------


def test_gaussian_moments():
    out = Gaussian(sigma=200.0, mean=3.0)(np.zeros((4, 10_000)), None, ctx(seed=1))
    # 40,000 draws: the sample std is within 2% of sigma (5.7 standard errors, false alarm
    # ~1e-8) and the mean within 5 standard errors of 3
    assert abs(out.std() / 200.0 - 1) < 0.02
    assert abs(out.mean() - 3.0) < 5 * 200.0 / math.sqrt(out.size)
    assert not np.array_equal(out[0], out[1])  # fresh per attacker


def test_signflip_sources():
    c = ctx()
    np.testing.assert_array_equal(SignFlip(scale=2)(BYZ, None, c), -2 * BYZ)
    np.testing.assert_array_equal(SignFlip(source="mean")(BYZ, HONEST, c), [[-4, -5, -6]] * 2)
    np.testing.assert_array_equal(SignFlip(source="sum", scale=3)(BYZ, HONEST, c), [[-36, -45, -54]] * 2)


def test_scaling_ipm_foe_hplus_exact():
    c = ctx()
    np.testing.assert_array_equal(Scaling()(BYZ, HONEST, c), [[40, 50, 60]] * 2)
    np.testing.assert_array_equal(Scaling(factor=-2, source="own")(BYZ, None, c), -2 * BYZ)
    np.testing.assert_allclose(IPM()(BYZ, HONEST, c), [[-5.2, -6.5, -7.8]] * 2)
    np.testing.assert_allclose(FoE()(BYZ, HONEST, c), [[-0.4, -0.5, -0.6]] * 2)
    np.testing.assert_array_equal(FoE(q=-2)(BYZ, HONEST, c), [[-8, -10, -12]] * 2)  # ByzFL FallOfEmpires(3)
    np.testing.assert_array_equal(HPlusAttack()(BYZ, HONEST, c), [[-4, -5, -6]] * 2)


def test_ipm_jitter_per_attacker_within_range():
    out = IPM(epsilon=1.3, jitter=0.05)(BYZ, HONEST, ctx(seed=2))
    eps = out[:, 0] / -4.0
    assert np.all(np.abs(eps - 1.3) <= 0.05) and eps[0] != eps[1]
    np.testing.assert_allclose(out, -eps[:, None] * HONEST.mean(0))


# -- ALIE --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, f, z",
    [
        (10, 1, -0.139710),
        (10, 2, 0.0),
        (25, 5, 0.253347),
        (50, 10, 0.253347),
        (50, 20, 0.841621),
        (100, 20, 0.285841),
        (20, 4, 0.157311),
    ],
)
def test_alie_z_formula(n, f, z):
    assert alie_z(n, f) == pytest.approx(z, abs=1e-6)


@pytest.mark.parametrize("n, f", [(10, 6), (10, 9), (4, 3), (10, 0), (2, 1)])
def test_alie_z_degenerate_raises(n, f):
    with pytest.raises(ConfigError) as err:
        alie_z(n, f)
    assert err.value.key == "attack.z"


def test_alie_exact_values_and_conventions():
    c = ctx(n=5)
    # ByzFL's ALittleIsEnough(1.5) example: std with ddof 1 is 3
    np.testing.assert_array_equal(ALIE(z=1.5)(BYZ, HONEST, c), [[8.5, 9.5, 10.5]] * 2)
    np.testing.assert_allclose(ALIE(z=1.5, ddof=0)(BYZ, HONEST, c), [HONEST.mean(0) + 1.5 * math.sqrt(6)] * 2)
    # stats from the attackers' own gradients: mean (1.5, -0.5, -1.25), std ddof 1 = |diff|/sqrt(2)
    np.testing.assert_allclose(
        ALIE(z=2.0, stats="byzantine")(BYZ, None, c),
        [[1.5 + 2 / math.sqrt(2), -0.5 + 2 / math.sqrt(2), -1.25 + 7 / math.sqrt(2)]] * 2,
    )
    # formula z for n = 10 with the 2 actual attackers is 0: the honest mean
    np.testing.assert_allclose(ALIE()(BYZ, HONEST, ctx(n=10, f=3)), [HONEST.mean(0)] * 2)
    assert ALIE().check(10, 6).key == "attack.z" and ALIE(z=1.0).check(10, 6) is None
    with pytest.raises(ConfigError, match=r"give attack.z explicitly"):
        ALIE().require(10, 6)
    with pytest.raises(ValueError, match="ddof=1 needs at least 2 rows"):
        ALIE(z=1.0)(BYZ, HONEST[:1], c)


# -- Fang's attacks ----------------------------------------------------------------------------


def test_fang_krum_lambda_bound_and_exhausted_search_by_hand():
    # honest 1, 2, 3, 4; n = 5, f = 1: nearest-2 sums 3, 2, 2, 3 -> min 2; lambda_max = 2/(5-2-1) + 4 = 5.
    # Krum never picks a point left of 1 here, so lambda halves until the next halving is < 1e-5.
    lam, chosen = fang_krum_lambda(np.array([[1.0], [2.0], [3.0], [4.0]]), np.array([1.0]), b=1, f=1, lr=1.0)
    assert (lam, chosen) == (5.0 / 2**18, False)
    lam, _ = fang_krum_lambda(np.array([[1.0], [2.0], [3.0], [4.0]]), np.array([1.0]), b=1, f=1, lr=0.1)
    assert lam == pytest.approx(0.5 / 2**15)  # same search in parameter units: lambda_max = lr * 5


@pytest.mark.parametrize("seed", range(4))
def test_fang_krum_full_makes_krum_pick_the_inverse_direction(seed):
    rng = np.random.default_rng(seed)
    n, b, lr = 12, 3, 0.1
    honest, byz = rng.normal(0.3, 1, (n - b, 30)), rng.normal(0.3, 1, (b, 30))
    out = FangKrum()(byz, honest, ctx(n=n, f=b, lr=lr))
    s = np.sign(byz.sum(0) + honest.sum(0))
    lam, chosen = fang_krum_lambda(honest, s, b, b, lr)
    assert chosen
    np.testing.assert_allclose(out, np.tile(-(lam / lr) * s, (b, 1)))
    picked, i = krum(np.vstack([out, honest]), b)
    assert i < b and picked @ s < 0 < krum(np.vstack([byz, honest]), b)[0] @ s
    # lambda is the first power-of-2 fraction of lambda_max that Krum accepts
    assert krum(np.vstack([np.tile(-(2 * lam / lr) * s, (b, 1)), honest]), b)[1] >= b


def test_fang_krum_partial_finds_fewest_supporters_then_largest_power_of_two():
    rng = np.random.default_rng(5)
    byz = rng.normal(0.3, 1, (5, 20))
    out = FangKrum(variant="partial")(byz, None, ctx(n=12, f=5))
    s = np.sign(byz.sum(0))
    # brute force with the reference Krum over the before-attack rows, then k copies: smallest k,
    # then largest lambda = 2^-j picked
    found = next(
        (k, 2.0**-j)
        for k in range(1, 5)
        for j in range(17)
        if krum(np.vstack([byz, np.tile(-(2.0**-j) * s, (k, 1))]), k)[1] >= 5
    )
    np.testing.assert_allclose(out, np.tile(-found[1] * s, (5, 1)))
    with pytest.raises(ConfigError, match="at least 2"):
        FangKrum(variant="partial")(byz[:1], None, ctx(n=12, f=1))
    with pytest.raises(ConfigError, match="n > 2f"):
        FangKrum()(byz, byz, ctx(n=10, f=5))
    assert "n > 2f" in str(FangKrum().check(10, 2, 5))
    assert FangKrum().check(10, 4) is None


def test_fang_krum_partial_copies_after_the_before_attack_rows_as_fldetector_and_flpoison():
    # 2 attackers, rows (1, 0.2), (-0.9, -1.2): s = sign((0.1, -1.0)) = (1, -1), one copy (-lam, lam), Krum
    # with f = 1 uses one neighbour. At lam = 1 the copy is 4.64 from row 0 (its nearest) and row 0 is 4.64
    # from the copy: an exact tie, which Krum gives to the lower index. Copies after the rows (as FLDetector's
    # dir_partial_krum_lambda and FLPoison's FangAttack), row 0 wins at every lam, and lam halves from 1 until
    # the next halving would be below tol = 1e-5: 2^-16 (FLDetector's 2e-5 threshold stops there too; FLPoison's
    # "stop once lam <= 1e-5" halves once more, to 2^-17). Copies first, the copy won the tie at lam = 1.
    rows = np.array([[1.0, 0.2], [-0.9, -1.2]])
    out = FangKrum(variant="partial")(rows, None, ctx(n=6, f=2, lr=1.0))
    np.testing.assert_array_equal(out, [[-(2.0**-16), 2.0**-16]] * 2)
    G = np.vstack([rows, [[-1.0, 1.0]]])  # the copy at lam = 1, last
    one_neighbour = np.sort(((G[:, None] - G[None]) ** 2).sum(-1), 1)[:, 1]
    assert one_neighbour[0] == one_neighbour[2] == pytest.approx(4.64) and one_neighbour[1] == pytest.approx(4.85)
    assert fang_krum_lambda(rows, np.array([1.0, -1.0]), 1, 1, 1.0, start=1.0) == (1.0, True)  # copies first


def test_fang_trim_values_in_the_stated_ranges_and_trimmed_mean_pushed_back():
    rng = np.random.default_rng(6)
    n, b = 10, 2
    honest, byz = rng.normal(0.2, 1, (n - b, 500)), rng.normal(0.2, 1, (b, 500))
    out = FangTrim()(byz, honest, ctx(seed=1, n=n, f=b))
    rows = np.vstack([byz, honest])
    s = np.sign(rows.sum(0))
    base = np.where(s > 0, rows.min(0), rows.max(0))
    same = s * base > 0
    lo = np.where(same, np.minimum(base / 2, base), np.minimum(2 * base, base))
    hi = np.where(same, np.maximum(base / 2, base), np.maximum(2 * base, base))
    assert np.all((lo <= out) & (out <= hi))
    # every malicious value is beyond the benign extreme on the side opposing the update
    assert np.all(np.where(s > 0, out <= rows.min(0), out >= rows.max(0)))
    before, after = trimmed_mean(rows, b), trimmed_mean(np.vstack([out, honest]), b)
    assert np.all(np.where(s > 0, after <= before, after >= before))
    assert np.all(
        np.where(
            s > 0, median(np.vstack([out, honest])) <= median(rows), median(np.vstack([out, honest])) >= median(rows)
        )
    )


def test_fang_trim_partial_range():
    rng = np.random.default_rng(7)
    byz = rng.normal(0.2, 1, (4, 200))
    out = FangTrim(variant="partial")(byz, None, ctx(seed=2))
    mu, sigma = byz.mean(0), byz.std(0)
    u = (mu - out) / (np.sign(mu) * sigma)
    assert np.all((3 <= u) & (u <= 4)) and not np.array_equal(out[0], out[1])


# -- Min-Max / Min-Sum -------------------------------------------------------------------------


def _constraint(kind, honest, g, bound="max"):
    D = ((honest[:, None] - honest[None]) ** 2).sum(-1)
    if kind == "minmax":
        return ((honest - g) ** 2).sum(1).max() <= D.max()
    return ((honest - g) ** 2).sum() <= (D.sum(1).max() if bound == "max" else D.sum(1).min())


@pytest.mark.parametrize("cls, kind", [(MinMax, "minmax"), (MinSum, "minsum")])
@pytest.mark.parametrize("pert", ["std", "unit_vec", "sign"])
def test_min_max_sum_constraint_holds_and_a_slightly_larger_gamma_breaks_it(cls, kind, pert):
    rng = np.random.default_rng(8)
    honest, byz = rng.normal(0.5, 1, (8, 20)), np.zeros((2, 20))
    attack = cls(perturbation=pert)
    out = attack(byz, honest, ctx())
    gamma, dev = attack.gamma(honest)
    assert 0 < gamma < 19
    np.testing.assert_allclose(out, np.tile(honest.mean(0) - gamma * dev, (2, 1)))
    assert _constraint(kind, honest, out[0])
    assert not _constraint(kind, honest, honest.mean(0) - (gamma + 3e-5) * dev)


def test_min_sum_min_bound_is_tighter():
    rng = np.random.default_rng(9)
    honest = rng.normal(0.5, 1, (8, 20))
    dev = perturbation(honest, "std")
    g_max = min_max_sum_gamma(honest, "minsum", dev, bound="max")
    g_min = min_max_sum_gamma(honest, "minsum", dev, bound="min")
    assert g_min < g_max
    assert _constraint("minsum", honest, honest.mean(0) - g_min * dev, "min")
    assert not _constraint("minsum", honest, honest.mean(0) - (g_min + 3e-5) * dev, "min")


def test_min_max_search_saturates_below_twice_gamma_init():
    # two identical honest gradients: pairwise distance 0, so only gamma = 0 is feasible
    honest = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert min_max_sum_gamma(honest, "minmax", np.array([1.0, 0.0])) == 0.0
    # a zero direction is always feasible: the search climbs to 2 * gamma_init - tol
    g = min_max_sum_gamma(np.array([[0.0, 1.0], [1.0, 0.0]]), "minmax", np.zeros(2), gamma_init=1.0)
    assert 2 - 2e-5 < g < 2


# -- Mimic -------------------------------------------------------------------------------------


def test_mimic_copies_the_most_extreme_honest_client():
    honest = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [-1.0, -1.0]])
    np.testing.assert_array_equal(Mimic()(BYZ[:, :2], honest, ctx(n=7)), [[5, 5]] * 2)
    np.testing.assert_array_equal(Mimic(worker=2)(BYZ[:, :2], honest, ctx(n=7)), [[0, 1]] * 2)
    assert Mimic(worker=5).check(7, 2).key == "attack.worker" and Mimic(worker=4).check(7, 2) is None


# -- adaptive ----------------------------------------------------------------------------------

# columns: c0 margin 1, c1 margin -1, c2 (t = -1) margin 1, c3 and c4 out of reach, c5 mean 0
ADAPT_HONEST = np.array(
    [
        [1.0, 3.0, -3.0, 1.0, -1.0, 1.0],
        [1.0, -1.0, 1.0, 1.0, -1.0, 1.0],
        [1.0, -1.0, 1.0, 1.0, -1.0, -1.0],
        [-1.0, 1.0, -1.0, 1.0, -1.0, -1.0],
    ]
)
ADAPT_BYZ = np.array([[1.0, 1.0, -1.0, 1.0, 2.0, 3.0], [1.0, 1.0, -1.0, 1.0, -2.0, 0.5]])


def test_adaptive_brace_closed_form():
    out = Adaptive()(ADAPT_BYZ, ADAPT_HONEST, ctx(n=6))
    np.testing.assert_allclose(out, [[-0.501, -0.501, 0.501, -0.001, 0.001, 0.0]] * 2)
    mu = ADAPT_HONEST.mean(0)
    assert np.all(np.sign(out[:, mu != 0]) == -np.sign(mu[mu != 0]))


@pytest.mark.parametrize("budget, flipped", [(1.0, [1, 0, 2]), (0.5, [1, 0]), (0.3, [1])])
def test_adaptive_brace_margin_flips_smallest_margins_first(budget, flipped):
    lam = 1.0
    np.testing.assert_array_equal(brace_margin_flips(ADAPT_BYZ, ADAPT_HONEST, lam, budget), flipped)
    out = Adaptive(mode="margin", lam=lam, budget=budget)(ADAPT_BYZ, ADAPT_HONEST, ctx(n=6))
    keep = np.setdiff1d(np.arange(6), flipped)
    np.testing.assert_array_equal(out[:, keep], ADAPT_BYZ[:, keep])
    np.testing.assert_array_equal(out[:, flipped], np.tile(-ADAPT_HONEST.mean(0)[flipped], (2, 1)))
    before, after = brace(np.vstack([ADAPT_BYZ, ADAPT_HONEST]), lam), brace(np.vstack([out, ADAPT_HONEST]), lam)
    np.testing.assert_array_equal(np.flatnonzero(before != after), sorted(flipped))


def test_adaptive_brace_margin_matches_closed_form_damage_and_exhausts_the_attackers_votes():
    rng = np.random.default_rng(10)
    lam, b = 1.0, 3
    honest = rng.normal(0.05, 1, (12, 400))
    byz = rng.normal(0.05, 1, (b, 400))
    t = np.sign(honest.mean(0))
    wrong = lambda G: int(np.sum((brace(G, lam) != t) & (t != 0)))  # noqa: E731
    margin = Adaptive(mode="margin", lam=lam)(byz, honest, ctx(n=15))
    closed = Adaptive()(byz, honest, ctx(n=15))
    assert wrong(np.vstack([margin, honest])) == wrong(np.vstack([closed, honest])) > wrong(np.vstack([byz, honest]))
    # brute force: no vote pattern of the b attackers turns any further coordinate away from t
    after = brace(np.vstack([margin, honest]), lam)
    s_honest = np.sign(honest).sum(0)
    reachable_wrong = np.zeros(400, bool)
    for votes in range(-b, b + 1):
        reachable_wrong |= np.where(s_honest + votes > lam, 1.0, -1.0) != t
    np.testing.assert_array_equal((after != t)[t != 0], reachable_wrong[t != 0])


def test_adaptive_generic_line_search_on_mean_expands_every_time():
    # deviation of the mean grows with gamma: 15 expansion steps 1 + 2 + ... + 2^14
    rng = np.random.default_rng(11)
    honest, byz = rng.normal(0.3, 1, (6, 5)), rng.normal(0.3, 1, (2, 5))
    out = Adaptive(target="generic")(byz, honest, ctx(n=8, aggregator=lambda G: G.mean(0)))
    mu = honest.mean(0)
    np.testing.assert_allclose(out, np.tile(mu - (2**15 - 1) * mu / np.linalg.norm(mu), (2, 1)))


def test_adaptive_generic_against_median_beats_no_attack():
    rng = np.random.default_rng(12)
    honest, byz = rng.normal(0.3, 1, (7, 50)), rng.normal(0.3, 1, (3, 50))
    ref = median(np.vstack([byz, honest]))
    for pert in ("unit_vec", "sign", "std", "mean"):
        out = Adaptive(target="generic", perturbation=pert)(byz, honest, ctx(n=10, aggregator=median))
        moved = np.linalg.norm(median(np.vstack([out, honest])) - ref)
        honest_mean_sent = np.linalg.norm(median(np.vstack([np.tile(honest.mean(0), (3, 1)), honest])) - ref)
        assert moved >= honest_mean_sent and moved > 0, pert
    with pytest.raises(ConfigError, match="needs the defence"):
        Adaptive(target="generic")(byz, honest, ctx(n=10))


def test_line_maximize_finds_an_interior_maximum():
    calls = []

    def objective(x):
        calls.append(x)
        return -((x - 5.3) ** 2)

    best = line_maximize(objective, evals=16)
    assert len(calls) == 16 and min(calls) >= 0 and abs(best - 5.3) < 0.3


# -- data attacks ------------------------------------------------------------------------------


def test_labelflip_default_map_is_an_involution():
    y = np.arange(10).repeat(3)
    x = np.zeros((30, 1, 2, 2), np.float32)
    x1, y1 = LabelFlip().poison(x, y, None)
    assert x1 is x
    np.testing.assert_array_equal(y1, 9 - y)
    np.testing.assert_array_equal(LabelFlip().poison(x, y1, None)[1], y)
    mapped = LabelFlip(num_classes=3, mapping=[1, 1, 0]).poison(x[:3], np.array([0, 1, 2]), None)[1]
    np.testing.assert_array_equal(mapped, [1, 1, 0])
    with pytest.raises(ValueError, match="labels must be integers"):
        LabelFlip().poison(x[:2], np.array([0, 10]), None)
    with pytest.raises(ValueError, match="labels must be integers"):
        LabelFlip().poison(x[:2], np.array([0.0, 1.0]), None)


def test_backdoor_trigger_pixels():
    bd = Backdoor(scale=1)
    x = np.zeros((2, 1, 28, 28), np.float32)
    stamped = bd.stamp(x)
    assert stamped.dtype == np.float32 and stamped.any() and not x.any()
    rows, cols = np.nonzero(stamped[0, 0])
    assert sorted(zip(rows.tolist(), cols.tolist())) == [(24, 26), (25, 25), (26, 24), (26, 26)]
    np.testing.assert_array_equal(stamped[0], stamped[1])
    tiny = Backdoor(scale=1, value=0.5).stamp(np.ones((1, 3, 4, 4)))
    assert (tiny == 0.5).sum() == 3 * 4 and (tiny[:, 0] == 0.5).sum() == 4
    np.testing.assert_array_equal(Backdoor(scale=1, value=3.0).stamp(np.zeros((2, 6))), [[0, 0, 3, 3, 3, 3]] * 2)
    with pytest.raises(ValueError, match="cannot stamp"):
        bd.stamp(np.zeros((2, 3)))


def test_backdoor_poisons_the_given_fraction_reproducibly():
    bd = make_attack("backdoor", {}, n_clients=20)
    assert (bd.scale, bd.target, bd.fraction) == (20.0, 0, 0.5)
    x = np.random.default_rng(0).random((32, 1, 28, 28), dtype=np.float32)
    y = np.arange(32) % 10
    px, py = bd.poison(x, y, np.random.default_rng(5))
    triggered = np.all(px[:, 0, [26, 24, 26, 25], [26, 26, 24, 25]] == 1.0, axis=1)
    changed = np.any(px != x, axis=(1, 2, 3))
    assert triggered.sum() == 16 and np.array_equal(changed, triggered)
    np.testing.assert_array_equal(py[triggered], 0)
    np.testing.assert_array_equal(py[~triggered], y[~triggered])
    qx, qy = bd.poison(x, y, np.random.default_rng(5))
    np.testing.assert_array_equal(px, qx)
    np.testing.assert_array_equal(py, qy)
    assert Backdoor(scale=1, fraction=1 / 3).poison(x[:3], y[:3], np.random.default_rng(0))[1].tolist().count(0) >= 1


def test_attack_success_rate_hand_case():
    y_true = np.array([0, 0, 1, 2, 3, 4, 5, 0])
    pred = np.array([0, 3, 0, 0, 3, 0, 1, 0])
    # non-target samples: labels 1, 2, 3, 4, 5 -> predicted 0, 0, 3, 0, 1: 3 of 5
    assert attack_success_rate(pred, y_true, 0) == 0.6
    # target 3: seven samples of other classes, one of them (a 0) predicted 3
    assert attack_success_rate(pred, y_true, 3) == 1 / 7
    assert math.isnan(attack_success_rate(np.array([1, 1]), np.array([0, 0]), 0))


@pytest.mark.parametrize("d", [1, 2, 5, 6, 7, 64])
def test_blocked_std_is_numpy_std_bit_for_bit(d):
    # blocks of 5 columns: d = 6 leaves a last block of one column, which joins the one before
    x = np.random.default_rng(d).standard_normal((17, d)) * np.logspace(-3, 6, d)
    for ddof in (0, 1):
        assert np.array_equal(std(x, ddof, "test", block=5), x.std(axis=0, ddof=ddof))
    assert std(x.astype(np.float32), 1, "test", block=5).dtype == np.float64  # float64 statistics of float32 rows
