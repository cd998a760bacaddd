"""AlterMin (Bhagoji et al., ICML 2019): the attack's local steps against an independent float64
computation and FLPoison's own code, the hook of :class:`fedring.train.clients.Clients` that runs
them (per client, batched, device path), its settings, and a run recording the success rate."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import same_on_one_and_two_ranks
from mpi4py import MPI
from torch import nn

from fedring.attacks import make_attack
from fedring.attacks.altermin import AlterMin
from fedring.attacks.base import LocalRun
from fedring.errors import ConfigError
from fedring.train.batched import VmapGradients
from fedring.train.clients import Clients
from fedring.train.data import Shard
from fedring.train.device import Staging
from fedring.train.gradients import ModelGradients
from fedring.train.models import flat_grad_into, flatten, load_flat
from fedring.train.optim import ClientOptimizer
from fedring.train.state import ModelBuffers

# A linear softmax model on 4 features, 3 classes, and six samples (numpy.random.default_rng(1):
# weights normal(0, 0.5), then samples uniform, rounded to 2 decimals).
W0 = [0.17, 0.41, 0.17, -0.65, 0.45, 0.22, -0.27, 0.29, 0.18, 0.15, 0.01, 0.27]
B0 = [-0.37, -0.08, -0.24]
X = np.array(
    [
        [0.45, 0.13, 0.40, 0.20],
        [0.26, 0.75, 0.28, 0.49],
        [0.98, 0.96, 0.72, 0.54],
        [0.28, 0.16, 0.97, 0.52],
        [0.12, 0.62, 0.78, 0.61],
        [0.92, 0.04, 0.53, 0.46],
    ],
    np.float32,
)
Y = np.array([0, 1, 2, 1, 0, 2])

#: FLPoison's AlterMin.local_training run outside fedring (vio1etus/FLPoison
#: 368c9403e5dd27775a09af211a7a9d82fbe890ee: attackers/altermin.py, fl/client.py and fl/worker.py
#: as they are; its package imports stubbed, an instance built without __init__, model2vec of the
#: model after the call) on this model in torch: train_loader yields X[:3], X[3:], X[:3] ...,
#: poisoned_loader the two class-1 samples labelled 2 in one batch, torch SGD without momentum or
#: decay, a constant LambdaLR. Keys: (benign_epochs, malicous_epochs, boosting_factor, rho, lr).
#: Its rho has no effect (the same vectors for rho 0 and 1e-4): its distance is computed on numpy
#: copies, so it adds a constant to the loss and nothing to the gradient.
FLPOISON = {
    (2, 2, 3.0, 1e-4, 0.5): [
        -0.04742686450481415, 0.10735908150672913, -0.22895288467407227, -0.9866464138031006,
        0.10336053371429443, -0.22370195388793945, -0.8147021532058716, -0.1620248258113861,
        0.7440662384033203, 0.8963426947593689, 0.953654944896698, 1.058671236038208,
        -0.9891237020492554, -1.0066890716552734, 1.3058125972747803,
    ],
    (1, 1, 10.0, 1e-4, 0.1): [
        0.10441900789737701, 0.2889569103717804, 0.01599586009979248, -0.7777971029281616,
        0.3300963044166565, 0.034593358635902405, -0.5148199796676636, 0.0929727554321289,
        0.3654845356941223, 0.4564497470855713, 0.4088241159915924, 0.5948240756988525,
        -0.6078213453292847, -0.4773634374141693, 0.3951846957206726,
    ],
}  # fmt: skip


def linear() -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    load_flat(model.parameters(), np.array(W0 + B0, np.float32))
    return model


def torch_gradient(model: nn.Module):
    """The run's ``gradient`` of a client without clipping or decay, on ``model``."""

    def gradient(w, x, y):
        load_flat(model.parameters(), w)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        g = np.empty(w.size, np.float32)
        flat_grad_into(model.parameters(), g)
        return g, loss.item()

    return gradient


def reference(w, benign, poisoned, lr, rho, boost, benign_steps, malicious_steps):
    """The attack in float64 numpy, the softmax cross-entropy's gradient written out: the expected weights."""

    def grad(v, x, y):
        W, b = v[:12].reshape(3, 4), v[12:]
        z = x @ W.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1  # d(mean CE)/dz
        return np.concatenate([(p.T @ x).ravel(), p.sum(axis=0)]) / len(y)

    w_g = np.asarray(w, np.float64)
    v = w_g.copy()
    for x, y in itertools.islice(itertools.cycle(benign), benign_steps):
        v = v - lr * (grad(v, x.astype(np.float64), y) + 2 * rho * (v - w_g))
    stealth = v.copy()
    for _ in range(malicious_steps):
        v = v - lr * grad(v, poisoned[0].astype(np.float64), poisoned[1])
    return stealth + boost * (v - stealth)


# -- the attack's local steps ----------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(FLPOISON))
def test_local_steps_agree_with_flpoison_whose_rho_adds_no_gradient(key):
    benign, malicious, boost, _, lr = key
    model = linear()
    run = LocalRun(
        flatten(model),
        itertools.cycle([(X[:3], Y[:3]), (X[3:], Y[3:])]),
        (X, Y),
        torch_gradient(model),
        float(np.float32(lr)),
        1,
    )
    attack = AlterMin(1, 2, 2, boost, 0.0, benign, malicious)  # rho = 0: FLPoison's effective objective
    # float32 steps in another order (numpy's w - lr * g, torch's SGD step): a few ulp of weights
    # below 1.5, so 1e-6 absolute; measured: equal bits for one key, 8.9e-8 (one ulp) for the other
    np.testing.assert_allclose(attack.local_steps(run), FLPOISON[key], rtol=0, atol=1e-6)


def test_local_steps_follow_the_float64_formula_with_the_distance_gradient():
    model, lr, rho = linear(), 0.5, 0.05  # rho large enough to move the weights by far more than rounding
    batches = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    run = LocalRun(flatten(model), itertools.cycle(batches), (X, Y), torch_gradient(model), lr, 1)
    got = AlterMin(1, 2, 2, 3.0, rho, 3, 2).local_steps(run)
    want = reference(W0 + B0, batches, (X[[1, 3]], np.array([2, 2])), lr, rho, 3.0, 3, 2)
    # float32 against float64 through 5 steps and a boost of 3: weights below 2, 1e-5 absolute
    # (float32 rounding is 1.2e-7 of a weight per operation)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    without = reference(W0 + B0, batches, (X[[1, 3]], np.array([2, 2])), lr, 0.0, 3.0, 3, 2)
    assert np.abs(want - without).max() > 1e-3  # the distance term's gradient moved the weights


def quadratic_run(w, batch, samples, steps=1, lr=0.5, loss=1.0):
    """A run whose loss is ``|w - mean(x)|^2 / 2`` (gradient ``w - mean(x)``), reporting ``loss``, and the calls made."""
    calls = []

    def gradient(v, x, y):
        calls.append((v.copy(), x.copy(), y.copy()))
        return (v - x.mean(axis=0)).astype(np.float32), loss

    w = np.asarray(w, np.float32)
    return LocalRun(w, itertools.repeat(batch), samples, gradient, lr, steps), calls


SAMPLES = (np.array([[2.0, 0.0], [0.0, 2.0], [4.0, 4.0]], np.float32), np.array([3, 5, 3]))
BATCH = (SAMPLES[0][1:2], SAMPLES[1][1:2])


def test_the_boost_and_the_poisoned_samples_by_hand():
    # stealth (default: the run's one step): (0, 0) - 0.5 (0, -2) = (0, 1); malicious on the mean of
    # the two class-3 samples (3, 2), two steps: (0, 1) -> (1.5, 1.5) -> (2.25, 1.75); boost 4:
    # (0, 1) + 4 (2.25, 0.75) = (9, 4)
    run, calls = quadratic_run([0, 0], BATCH, SAMPLES)
    out = AlterMin(3, 7, poisoned_sample_cnt=5, boosting_factor=4, malicious_epochs=2).local_steps(run)
    assert out.dtype == np.float32 and out.tolist() == [9.0, 4.0]
    assert [c[2].tolist() for c in calls] == [[5], [7, 7], [7, 7]]  # relabelled 3 -> 7, both class-3 samples
    assert not run.w.any()  # the global weights are left as they were
    # poisoned_sample_cnt = 1: the first class-3 sample only, (2, 0): (0, 1) -> (1, 0.5); boost 10
    run, _ = quadratic_run([0, 0], BATCH, SAMPLES)
    assert AlterMin(3, 7).local_steps(run).tolist() == [10.0, -4.0]


def test_benign_epochs_default_to_the_runs_steps_and_the_distance_pulls_back():
    # three stealth steps from (0, 0) towards (0, 2) with 2 rho = 0.5: (0, 1), (0, 1.25), (0, 1.3125)
    run, calls = quadratic_run([0, 0], BATCH, (SAMPLES[0], np.array([0, 5, 0])), steps=3)
    assert AlterMin(3, 7, rho=0.25).local_steps(run).tolist() == [0.0, 1.3125]  # no class-3 sample: no malicious step
    assert len(calls) == 3
    run, calls = quadratic_run([0, 0], BATCH, SAMPLES, steps=3)
    AlterMin(3, 7, benign_epochs=0).local_steps(run)
    assert len(calls) == 1 and calls[0][2].tolist() == [7]  # straight to the malicious step


def test_a_met_malicious_objective_is_not_boosted():
    # loss 0 at the stealth weights (FLPoison's asr_loss > 0 fails): the stealth weights, unboosted
    run, calls = quadratic_run([0, 0], BATCH, SAMPLES, loss=0.0)
    assert AlterMin(3, 7, malicious_epochs=3).local_steps(run).tolist() == [0.0, 1.0]
    assert len(calls) == 2


def test_poison_relabels_the_source_class_and_the_success_rate_counts_it():
    attack = AlterMin(3, 7)
    x = np.zeros((4, 2), np.float32)
    xs, ys = attack.poison(x, np.array([3, 7, 1, 3]))
    assert xs is x and ys.tolist() == [7, 7, 1, 7]
    assert attack.counted(np.array([3, 7, 1, 3])).tolist() == [True, False, False, True]
    np.testing.assert_array_equal(attack.stamp(X), X)  # no trigger: clean samples of the source class
    assert attack.scale == 1.0 and attack.target == 7 and attack.owns_steps


@pytest.mark.parametrize(
    "params, key",
    [
        ({"source_label": -1}, "attack.source_label"),
        ({"source_label": 10}, "attack.source_label"),  # 10 classes
        ({"target_label": 10}, "attack.target_label"),
        ({"target_label": 3}, "attack.target_label"),  # the source class
        ({"poisoned_sample_cnt": 0}, "attack.poisoned_sample_cnt"),
        ({"poisoned_sample_cnt": 1.5}, "attack.poisoned_sample_cnt"),
        ({"boosting_factor": 0}, "attack.boosting_factor"),
        ({"boosting_factor": float("inf")}, "attack.boosting_factor"),
        ({"rho": -1e-4}, "attack.rho"),
        ({"benign_epochs": -1}, "attack.benign_epochs"),
        ({"malicious_epochs": 0}, "attack.malicious_epochs"),
        ({"malicous_epochs": 1}, "attack.malicous_epochs"),  # FLPoison's spelling: a suggestion
    ],
)
def test_settings_are_checked(params, key):
    with pytest.raises(ConfigError) as err:
        make_attack("altermin", params, n_clients=10, n_classes=10)
    assert err.value.key == key


# -- the hook in the clients' local steps ----------------------------------------------------

SHARDS = [Shard(X[:3], Y[:3]), Shard(X[3:], Y[3:])]  # batch_size 3: every batch is the whole shard, in order


def clients(attack, batched=False, host_path=True, **cfg):
    """Two clients on one rank, client 1 poisoned, training ``linear()`` with FedSGD's lr 0.5."""
    model = linear()
    d = flatten(model).size
    layout = SimpleNamespace(n_local=2, lo=0, hi=2, n_clients=2, local_clients=range(2))
    stage = Staging(torch.device("cpu"), d, host_path)
    settings = {"seed": 0, "batch_size": 3, "local_steps": 1, "local_epochs": None, **cfg}
    if batched:
        source = VmapGradients(model, "linear", stage, 2, SHARDS, 3, MPI.COMM_SELF)
    else:
        source = ModelGradients(model, stage, ModelBuffers(model, "aggregate", layout), 0)
    poisoned, opt = np.array([False, attack is not None]), ClientOptimizer()
    cl = Clients(SimpleNamespace(**settings), layout, SHARDS, stage, source, opt, poisoned, attack, lambda t: 0.5, d)
    w = stage.vector(flatten(model))
    rows, losses = cl.updates(0, w, np.array([True, True]))
    return (rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows).copy(), losses.read()


ATTACK = {"source_label": 1, "target_label": 2, "poisoned_sample_cnt": 2, "boosting_factor": 3.0, "rho": 0.05}


def test_clients_upload_the_attacks_weights_and_leave_the_honest_client_alone():
    rows, loss = clients(AlterMin(**ATTACK, benign_epochs=2, malicious_epochs=2))
    plain, plain_loss = clients(None)
    assert rows[0].tobytes() == plain[0].tobytes() and loss[0] == plain_loss[0]  # the honest path, bit for bit
    # client 1's shard is X[3:] (labels 1, 0, 2): one class-1 sample, X[3], poisoned
    want = reference(W0 + B0, [(X[3:], Y[3:])], (X[3:4], np.array([2])), 0.5, 0.05, 3.0, 2, 2)
    # the upload (w_g - w) / 0.5 of float32 weights below 2 held to 1e-5 (float32 against float64): 2e-5
    np.testing.assert_allclose(rows[1], (np.array(W0 + B0) - want) / 0.5, rtol=0, atol=2e-5)
    assert loss[1] == pytest.approx(plain_loss[1])  # its first (benign) batch loss is reported


def test_the_batched_and_device_paths_run_the_attack_alike():
    attack = AlterMin(**ATTACK)
    rows, _ = clients(attack)
    device, _ = clients(attack, host_path=False)
    assert device.tobytes() == rows.tobytes()  # the same torch ops; the attack's arithmetic on host copies
    batched, _ = clients(attack, batched=True)
    # vmap's kernels sum in another order than the per-client backward pass: float32 rounding of
    # gradients below 1, through a boost of 3 and a division by lr 0.5: 1e-5
    np.testing.assert_allclose(batched, rows, rtol=0, atol=1e-5)


def test_benign_epochs_beyond_the_runs_batches_continue_its_draws():
    # local_epochs = 1 with batch_size 2: the client's batches are the passes over its shard of 3
    # samples (2 + 1), and 5 stealth steps take a second pass and the first batch of a third
    rows, _ = clients(AlterMin(**ATTACK, benign_epochs=5), batch_size=2, local_epochs=1)
    assert np.isfinite(rows).all()
    with_three, _ = clients(AlterMin(**ATTACK, benign_epochs=3), batch_size=2, local_epochs=1)
    assert not np.array_equal(rows[1], with_three[1])


# -- a run -----------------------------------------------------------------------------------

RUN = [
    "run",
    "--dataset", "synthetic", "--model", "mlp", "--clients", "6", "--byzantine", "2", "--partition", "iid",
    "--topology", "server", "--aggregator", "mean", "--rounds", "3", "--eval-every", "1", "--quiet",
    "--attack", "altermin", "--set", "attack.poisoned_sample_cnt=3", "--set", "attack.boosting_factor=6",
]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.slow
def test_a_run_records_the_success_rate_alike_on_one_and_two_ranks(tmp_path):
    one = same_on_one_and_two_ranks(RUN, tmp_path)
    asr = one["metrics/attack_success_rate"]
    assert asr.shape == (3,)

    # the recorded rate is the final model's share of the test samples of class 3 classified as 7
    from fedring.datasets import DATASETS
    from fedring.train.models import MODELS

    data = DATASETS["synthetic"]()
    labels = data.test_labels()
    rows = np.flatnonzero(labels == 3)
    model = MODELS["mlp"](classes=10)
    load_flat(model.parameters(), one["model/final"])
    with torch.no_grad():
        pred = model(torch.from_numpy(data.test_images(rows))).argmax(1).numpy()
    assert asr[-1] == np.mean(pred == 7)
