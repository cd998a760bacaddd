"""BRACE and the sign-voting family over the ring: exact results, exact bytes, relay attacks, the check."""

import numpy as np
import pytest
from conftest import run_mpi

from fedring.comm import Layout, Network, block_bounds
from fedring.comm.brace import SignVote, count_dtype, paper_bytes
from fedring.errors import ConfigError

CLIENTS = [2, 3, 5, 8, 100]
CONFIGS = [
    ("brace", {}),
    ("brace", {"lambda": 0}),
    ("brace", {"lambda": -1.5}),
    ("brace", {"lambda": 2.5, "sign_zero": 1}),
    ("brace", {"lambda": 1, "rule": "symmetric"}),
    ("brace", {"lambda": 0, "rule": "symmetric", "sign_zero": -1}),
    ("signsgd", {}),
    ("rlr", {"theta": 2}),
    ("rlr", {}),
]


def sign_matrix(n: int, d: int, seed) -> np.ndarray:
    """Random gradients whose signs are a random matrix with zeros (and varied magnitudes)."""
    rng = np.random.default_rng(seed)
    signs = rng.integers(-1, 2, (n, d))
    return (signs * rng.uniform(0.01, 100.0, (n, d))).astype(np.float32)


def expected(rule: str, params: dict, G: np.ndarray) -> np.ndarray:
    """The centralized formulas, written independently of the module (eqs. (1)-(3), signSGD's sign(S), RLR's reversed step)."""
    sz = params.get("sign_zero", 0)
    q = np.sign(G)
    q[q == 0] = sz
    S = q.sum(axis=0)
    lam = params.get("lambda", 5)
    if rule == "brace" and params.get("rule", "paper") == "paper":
        return np.where(S > lam, 1.0, -1.0)  # eq. (1)
    if rule == "brace":
        return np.where(S > lam, 1.0, np.where(S < -lam, -1.0, 0.0))
    if rule == "signsgd":
        return np.sign(S)
    theta = params.get("theta", np.ceil(0.2 * G.shape[0]))
    return np.where(np.abs(S) >= theta, 1.0, -1.0) * np.sign(S)


def run(rule, n, G, params=None, **kw):
    """One round of ``rule``: (the update, the rule, the network, the round's :class:`~fedring.comm.ring.Aggregation`)."""
    vote = SignVote(rule, n, params or {}, **kw)
    net = Network(Layout(n))
    res = vote.aggregate(net, G.copy())
    return res.update, vote, net, res


def expected_bytes(n: int, d: int, planes: int, itemsize: int) -> np.ndarray:
    """Client i sends every count chunk but (i+1) and every packed chunk but (i+2) (docs/brace.md)."""
    sizes = np.diff(block_bounds(d, n))
    packed = planes * (-(-sizes // 8))
    i = np.arange(n)
    return (itemsize * (d - sizes[(i + 1) % n]) + packed.sum() - packed[(i + 2) % n]) * (n > 1)


# ---------------------------------------------------------------- exact results


@pytest.mark.parametrize("n", CLIENTS)
@pytest.mark.parametrize("rule,params", CONFIGS)
def test_ring_equals_centralized_formula(n, rule, params):
    G = sign_matrix(n, 257, [n, len(params)])
    out, vote, _, _res = run(rule, n, G, params)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected(rule, params, G))
    np.testing.assert_array_equal(out, vote.centralized(G))


@pytest.mark.parametrize("d", [0, 1, 3, 17])
def test_fewer_coordinates_than_clients(d):
    G = sign_matrix(8, d, d)
    for rule, params in CONFIGS:
        np.testing.assert_array_equal(run(rule, 8, G, params)[0], expected(rule, params, G))


def test_one_client():
    G = np.array([[3.0, -1.0, 0.0]], np.float32)
    assert run("brace", 1, G, {"lambda": 0})[0].tolist() == [1, -1, -1]
    assert run("signsgd", 1, G)[0].tolist() == [1, -1, 0]


def test_more_than_127_clients_use_int16_counts():
    n, d = 130, 300
    G = sign_matrix(n, d, 3)
    G[:, :5] = 1.0  # S = 130 > 127 must not wrap
    for rule, params in [("brace", {}), ("signsgd", {})]:
        out, vote, net, _res = run(rule, n, G, params)
        assert vote.dtype == np.int16
        np.testing.assert_array_equal(out, expected(rule, params, G))
        np.testing.assert_array_equal(net.ledger.client_bytes(), expected_bytes(n, d, vote.bits, 2))


def test_paper_figure_1_and_magnitude_invariance():
    """The paper's Fig. 1 gradients, lambda = 2 -> S = [3, 1, 1], GAR = [+1, -1, -1]; -10 -> -200 changes nothing."""
    G = np.array([[5, 2, -10], [8, -4, 7], [9, 3, 8]], np.float32)
    assert run("brace", 3, G, {"lambda": 2})[0].tolist() == [1, -1, -1]
    G[0, 2] = -200
    assert run("brace", 3, G, {"lambda": 2})[0].tolist() == [1, -1, -1]
    assert run("brace", 3, G, {"lambda": 0})[0].tolist() == [1, 1, 1]
    assert run("signsgd", 3, G)[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize("rule,params", CONFIGS)
def test_positive_diagonal_scaling_changes_nothing(rule, params):
    n, d = 8, 100
    G = sign_matrix(n, d, 11)
    D = np.random.default_rng(12).uniform(1e-3, 1e3, (n, d)).astype(np.float32)
    np.testing.assert_array_equal(run(rule, n, G, params)[0], run(rule, n, G * D, params)[0])


def test_brace_at_zero_threshold_is_signsgd_except_ties():
    """Where S = 0 BRACE gives -1, signSGD 0."""
    n = 8
    G = sign_matrix(n, 500, 5)
    S = np.sign(G).sum(0)
    brace, sgd = run("brace", n, G, {"lambda": 0})[0], run("signsgd", n, G)[0]
    assert np.any(S == 0)
    np.testing.assert_array_equal(brace[S != 0], sgd[S != 0])
    assert np.all(brace[S == 0] == -1) and np.all(sgd[S == 0] == 0)


@pytest.mark.parametrize("n", [5, 8, 130])
def test_degenerate_thresholds(n):
    """lambda >= n gives all -1, lambda < -n all +1 (also beyond the count type's range)."""
    G = np.ones((n, 50), np.float32)
    G[:, ::2] = -1.0
    for lam in (n, n + 0.5, 10**6):
        assert np.all(run("brace", n, G, {"lambda": lam})[0] == -1)
    for lam in (-n - 0.5, -(10**6)):
        assert np.all(run("brace", n, G, {"lambda": lam})[0] == 1)


def test_rlr_properties():
    """RLR = signSGD when every |S| >= theta, = -signSGD when theta > n; both odd."""
    n = 8
    G = sign_matrix(n, 400, 9)
    S = np.sign(G).sum(0)
    sgd = run("signsgd", n, G)[0]
    low = int(np.abs(S[S != 0]).min())
    keep = S != 0
    np.testing.assert_array_equal(run("rlr", n, G, {"theta": 0})[0], sgd)
    np.testing.assert_array_equal(run("rlr", n, G, {"theta": low})[0][keep], sgd[keep])
    np.testing.assert_array_equal(run("rlr", n, G, {"theta": n + 1})[0], -sgd)
    for rule, params in [("rlr", {"theta": 3}), ("signsgd", {})]:
        np.testing.assert_array_equal(run(rule, n, -G, params)[0], -run(rule, n, G, params)[0])
    # BRACE is not odd: all-positive votes with n <= lambda give -1, and so do all-negative ones.
    ones = np.ones((3, 4), np.float32)
    assert run("brace", 3, ones)[0].tolist() == run("brace", 3, -ones)[0].tolist() == [-1] * 4


def test_rlr_default_theta_is_a_fifth_of_the_clients():
    assert SignVote("rlr", 100, {}).theta == 20
    assert SignVote("rlr", 20, {}).theta == 4


def test_docstring_examples():
    import doctest

    import fedring.comm.brace

    assert doctest.testmod(fedring.comm.brace).failed == 0


def test_update_geometry_of_the_paper_rule():
    """Eq. (4): every coordinate moves by exactly lr."""
    out = run("brace", 8, sign_matrix(8, 999, 1))[0]
    assert np.all(np.abs(out) == 1)


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 100])
@pytest.mark.parametrize("d", [0, 1, 17, 1000, 4099])
def test_bytes_equal_encoding_arithmetic(n, d):
    G = sign_matrix(n, d, [n, d])
    for rule, params in [("brace", {}), ("brace", {"rule": "symmetric"}), ("signsgd", {}), ("rlr", {})]:
        _, vote, net, _res = run(rule, n, G, params)
        assert vote.bits == (1 if params == {} and rule == "brace" else 2)
        np.testing.assert_array_equal(net.ledger.client_bytes(), expected_bytes(n, d, vote.bits, 1))
        assert set(net.ledger.clients) <= {"share_reduce", "share_only"}


def test_bytes_beat_float32_ring_and_paper_formula():
    """FMNIST CNN size, n = 100: <= d(n-1)/n * 9/8 + chunk rounding; >= 7x under the float32 ring."""
    n, d = 100, 139_960
    _, _vote, net, res = run("brace", n, sign_matrix(n, d, 0))
    sent = net.ledger.client_bytes()
    assert sent.max() <= d * (n - 1) / n * 9 / 8 + (n - 1)
    ring = 2 * 4 * d * (n - 1) / n
    assert ring / sent.max() >= 7.0
    assert paper_bytes(n, d) / sent.max() >= 3.6
    assert res.figures["paper_formula_bytes"] == pytest.approx(4_572_493.2 / 8)
    assert sent.sum() == d * (n - 1) + sum(-(-np.diff(block_bounds(d, n)) // 8)) * (n - 1)


def test_count_dtype():
    assert [count_dtype(n) for n in (1, 127, 128, 32767, 32768)] == [np.int8, np.int8, np.int16, np.int16, np.int32]


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    "rule,params,key",
    [
        ("brace", {"lamda": 5}, "brace.lamda"),
        ("brace", {"theta": 5}, "brace.theta"),
        ("signsgd", {"lambda": 5}, "signsgd.lambda"),
        ("brace", {"lambda": "five"}, "brace.lambda"),
        ("brace", {"lambda": float("nan")}, "brace.lambda"),
        ("brace", {"rule": "majority"}, "brace.rule"),
        ("brace", {"rule": "symmetric", "lambda": -1}, "brace.lambda"),
        ("brace", {"sign_zero": 2}, "brace.sign_zero"),
        ("brace", {"check": "yes"}, "brace.check"),
        ("rlr", {"theta": -1}, "rlr.theta"),
        ("rlr", {"theta": 2.5}, "rlr.theta"),
        ("brace", {"relay_attack": "drop"}, "brace.relay_attack"),
        ("brace", {"relay_bias": 0}, "brace.relay_bias"),
        ("brace", {"relay_flip_prob": 1.5}, "brace.relay_flip_prob"),
        ("brace", {"relay_clients": [0, 8]}, "brace.relay_clients"),
        ("brace", {"relay_clients": [1, 1]}, "brace.relay_clients"),
        ("median", {}, "aggregator"),
    ],
)
def test_bad_settings_name_the_key(rule, params, key):
    with pytest.raises(ConfigError) as err:
        SignVote(rule, 8, params)
    assert err.value.key == key


def test_check_accepts_booleans():
    assert SignVote("brace", 4, {"check": True}).check and not SignVote("brace", 4, {"check": False}).check


# ---------------------------------------------------------------- the integrity check and relay attacks


@pytest.mark.parametrize("n", [2, 3, 5, 8, 100])
@pytest.mark.parametrize("sign_zero", [0, 1, -1])
def test_check_never_flags_an_honest_run(n, sign_zero):
    for rule, params in CONFIGS if n < 100 else [CONFIGS[0], CONFIGS[4], CONFIGS[7]]:
        params = {**params, "sign_zero": sign_zero, "check": "on"}
        G = sign_matrix(n, 203, [n, 7])
        out, _vote, _, res = run(rule, n, G, params)
        np.testing.assert_array_equal(out, expected(rule, params, G))
        assert res.figures["integrity_detections"] == 0
        assert not res.rows["detections"].any()


def relay_round(n, d, relays, params, seed=0):
    G = sign_matrix(n, d, seed)
    return run("brace", n, G, {"relay_clients": relays, **params})


@pytest.mark.parametrize(
    "sign_zero,bias",
    [(1, 1), (-1, -3), (1, 2 * 100 + 2), (0, 2 * 100 + 1), (0, -(2 * 100 + 1))],
)
def test_check_flags_every_tampered_hop(sign_zero, bias):
    """Odd biases break the parity (sign_zero = +-1); |bias| > 2n breaks the range. Relays not adjacent."""
    n, d = 20, 1000
    relays = [2, 7, 11, 19]
    attack = {"relay_attack": "bias", "relay_bias": bias, "sign_zero": sign_zero, "check": "on"}
    _, _vote, _, res = relay_round(n, d, relays, attack)
    detections = res.rows["detections"]
    expect = np.zeros(n, np.int64)
    expect[relays] = n - 1  # every relay forwards n - 1 non-empty partials
    np.testing.assert_array_equal(detections, expect)
    m = res.figures
    assert m["relay_tampered_hops"] == m["integrity_detections"] == 4 * (n - 1)
    sizes = np.diff(block_bounds(d, n))
    assert m["integrity_flagged_counts"] == sum(d - sizes[(i + 1) % n] for i in relays)


def test_check_discards_a_detected_bias():
    """n = 3, relay 0 adds 100 (sign(0) = 0). Without the check S = [101, 1, 101]; with it the
    tampered counts are dropped at the receiver: S = [q1 + q2, S_1, q1] = [0, 1, 1]."""
    G = np.array([[1, -1, 1], [-1, 1, 1], [1, 1, -1]], np.float32)
    params = {"lambda": 0, "relay_attack": "bias", "relay_bias": 100, "relay_clients": [0]}
    off, _vote_off, _, res_off = run("brace", 3, G, params)
    on, _vote_on, _, res_on = run("brace", 3, G, {**params, "check": "on"})
    assert off.tolist() == [1, 1, 1]
    assert on.tolist() == [-1, 1, 1]
    assert res_on.rows["detections"].tolist() == [2, 0, 0]
    assert res_off.figures["relay_tampered_hops"] == 2


def test_check_cannot_see_a_parity_keeping_bias_in_range():
    """The documented blind spot: bias 2 with every count far from the range edge passes."""
    n, d = 8, 64
    G = np.ones((n, d), np.float32)
    G[::2] = -1.0  # partial counts alternate 1, 0, 1, 0 ...: +2 keeps them in range and parity
    out, _vote, _, res = run(
        "brace",
        n,
        G,
        {"lambda": 0, "sign_zero": 1, "check": "on", "relay_attack": "bias", "relay_bias": 2, "relay_clients": [3]},
    )
    assert res.figures["relay_tampered_hops"] == n - 1
    assert res.figures["integrity_detections"] < n - 1
    assert np.any(out == 1)  # honest S = 0 gives -1 everywhere: the undetected bias moved votes


def test_adjacent_relays_pass_the_parity_test():
    """Relays 3 and 4 each add 1: 4's receiver sees +2 on every partial that passed 3 (parity kept);
    3's receiver is Byzantine and checks nothing. Only relay 4's own one-vote partial is caught."""
    n, d = 8, 64
    G = np.ones((n, d), np.float32)
    G[::2] = -1.0
    _, _vote, _, res = run(
        "brace", n, G, {"sign_zero": 1, "check": "on", "relay_attack": "bias", "relay_bias": 1, "relay_clients": [3, 4]}
    )
    assert res.rows["detections"].tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert res.figures["relay_tampered_hops"] == 2 * (n - 1)


def test_saturation_instead_of_wraparound():
    """int8 counts: a relay adding 127 to 100 unanimous votes must saturate, not wrap negative."""
    n, d = 100, 500
    for sign in (1.0, -1.0):
        G = np.full((n, d), sign, np.float32)
        params = {"lambda": 0, "relay_attack": "bias", "relay_bias": int(sign * 127), "relay_clients": [10, 50]}
        out, vote, _, _res = run("brace", n, G, params)
        assert vote.dtype == np.int8
        assert np.all(out == sign)


def test_flip_attack_reaches_the_clients_downstream_of_the_first_relay():
    """n = 5, chunks of 2 coordinates; the run follows client 0. Relay 2 flips the chunks owned by
    clients 1 and 2 on their way to 0 (chunks 2, 3); relays {2, 3} add chunk 4 (owned by 3), and
    relay 3 does not undo relay 2's flips."""
    n, d = 5, 10
    G = sign_matrix(n, d, 4)
    honest = run("brace", n, G, {"lambda": 0})[0]
    for relays, chunks in [([2], [2, 3]), ([2, 3], [2, 3, 4])]:
        out, _vote, _, res = run(
            "brace", n, G, {"lambda": 0, "relay_attack": "flip", "relay_clients": relays, "check": "on"}
        )
        flipped = np.zeros(d, bool)
        for c in chunks:
            flipped[2 * c : 2 * c + 2] = True
        np.testing.assert_array_equal(out, np.where(flipped, -honest, honest))
        assert res.figures["integrity_detections"] == 0  # Share-Only carries no redundancy
    # the owner 2 flips its own chunk on all 4 hops, relay 3 only its own chunk (s = 0)
    assert res.figures["relay_tampered_hops"] == 5
    assert res.figures["relay_flipped_signs"] == 10


def test_flip_attack_on_three_valued_consensus_keeps_zeros():
    n, d = 4, 40
    G = sign_matrix(n, d, 8)
    honest = run("signsgd", n, G)[0]
    out = run("signsgd", n, G, {"relay_attack": "flip", "relay_clients": [1]})[0]
    assert np.any(honest == 0)
    np.testing.assert_array_equal(out == 0, honest == 0)
    assert np.any(out != honest)


def test_flip_probability_is_seeded():
    n, d = 8, 16000
    G = sign_matrix(n, d, 2)
    honest = run("brace", n, G)[0]
    params = {"relay_attack": "flip", "relay_flip_prob": 0.25, "relay_clients": [2]}
    a = run("brace", n, G, params, seed=1)[0]
    b = run("brace", n, G, params, seed=1)[0]
    c = run("brace", n, G, params, seed=2)[0]
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)
    # relay 2 lies between client 0 and the owners of chunks 2 and 3 (clients 1, 2): 4000 coordinates
    frac = np.mean(a != honest) / (2 / 8)
    assert abs(frac - 0.25) < 0.05  # binomial sd 0.0068 over 4000 draws: 7 sd
    assert np.array_equal(run("brace", n, G, {**params, "relay_flip_prob": 0.0})[0], honest)


def test_attacks_without_relays_are_honest():
    G = sign_matrix(8, 100, 1)
    for attack in ("bias", "flip"):
        np.testing.assert_array_equal(run("brace", 8, G, {"relay_attack": attack})[0], expected("brace", {}, G))


def test_set_byzantine_replaces_relay_clients():
    vote = SignVote("brace", 8, {"relay_attack": "flip", "relay_clients": [1]})
    vote.set_byzantine(np.array([3, 5]))
    assert np.flatnonzero(vote.is_byzantine).tolist() == [3, 5]
    assert vote.gap[3] == 6 and vote.gap[5] == 2


# ---------------------------------------------------------------- several MPI ranks

MPI_SCRIPT = """
import sys, numpy as np
from mpi4py import MPI
from fedring.comm import Layout, Network
from fedring.comm.brace import SignVote
sys.path.insert(0, "tests")
from test_brace import CONFIGS, expected, expected_bytes, sign_matrix
comm = MPI.COMM_WORLD
ATTACKS = [
    {"relay_attack": "bias", "relay_bias": 3, "sign_zero": 1, "check": "on", "relay_clients": [1, 4]},
    {"relay_attack": "bias", "relay_bias": 2, "check": "on", "relay_clients": [0, 1, 6]},
    {"relay_attack": "flip", "relay_flip_prob": 0.5, "check": "on", "relay_clients": [0, 2, 3]},
]
for n in [2, 3, 5, 8, 100]:
    if n < comm.size:
        continue
    lay = Layout(n)
    d = 50 if n == 100 else 301
    G = sign_matrix(n, d, [n, 1])
    configs = CONFIGS if n < 100 else CONFIGS[:1] + CONFIGS[6:8]
    configs = configs + ([("brace", a) for a in ATTACKS] if n == 8 else [])
    for rule, params in configs:
        vote, net = SignVote(rule, n, params), Network(lay)
        res = vote.aggregate(net, G[lay.lo:lay.hi].copy())
        out = res.update
        outs = comm.allgather(out)
        assert all(np.array_equal(o, out) for o in outs), "ranks disagree"
        alone = SignVote(rule, n, params).aggregate(Network(Layout(n, comm=MPI.COMM_SELF)), G.copy())
        ref = alone.update
        assert np.array_equal(out, ref), (n, rule, params)
        if "relay_attack" not in params:
            assert np.array_equal(out, expected(rule, params, G)), (n, rule, params)
        sent, _ = net.gather_ledger()
        metrics, rows = res.figures, res.rows
        if comm.rank == 0:
            assert np.array_equal(sent, expected_bytes(n, d, vote.bits, 1)), (n, rule)
            assert metrics == alone.figures, (metrics, alone.figures)
            for key in rows:
                assert np.array_equal(rows[key], alone.rows[key])
if comm.rank == 0:
    print("OK")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_over_mpi_ranks(tmp_path, ranks):
    script = tmp_path / "brace_mpi.py"
    script.write_text(MPI_SCRIPT)
    assert "OK" in run_mpi(ranks, [str(script)], timeout=240).stdout
