"""The attacks' column-block float64 arithmetic (fedring.attacks.base.columns) gives, bit for bit,
what the same attacks compute on float64 copies of the rows in one piece: rank 0 of a run keeps
the rows in float32 (docs/figures.md, "Memory at ResNet-18 size") and results stay identical."""

import numpy as np
import pytest

from fedring.attacks import AttackContext, ModelAttack, alie_z, fang, make_attack, mimic, minmax
from fedring.attacks import base as attack_base
from fedring.attacks.base import column_blocks, column_sum, columns, mean, std

H, B, D = 37, 5, 23  # more than 8 rows: numpy's pairwise summation of one column would differ

ATTACKS = [
    ("alie", {}),
    ("alie", {"jitter": 0.05, "ddof": 0}),
    ("alie", {"stats": "byzantine"}),
    ("minmax", {}),
    ("minmax", {"perturbation": "unit_vec"}),
    ("minmax", {"perturbation": "sign"}),
    ("minsum", {}),
    ("minsum", {"bound": "min", "perturbation": "unit_vec"}),
    ("ipm", {}),
    ("ipm", {"jitter": 0.05}),
    ("foe", {}),
    ("hplus_attack", {}),
    ("mimic", {}),
    ("mimic", {"worker": 3}),
    ("signflip", {"source": "mean"}),
    ("signflip", {"source": "sum", "scale": 3.0}),
    ("signflip", {}),
    ("scaling", {}),
    ("scaling", {"source": "sum"}),
    ("scaling", {"source": "own"}),
    ("fang_krum", {}),
    ("fang_krum", {"variant": "partial"}),
    ("fang_trim", {}),
    ("fang_trim", {"variant": "partial"}),
    ("adaptive", {}),
    ("adaptive", {"mode": "margin", "lam": 0.3, "budget": 0.5}),
    ("adaptive", {"target": "generic", "evals": 6}),
    ("adaptive", {"target": "generic", "perturbation": "std", "evals": 6}),
]


def rows(seed):
    """float32 rows of very different scales per column, some -0.0 and exact ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((H + B, D)) * np.logspace(-4, 5, D) + rng.standard_normal(D)).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = -0.0
    x[3] = x[7]
    return x[:B].copy(), x[B:].copy()


def context(seed):
    median = lambda X: np.median(X, axis=0)  # noqa: E731
    return AttackContext(np.random.default_rng(seed), n=H + B, f=B, lr=0.1, round=3, aggregator=median)


@pytest.mark.parametrize("name, params", ATTACKS, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in ATTACKS])
def test_blockwise_attack_matches_its_float64_computation_in_one_piece(name, params, monkeypatch):
    attack = make_attack(name, dict(params), n_clients=H + B)
    assert isinstance(attack, ModelAttack) and attack.blockwise
    byz, honest = rows(len(name) + len(params))
    before = byz.copy(), honest.copy()
    monkeypatch.setattr(attack_base, "BLOCK", 1 << 30)
    honest64 = honest.astype(np.float64)
    whole = attack(byz.astype(np.float64), honest64, context(1))
    assert np.array_equal(honest64, honest)  # not the attack's to overwrite
    for block in (2, 3, 5, 22, 64):  # 23 columns: a last block of 1 (joined), 2, 3, 1 (joined), none
        monkeypatch.setattr(attack_base, "BLOCK", block)
        # float64 Byzantine rows give float64 results: no rounding to float32 hides a difference
        out = attack(byz.astype(np.float64), honest, context(1))
        assert out.tobytes() == whole.tobytes(), (block, np.flatnonzero(out != whole))
        out = attack(byz, honest, context(1))
        assert out.dtype == np.float32 and out.shape == (B, D) and out.flags.writeable and out.base is None
        assert out.tobytes() == whole.astype(np.float32).tobytes()
    assert np.array_equal(byz, before[0]) and np.array_equal(honest, before[1])  # inputs untouched


def test_one_piece_results_are_the_former_formulas():
    """With one block the attacks compute what they did on float64 arrays before: ALIE, IPM and
    Fang's trim attack (whose random factors are now drawn row by row) by their formulas."""
    byz, honest = rows(0)
    b64, h64 = byz.astype(np.float64), honest.astype(np.float64)
    out = make_attack("alie", {"jitter": 0.1})(byz, honest, context(2))
    jitter = np.random.default_rng(2).uniform(-0.1, 0.1, size=(B, 1))
    expect = h64.mean(axis=0) + (alie_z(H + B, B) + jitter) * h64.std(axis=0, ddof=1)
    assert out.tobytes() == expect.astype(np.float32).tobytes()
    out = make_attack("ipm", {"epsilon": 0.7})(byz, honest, context(2))
    assert out.tobytes() == (-np.full((B, 1), 0.7) * h64.mean(axis=0)).astype(np.float32).tobytes()
    out = make_attack("fang_trim", {"b": 3.0})(byz, honest, context(2))
    both = np.vstack([b64, h64])
    s = np.sign(both.sum(axis=0))
    base = np.where(s > 0, both.min(axis=0), both.max(axis=0))
    r = np.random.default_rng(2).uniform(1.0, 3.0, size=(B, D))
    assert out.tobytes() == np.where(s * base > 0, base / r, base * r).astype(np.float32).tobytes()
    out = make_attack("fang_trim", {"variant": "partial"})(byz, None, context(2))
    mu, sigma = b64.mean(axis=0), b64.std(axis=0)
    u = np.random.default_rng(2).uniform(3.0, 4.0, size=(B, D))
    assert out.tobytes() == (mu - np.sign(mu) * sigma * u).astype(np.float32).tobytes()


def former_gram(rows64):
    """0.3.0's Gram path: a float64 copy of every row, centred in place, one product."""
    centred = rows64.copy()
    centred -= centred.mean(axis=0)
    gram = centred @ centred.T
    sq = np.diag(gram).copy()
    return centred, gram, sq, np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)


def test_one_piece_gram_results_are_the_former_ones():
    """Up to GRAM_BLOCK columns Min-Max's γ, Min-Sum's γ, Fang's λ and Mimic's target come from
    the same float64 products as in 0.3.0, which held every honest row in float64: bit for bit."""
    for seed in range(4):
        _, honest = rows(seed)
        h64 = honest.astype(np.float64)
        centred, gram, sq, pair = former_gram(h64)
        dev = minmax.perturbation(honest, "std")
        lin, quad = centred @ dev, float(dev @ dev)
        for kind, limit, reduce in (("minmax", pair.max(), np.max), ("minsum", pair.sum(axis=1).max(), np.sum)):
            gamma, step, succ = 10.0, 10.0, 0.0
            while abs(succ - gamma) > 1e-5:
                if reduce(sq + 2 * gamma * lin + gamma**2 * quad) <= limit:
                    succ, gamma = gamma, gamma + step / 2
                else:
                    gamma -= step / 2
                step /= 2
            assert minmax.min_max_sum_gamma(honest, kind, dev) == succ
        assert mimic.mimic_target(honest) == int(np.argmax(np.abs(np.linalg.eigh(gram)[1][:, -1])))
        s = np.sign(h64.sum(axis=0))
        norms, sg = np.sqrt(np.einsum("ij,ij->i", h64, h64)), h64 @ s
        n, f = H + B, B
        k = n - f - 2
        nearest = np.sort(np.sqrt(pair), axis=1)[:, 1 : k + 1].sum(axis=1)
        lam = 0.1 * (nearest.min() / ((n - 2 * f - 1) * np.sqrt(D)) + norms.max() / np.sqrt(D))
        dist = np.zeros((n, n))
        dist[B:, B:] = pair
        while True:  # the copies first, Krum with n - f - 2 neighbours, ties to the lower index
            cross = np.maximum(norms**2 + (lam / 0.1) ** 2 * (s @ s) + 2.0 * (lam / 0.1) * sg, 0.0)
            dist[:B, B:], dist[B:, :B] = cross, cross[:, None]
            if int(np.argmin(np.sort(dist, axis=1)[:, 1 : k + 1].sum(axis=1))) < B or lam / 2 < 1e-5:
                break
            lam /= 2
        assert fang.fang_krum_lambda(honest, s, B, f, 0.1)[0] == lam


@pytest.mark.parametrize("name, params", [a for a in ATTACKS if a[0] in ("minmax", "minsum", "mimic", "fang_krum")])
def test_gram_summed_in_column_blocks_gives_the_same_rows(name, params, monkeypatch):
    """Above GRAM_BLOCK columns the Gram products are summed block by block and may differ from
    one product in their last bits; γ, λ and Mimic's target are decided by comparisons, which
    such a difference moves only where a tried value lies within round-off of the boundary.
    On these rows (columns 10^-4 to 10^5 apart in scale) the crafted rows are the same bit for
    bit at every block size, and the Gram matrix within 1e-13 of its one-product value."""
    attack = make_attack(name, dict(params), n_clients=H + B)
    byz, honest = rows(len(name) + len(params))
    whole = attack(byz, honest, context(1))
    for block in (2, 3, 5, 22):
        monkeypatch.setattr(attack_base, "GRAM_BLOCK", block)
        assert attack(byz, honest, context(1)).tobytes() == whole.tobytes(), block
        blocked = attack_base.row_products(honest, lambda c, x: (x @ x.T,))[0]
        one = honest.astype(np.float64) @ honest.astype(np.float64).T
        assert np.abs(blocked - one).max() <= 1e-13 * np.abs(one).max()


@pytest.mark.parametrize("d", [1, 2, 5, 6, 7, 11, 64])
@pytest.mark.parametrize("block", [2, 3, 5, 1 << 16])
def test_column_statistics_are_numpys_on_the_float64_array(d, block):
    x = (np.random.default_rng(d).standard_normal((41, d)) * np.logspace(-3, 6, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    cuts = column_blocks(d, block)
    assert [c.start for c in cuts] == sorted({c.start for c in cuts}) and cuts[-1].stop == d
    assert all(c.stop - c.start >= 2 for c in cuts) or d == 1
    assert columns(lambda a: a.mean(axis=0), x, block=block).tobytes() == x64.mean(axis=0).tobytes()
    assert (
        columns(lambda a: a.sum(axis=0), x[:9], x, block=block).tobytes() == np.vstack([x64[:9], x64]).sum(0).tobytes()
    )
    assert columns(lambda a: np.sign(a).sum(axis=0), x, block=block).tobytes() == np.sign(x64).sum(0).tobytes()
    for ddof in (0, 1):
        assert std(x, ddof, "test", block=block).tobytes() == x64.std(axis=0, ddof=ddof).tobytes()
    assert mean(x).tobytes() == x64.mean(axis=0).tobytes() and column_sum(x).tobytes() == x64.sum(0).tobytes()


def test_column_blocks_join_a_last_single_column():
    assert column_blocks(7, 3) == [slice(0, 3), slice(3, 7)]
    assert column_blocks(6, 3) == [slice(0, 3), slice(3, 6)]
    assert column_blocks(1, 3) == [slice(0, 1)]
    assert column_blocks(0, 3) == []


def test_an_attack_that_is_not_blockwise_still_gets_float64_rows():
    """A plugin written for float64 arrays (ModelAttack's default) sees float64 copies."""

    class Seen(ModelAttack):
        name = "seen"
        knowledge = "omniscient"

        def craft(self, byz, honest, ctx):
            assert byz.dtype == honest.dtype == np.float64
            return byz + honest[:1]

    byz, honest = rows(1)
    out = Seen()(byz, honest, context(0))
    assert out.dtype == np.float32
    assert out.tobytes() == (byz.astype(np.float64) + honest[:1].astype(np.float64)).astype(np.float32).tobytes()
