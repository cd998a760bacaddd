"""Client and server optimizers, BatchNorm statistics, shards and the validation split: hand-sized
cases whose every intermediate value is exact in float32 (dyadic), so each update is checked for
exact equality with the textbook formula."""

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from fedring.comm import Layout
from fedring.errors import ConfigError
from fedring.train.data import hold_out, partition, partition_shards
from fedring.train.optim import ClientOptimizer, clip, make_server_optimizer
from fedring.train.state import ModelBuffers

F32 = np.float32


def client_trajectory(opt: ClientOptimizer, w, grads, lr):
    """One local step per round, the server applying ``w <- w - lr * upload`` (mean of one client)."""
    w, state, out = np.array(w, F32), opt.init(1, len(w)), []
    for g in grads:
        u = opt.direction(state, 0, opt.gradient(np.array(g, F32), w))
        w = w - F32(lr) * u
        out.append(w.copy())
    return out


def test_heavy_ball_momentum_is_the_textbook_update():
    # m1 = g1 = [2, -4]; m2 = 0.5 m1 + g2 = [1, -2] + [2, 2] = [3, 0]; m3 = [1.5, 0] + [0, 4] = [1.5, 4]
    ws = client_trajectory(ClientOptimizer(momentum=0.5), [1, 1], [[2, -4], [2, 2], [0, 4]], lr=0.25)
    assert [w.tolist() for w in ws] == [[0.5, 2.0], [-0.25, 2.0], [-0.625, 1.0]]


def test_nesterov_uploads_gradient_plus_beta_times_momentum():
    # m1 = [2, -4], upload g1 + 0.5 m1 = [3, -6]; m2 = [3, 0], upload [2, 2] + [1.5, 0] = [3.5, 2]
    ws = client_trajectory(ClientOptimizer(momentum=0.5, nesterov=True), [1, 1], [[2, -4], [2, 2]], lr=0.25)
    assert [w.tolist() for w in ws] == [[0.25, 2.5], [-0.625, 2.0]]


def test_weight_decay_adds_lambda_w_before_momentum():
    # g1 + 0.5 w0 = [2, -4] + [0.5, 0.5] = [2.5, -3.5] = m1; w1 = [1, 1] - 0.5 m1 = [-0.25, 2.75]
    # g2 + 0.5 w1 = [0, 0] + [-0.125, 1.375]; m2 = 0.5 m1 + that = [1.125, -0.375]; w2 = w1 - 0.5 m2
    ws = client_trajectory(ClientOptimizer(momentum=0.5, weight_decay=0.5), [1, 1], [[2, -4], [0, 0]], lr=0.5)
    assert [w.tolist() for w in ws] == [[-0.25, 2.75], [-0.8125, 2.9375]]


def test_clipping_scales_to_the_norm_bound_and_then_decays():
    assert clip(np.array([3, 4], F32), 2.5).tolist() == [1.5, 2.0]  # ||g|| = 5 -> factor 0.5
    assert clip(np.array([3, 4], F32), 5.0).tolist() == [3.0, 4.0]  # on the sphere: unchanged
    assert clip(np.zeros(2, F32), 1.0).tolist() == [0.0, 0.0]
    # clipped first, then the decay term (torch's order: clip_grad_norm_, then SGD's weight decay)
    opt = ClientOptimizer(weight_decay=0.25, clip_norm=2.5)
    assert opt.gradient(np.array([3, 4], F32), np.array([4, -8], F32)).tolist() == [2.5, 0.0]
    # rows: each clipped on its own, the decay row by row
    rows = opt.gradient(np.array([[3, 4], [0.3, 0.4]], F32), np.array([[4, -8], [0, 4]], F32))
    assert rows.tolist() == [[2.5, 0.0], [np.float32(0.3), np.float32(0.4) + 1]]


@pytest.mark.parametrize(
    "g",
    [[3, 4], [0.3, 0.4], [2.5, 0], [0, 0], [np.nan, 1], [np.inf, 1], [-np.inf, 0], [1e30, 1e30]],
    ids=["outside", "inside", "on the sphere", "zero", "nan", "inf", "-inf", "float32 square overflows"],
)
def test_clipping_a_tensor_is_the_arrays_bits_without_reading_the_norm(g):
    """A tensor's factor is chosen on its device (no read of the norm): on these vectors its result is
    the array's bit for bit, a non-finite one included (NaN stays, infinity times 0 is NaN)."""
    with np.errstate(invalid="ignore"):  # infinity times 0
        a = clip(np.array(g, F32), 2.5)
    t = clip(torch.tensor(g, dtype=torch.float32), 2.5)
    assert np.array_equal(a.view(np.uint32), t.numpy().view(np.uint32))


def test_clipping_rows_clips_each_row_on_its_own():
    """Rows: each row as the vector alone, an array's row by row and a tensor's at once, bit for bit
    (the vectors of the test above, and rows of 1,000 random entries of which some are clipped)."""
    vectors = [[3, 4], [0.3, 0.4], [2.5, 0], [0, 0], [np.nan, 1], [np.inf, 1], [-np.inf, 0], [1e30, 1e30]]
    rng = np.random.default_rng(0)
    for rows in (
        np.array(vectors, F32),
        (rng.standard_normal((6, 1000)) * [[0.01], [0.1], [1], [10], [1], [0]]).astype(F32),
    ):
        with np.errstate(invalid="ignore"):
            alone = np.stack([clip(row.copy(), 2.5) for row in rows])
            a = clip(rows.copy(), 2.5)
        t = clip(torch.from_numpy(rows.copy()), 2.5)
        assert np.array_equal(a.view(np.uint32), alone.view(np.uint32))
        assert np.array_equal(t.numpy().view(np.uint32), alone.view(np.uint32))


def test_client_optimizer_matches_torch_sgd():
    """torch.optim.SGD with momentum, Nesterov and weight decay, on random float32 data: the same
    trajectory up to float32 rounding (torch fuses ``p + alpha * d`` where numpy rounds twice)."""
    rng = np.random.default_rng(0)
    for nesterov in (False, True):
        w0 = rng.standard_normal(50).astype(F32)
        grads = rng.standard_normal((20, 50)).astype(F32)
        p = nn.Parameter(torch.from_numpy(w0.copy()))
        sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
        ours = client_trajectory(ClientOptimizer(0.9, nesterov, 0.01), w0, grads, lr=0.1)
        for g, w in zip(grads, ours):
            p.grad = torch.from_numpy(g.copy())
            sgd.step()
            np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_client_momentum_rows_are_per_client():
    opt = ClientOptimizer(momentum=0.5)
    state = opt.init(2, 1)
    opt.direction(state, 0, np.array([4], F32))
    opt.direction(state, 1, np.array([2], F32))
    assert opt.direction(state, 0, np.array([0], F32)).tolist() == [2.0]
    assert state["m"].tolist() == [[2.0], [2.0]]


def test_client_optimizer_refuses_bad_settings():
    with pytest.raises(ConfigError, match="nesterov"):
        ClientOptimizer(nesterov=True)
    with pytest.raises(ConfigError, match="momentum"):
        ClientOptimizer(momentum=1.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        ClientOptimizer(clip_norm=0)
    with pytest.raises(ConfigError, match="weight_decay"):
        ClientOptimizer(weight_decay=-1)


def server_steps(name: str, params: dict, grads, eta=1.0):
    opt = make_server_optimizer(name, params)
    state = opt.init(1)
    return [opt.update(state, np.array([g], F32), eta)[0].item() for g in grads]


def test_server_sgd_is_todays_update():
    g = np.random.default_rng(1).standard_normal(100).astype(F32)
    opt = make_server_optimizer("sgd")
    assert np.array_equal(opt.update(opt.init(100), g, 0.1)[0], F32(0.1) * g)
    assert opt.eta(0.1, 0.5) == 0.1 * 0.5
    assert make_server_optimizer("adam", {"lr": 0.01}).eta(0.1, 0.5) == 0.01 * 0.5


def test_server_momentum_fedavgm():
    assert server_steps("momentum", {"beta": 0.5}, [1, 1, 1], eta=2.0) == [2.0, 3.0, 3.5]


def test_fedadam_algorithm_2():
    # v_{-1} = tau^2 = 1. Round 0: m = 0.5 * 7 = 3.5, v = 0.5 + 0.5 * 49 = 25, step 3.5 / (5 + 1).
    # Round 1: m = 1.75 - 2.5 = -0.75, v = 12.5 + 12.5 = 25, step -0.75 / 6 = -0.125.
    steps = server_steps("adam", {"beta1": 0.5, "beta2": 0.5, "tau": 1.0}, [7, -5])
    assert steps == [F32(3.5) / F32(6), -0.125]


def test_fedyogi_algorithm_2():
    # Round 0: v = 1 - 0.5 * 16 * sign(1 - 16) = 9, m = 2, step 2 / (3 + 1) = 0.5.
    # Round 1: v = 9 - 0.5 * 144 * sign(9 - 144) = 81, m = 1 - 6 = -5, step -5 / (9 + 1) = -0.5.
    # (Adam would give v = 0.5 * 9 + 72 = 76.5 in round 1: Yogi's v grows additively.)
    assert server_steps("yogi", {"beta1": 0.5, "beta2": 0.5, "tau": 1.0}, [4, -12]) == [0.5, -0.5]
    # a gradient smaller than sqrt(v) makes v shrink by (1 - beta2) g^2: 81 - 0.5 * 4 = 79
    opt = make_server_optimizer("yogi", {"beta1": 0.5, "beta2": 0.5, "tau": 1.0})
    state = opt.init(1)
    for g in (4, -12, 2):
        opt.update(state, np.array([g], F32), 1.0)
    assert state["v"].tolist() == [79.0]


def test_fedadagrad_algorithm_2():
    # tau = 3: v_{-1} = 9; round 0: v = 9 + 16 = 25, m = 2, step 2 / (5 + 3); round 1: v = 25 + 144 = 169,
    # m = 1 + 6 = 7, step 7 / (13 + 3)
    assert server_steps("adagrad", {"beta1": 0.5, "tau": 3.0}, [4, 12]) == [0.25, 0.4375]


def test_server_optimizer_settings_are_checked():
    with pytest.raises(ConfigError, match=r"adam\.beta2"):
        make_server_optimizer("adam", {"beta2": 1.0})
    with pytest.raises(ConfigError, match="adagrad"):
        make_server_optimizer("adagrad", {"beta2": 0.9})  # FedAdagrad has no beta2
    with pytest.raises(ConfigError, match="server_optimizer"):
        make_server_optimizer("adamw")


def one_round_of_batchnorm(batches, mode: str):
    """Client k trains on ``batches[k]`` (one rank hosts them all), then the round's aggregation."""
    model = nn.Sequential(nn.BatchNorm1d(2, momentum=0.5))
    buffers = ModelBuffers(model, mode, Layout(len(batches), MPI.COMM_SELF))
    for k, x in enumerate(batches):
        buffers.use(k)
        model(torch.from_numpy(x))
        buffers.keep(k)
    buffers.aggregate()
    return model, buffers


def test_batchnorm_statistics_equal_the_centralised_computation():
    """Three clients, one batch of two samples each, BatchNorm momentum 0.5 (every value dyadic).
    Aggregated: running_mean = 0.5 * 0 + 0.5 * (mean of the union of the batches: equal batch sizes);
    running_var = 0.5 * 1 + 0.5 * mean of the clients' unbiased batch variances."""
    batches = [np.array([[1, 2], [3, 6]], F32), np.array([[0, 0], [2, 4]], F32), np.array([[-1, 8], [5, 0]], F32)]
    model, _ = one_round_of_batchnorm(batches, "aggregate")
    union = np.concatenate(batches)
    variances = np.mean([x.astype(np.float64).var(axis=0, ddof=1) for x in batches], axis=0)  # [2, 8], [2, 8], [18, 32]
    bn = model[0]
    assert bn.running_mean.tolist() == F32(0.5 * union.mean(axis=0)).tolist()  # [5/6, 5/3]
    assert bn.running_var.tolist() == F32(0.5 + 0.5 * variances).tolist()  # [0.5 + 11/3, 8.5]
    assert int(bn.num_batches_tracked) == 1
    # kept per client: each client's statistics are its own batch's, nothing is averaged
    model, local = one_round_of_batchnorm(batches, "local")
    local.use(2)
    assert model[0].running_mean.tolist() == [1.0, 2.0] and model[0].running_var.tolist() == [9.5, 16.5]


def test_shards_partition_small_case():
    labels = np.array([2, 0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2])
    # stable sort by label: 0: 1 4 6 9 | 1: 2 5 7 10 | 2: 0 3 8 11; six shards of two
    shards = [[1, 4], [6, 9], [2, 5], [7, 10], [0, 3], [8, 11]]
    order = np.random.default_rng(5).permutation(6)
    parts = partition_shards(labels, 3, 2, np.random.default_rng(5))
    assert [p.tolist() for p in parts] == [sorted(shards[order[2 * c]] + shards[order[2 * c + 1]]) for c in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(12))
    assert all(len(set(labels[p])) <= 2 for p in parts)
    with pytest.raises(ConfigError, match=r"shards\.per_client"):
        partition_shards(labels, 4, 4, np.random.default_rng(0))
    # through the run's partition(): drawn from the seed's partition stream, the same every time
    assert [p.tolist() for p in partition(labels, 3, "shards", 0.5, seed=7, shards_per_client=2)] == [
        p.tolist() for p in partition(labels, 3, "shards", 0.5, seed=7, shards_per_client=2)
    ]


def test_validation_split_is_disjoint_and_deterministic():
    parts = partition(np.repeat(np.arange(10), 30), 4, "iid", 0.5, seed=3)
    train, val = hold_out(parts, 0.2, seed=3)
    for part, tr, va in zip(parts, train, val):
        assert len(va) == int(0.2 * len(part)) and not set(tr) & set(va)
        assert sorted([*tr, *va]) == sorted(part)
    again_train, again_val = hold_out(parts, 0.2, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(val + train, again_val + again_train))
    assert not np.array_equal(hold_out(parts, 0.2, seed=4)[1][2], val[2])  # another seed, another draw
    none_train, none_val = hold_out(parts, 0.0, seed=3)
    assert all(len(v) == 0 for v in none_val) and all(np.array_equal(a, b) for a, b in zip(none_train, parts))
    with pytest.raises(ConfigError, match="validation"):
        hold_out([np.arange(3)], 0.2, seed=0)


#: Flower's FedAdam, FedYogi and FedAdagrad (adap/flower fdef7afb1dca3030553be302366cfd285ed6632c,
#: framework/py/flwr/server/strategy/fed{adam,yogi,adagrad}.py, aggregate_fit's arithmetic run in float64
#: outside the repository): the weights after each of 3 rounds from w = 0, eta 0.1, beta1 0.9, beta2 0.99,
#: tau 1e-3, client lr 0.05 (Delta_t = -0.05 g_t)
FLOWER = {
    "adam": [
        [-0.04454758730420808, 0.06363941043458296, -0.06749634440031525],
        [-0.03272205226382651, 0.08832042107660715, -0.14086077954025678],
        [-0.07756807839853597, 0.10857003868820259, -0.1947817261510349],
    ],
    "yogi": [
        [-0.05999999999999997, 0.08571428571428566, -0.09090909090909084],
        [-0.0414285714285714, 0.12438095238095229, -0.2058484122195628],
        [-0.11907552272964593, 0.15918095238095226, -0.29850147344405253],
    ],
    "adagrad": [
        [-0.009374999999999998, 0.00983606557377049, -0.009900990099009898],
        [-0.006874999999999996, 0.014230004967709882, -0.02231196365089287],
        [-0.015512602024349627, 0.018184550422255336, -0.032311963650892866],
    ],
}


@pytest.mark.parametrize("name", FLOWER)
def test_flower_variant_follows_flowers_strategies(name):
    """``variant = "flower"`` with ``tau = tau_flower / lr_client`` gives Flower's weights, within float32
    rounding (fedring's arithmetic is float32, the reference float64): v starts at 0 and FedAdam's
    step is bias-corrected with exponent r + 1 (Flower's 1-based round r = t + 1)."""
    params = {"variant": "flower", "tau": 1e-3 / 0.05, "beta1": 0.9, **({"beta2": 0.99} if name != "adagrad" else {})}
    opt = make_server_optimizer(name, params)
    state, w = opt.init(3), np.zeros(3, np.float32)
    gs = [[0.3, -1.2, 2.0], [-0.4, 0.5, 1.0], [1.5, 0.0, -0.25]]
    for t, (g, expected) in enumerate(zip(gs, FLOWER[name], strict=True)):
        step, state = opt.update(state, np.array(g, np.float32), 0.1, t)
        w = w - step
        np.testing.assert_allclose(w, expected, rtol=2e-6, atol=1e-9)


def test_dampened_client_momentum_is_byzfls():
    """``dampening = true``: ``m = beta m + (1 - beta) u`` from m = 0, as ByzFL's client
    (LPD-EPFL/byzfl 69bd1ac0, byzfl/fed_framework/client.py, compute_momentum) and the papers write it;
    by hand for beta 0.9: 0.1 u1, then 0.09 u1 + 0.1 u2."""
    opt = ClientOptimizer(momentum=0.9, dampening=True)
    state = opt.init(1, 2)
    u1, u2 = np.array([1.0, -2.0], np.float32), np.array([3.0, 0.5], np.float32)
    np.testing.assert_allclose(opt.direction(state, 0, u1.copy()), [0.1, -0.2], rtol=1e-6)
    np.testing.assert_allclose(opt.direction(state, 0, u2.copy()), [0.39, -0.13], rtol=1e-6)
    with pytest.raises(ConfigError, match="dampening needs momentum > 0"):
        ClientOptimizer(dampening=True)
