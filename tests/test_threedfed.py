"""3DFed (Li et al., IEEE S&P 2023): its parts against literal outputs of the authors' code
(github.com/haoyangliASTAPLE/3DFed, file commit 5b79ba5), the feedback and tuning by hand, and runs:
the same file on one and two ranks, the success rate recorded, the settings checked.

The authors' outputs were computed with their functions on the CPU (``torch.cuda.FloatTensor``
replaced by a CPU tensor): ``noise_mask_design``'s optimisation loop with ``compute_noise_loss`` and
``dual_ascent``, ``design_indicator``'s two selection loops, and ``find_decoy_params``."""

import numpy as np
import pytest
import torch
from conftest import same_on_one_and_two_ranks
from torch import nn

from fedring.attacks import AttackContext, make_attack
from fedring.attacks.threedfed import (
    PROFILES,
    ThreeDFed,
    decoy_positions,
    indicator_positions,
    noise_masks,
    read_feedback,
    smallest_slots,
    tune,
)
from fedring.errors import ConfigError
from fedring.train.attacker import AttackerModel, layer_slices
from fedring.train.data import Shard
from fedring.train.models import flatten
from fedring.train.probe import output_layer

# --- noise masks: one group of two on a (4, 3) output layer, rows [0, 2], alpha 0.6, MNIST constants,
# momentum 0.9, weight decay 5e-4, dual step 0.1; the masks before centring (weight columns, then bias)
WEIGHT = np.arange(12).reshape(4, 3) * 0.01 - 0.05
BIAS = np.array([0.02, -0.01, 0.03, 0.0])
INIT = np.array(
    [
        [[0.01, -0.02, 0.03, 0.01], [0.04, 0.0, -0.01, -0.01], [0.02, 0.02, -0.03, 0.02], [-0.05, 0.01, 0.0, 0.0]],
        [[0.03, 0.01, -0.02, -0.02], [0.0, 0.02, 0.01, 0.0], [-0.04, 0.01, 0.02, 0.01], [0.02, -0.03, 0.01, 0.03]],
    ],
    np.float32,
)
# the authors' masks after 1 and 30 iterations, and their Lagrange multiplier
AUTHORS_1 = np.array(
    [
        [[-0.134564325, -0.139411524, -0.100633956, 0.139411524], [0.019998999, -0.0099995, -0.0099995, -0.00499975],
         [0.301192045, 0.276956052, 0.247872889, 0.276956052], [-0.034998249, 0.019998999, -0.00499975, -0.01499925]],
        [[-0.182305619, -0.17745842, -0.21623598, 0.17745842], [-0.019998999, 0.0099995, 0.0099995, 0.00499975],
         [-0.255926281, 0.221995905, 0.251079082, 0.221995905], [0.034998249, -0.019998999, 0.00499975, 0.01499925]],
    ]
)  # fmt: skip
AUTHORS_30 = np.array(
    [
        [[-0.77854073, -0.781735122, -0.756180406, 0.781735122], [0.019786848, -0.009893424, -0.009893424, -0.004946712],
         [2.515357733, 1.805613756, 1.786447883, 1.805613756], [-0.034626983, 0.019786848, -0.004946712, -0.014840137]],
        [[-0.836848199, -0.833659649, -0.859166265, 0.833659649], [-0.019786848, 0.009893424, 0.009893424, 0.004946712],
         [-2.303185701, 0.62814641, 0.647275865, 0.62814641], [0.034626983, -0.019786848, 0.004946712, 0.014840137]],
    ]
)  # fmt: skip
AUTHORS_MU = {1: 1.1072629690170288, 30: 18.408124208450317}


@pytest.mark.parametrize("iterations, expected", [(1, AUTHORS_1), (30, AUTHORS_30)])
def test_noise_masks_agree_with_the_authors_loop(iterations, expected):
    """float32 throughout, as theirs; sums in another order than torch's: 1e-6 absolute over values
    up to 2.5."""
    masks, mu = noise_masks(WEIGHT, BIAS, INIT, np.array([0, 2]), 0.6, PROFILES["mnist"], 0.9, 5e-4, 0.1, iterations)
    np.testing.assert_allclose(masks, expected, rtol=0, atol=1e-6)
    assert mu == pytest.approx(AUTHORS_MU[iterations], rel=1e-6)


# --- indicators: 60 positions, numpy.random.default_rng(7): a = random(60) rounded to 3 decimals,
# curvature = normal(60) rounded to 2, with positions 5, 17, 33 set to 0
def indicator_inputs():
    rng = np.random.default_rng(7)
    analog = rng.random(60).round(3)
    curvature = rng.normal(size=60).round(2)
    curvature[[5, 17, 33]] = 0.0
    return analog, curvature


AUTHORS_CANDIDATES = {
    (3, 10): [46, 33, 39, 3, 4, 40, 6, 35, 36, 9, 10, 11, 12, 13, 14, 50, 30, 37, 52, 31, 20, 21, 57, 23, 24, 53, 26,
              32, 55, 54],
    (2, 4): [52, 46, 32, 55, 24, 37, 6, 23],
}  # fmt: skip
AUTHORS_INDICATORS = {(3, 10): [35, 33, 31], (2, 4): [24, 55]}


@pytest.mark.parametrize("total, candidates", [(3, 10), (2, 4)])
def test_indicator_positions_agree_with_the_authors_selection(total, candidates):
    analog, curvature = indicator_inputs()
    assert smallest_slots(analog, total * candidates) == AUTHORS_CANDIDATES[total, candidates]
    assert indicator_positions(analog, curvature, total, candidates).tolist() == AUTHORS_INDICATORS[total, candidates]


def test_a_zero_curvature_replaces_the_largest_only_with_a_smaller_analog():
    # slots [4, 1, 2, 3]; curvature |.| = [3, 1, 0, 2, 0.5]: 4 and 1 fill, 2 (curvature 0) has a = 0.4 >
    # a of 1 (0.1, the largest curvature kept): no swap; with a[2] = 0.05 it replaces 1
    analog = np.array([0.5, 0.1, 0.4, 0.2, 0.3])
    curvature = np.array([3.0, -1.0, 0.0, 2.0, 0.5])
    assert indicator_positions(analog, curvature, 2, 2).tolist() == [4, 1]
    analog[2] = 0.05
    assert indicator_positions(analog, curvature, 2, 2).tolist() == [4, 2]


def test_decoy_positions_are_the_smallest_where_the_authors_lose_one():
    """numpy.random.default_rng(3).random((4, 6)) rounded to 3 decimals. The authors'
    ``find_decoy_params`` returns [[0, 0], [1, 3], [3, 2]] for k = 3: after a replacement it stores
    the position in the slot of the new largest, losing (0, 4), the third smallest (docs/attacks.md)."""
    diff = np.random.default_rng(3).random((4, 6)).round(3)
    ours = [list(divmod(int(p), 6)) for p in decoy_positions(diff, 3)]
    assert ours == [[0, 0], [3, 2], [0, 4]]
    assert sorted(ours) == sorted(list(divmod(int(p), 6)) for p in np.argsort(diff, axis=None)[:3])
    authors = [[0, 0], [1, 3], [3, 2]]
    assert sorted(authors) != sorted(ours)
    # for k = 5 the authors' positions are the right set, in another order
    assert sorted(list(divmod(int(p), 6)) for p in decoy_positions(diff, 5)) == sorted(
        [[0, 0], [1, 3], [1, 1], [3, 2], [0, 4]]
    )


def test_feedback_verdicts_by_hand():
    # threshold 1e-4; max 0.05: 0.045 > 0.04 accepted, 0.03 clipped, 1e-4 rejected, -1e-5 rejected
    assert read_feedback(np.array([0.05, 0.045, 0.03, 1e-4, -1e-5]), 1e-4) == (["a", "a", "c", "r", "r"], False)
    assert read_feedback(np.array([0.05, -2e-4, 0.03]), 1e-4) == (["a"], True)  # below -threshold: weak DP
    assert read_feedback(np.array([0.05, np.nan, 0.03]), 1e-4) == (["a", "r", "c"], False)  # NaN: rejected


def test_tuning_by_hand():
    rng = np.random.default_rng(0)
    # weak DP: every alpha 0.1, k kept
    alpha, k = tune(["a"], np.array([0.3, 0.7]), 2, True, 4, 2, 0.0, rng)
    assert alpha.tolist() == [0.1, 0.1] and k == 2
    # nothing of the attackers accepted or clipped, no decoy accepted: one more decoy; no group is a
    # candidate, so each alpha is drawn from U(alpha_low, 1)
    alpha, k = tune(list("rrrrr"), np.array([0.3, 0.7]), 1, False, 4, 2, 0.5, rng)
    assert k == 2 and all(0.5 <= a < 1 for a in alpha)
    # both groups accepted: each alpha from U(0.3, 0.7); two decoys accepted: k 3 -> 1
    alpha, k = tune(list("aaaaaa"), np.array([0.7, 0.3]), 3, False, 4, 2, 0.0, rng)
    assert k == 1 and all(0.3 <= a <= 0.7 for a in alpha)
    # only the first group accepted: each alpha from U(0.95, 1.05), a draw at 1 or above set to 0.99
    drawn = np.concatenate([tune(list("aarr"), np.array([0.95, 0.2]), 0, False, 4, 2, 0.0, rng)[0] for _ in range(20)])
    assert ((drawn >= 0.95) & (drawn < 1)).all() and (drawn == 0.99).sum() > 5
    # one group: a candidate keeps every alpha, none redraws all (a third slot from an odd count too)
    kept = np.array([0.4, 0.6])
    assert tune(list("aa"), kept, 0, False, 2, 2, 0.0, rng)[0].tolist() == [0.4, 0.6]
    redrawn, _ = tune(list("rr"), kept, 0, False, 2, 2, 0.9, rng)
    assert all(0.9 <= a < 1 for a in redrawn)


@pytest.mark.parametrize(
    "params, key",
    [
        ({"group_size": 0}, "attack.group_size"),
        ({"num_neurons": 10}, "attack.num_neurons"),
        ({"alpha_low": 1.0}, "attack.alpha_low"),
        ({"weight_scale": 0.5}, "attack.weight_scale"),
        ({"profile": "imagenet"}, "attack.profile"),
        ({"target": 10}, "attack.target"),
        ({"momentum": 1.0}, "attack.momentum"),
    ],
)
def test_settings_are_checked(params, key):
    with pytest.raises(ConfigError) as err:
        make_attack("threedfed", params, n_clients=10, n_classes=10)
    assert err.value.key == key


def test_it_needs_two_attackers():
    assert ThreeDFed(n_classes=10).check(10, 1).key == "byzantine"
    assert ThreeDFed(n_classes=10).check(10, 2) is None


def attacker_model() -> tuple[AttackerModel, np.ndarray]:
    """A convolution and two linear layers on 6 x 6 images, 4 classes, 12 random samples; its weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 5), nn.ReLU(), nn.Linear(5, 4))
    rng = np.random.default_rng(1)
    shard = Shard(rng.random((12, 1, 6, 6)).astype(np.float32), rng.integers(0, 4, 12))
    layer = output_layer(net, 4, (1, 6, 6), key="attack")
    return AttackerModel(net, shard, 0, layer, batch_size=4, steps=2, seed=3), flatten(net)


def attack_round(attack, model, t, w, lr=0.1):
    ctx = AttackContext(np.random.default_rng([7, t]), n=10, f=4, lr=lr, round=t, aggregator=None)
    ctx.model = model.at(t, w, lr)
    return attack(np.zeros((4, w.size), np.float32), None, ctx)


def test_the_layers_it_reads():
    model, _ = attacker_model()
    assert layer_slices(model.model) == (slice(0, 18), slice(20, 180), 0)
    assert model.output == (185, 4, 5)


def test_a_round_plants_the_indicators_and_masks_only_the_output_layer():
    model, w = attacker_model()
    attack = ThreeDFed(target=3, num_neurons=2, poison_epochs=2, n_classes=4)
    out = attack_round(attack, model, 0, w)
    assert out.dtype == np.float32 and out.shape == (4, w.size) and np.isfinite(out).all()
    s = attack.state
    assert int(s["k"]) == 0 and int(s["attackers"]) == 4 and not bool(s["weak_dp"])
    assert ((s["positions"] >= 0) & (s["positions"] < 18)).all() and len(set(s["positions"].tolist())) == 4
    # the planted values are the uploads' (in weight units, -lr times the gradient units)
    np.testing.assert_allclose(out[np.arange(4), s["positions"]] * np.float32(-0.1), s["values"], rtol=1e-6)
    # the attackers share the backdoor update: they differ at the output layer and the indicators only
    differs = np.flatnonzero((out != out[0]).any(axis=0))
    assert set(differs.tolist()) <= set(range(185, 209)) | set(s["positions"].tolist())
    # the same draws give the same rows
    again = attack_round(ThreeDFed(target=3, num_neurons=2, poison_epochs=2, n_classes=4), model, 0, w)
    np.testing.assert_array_equal(out, again)


def test_rejections_add_a_decoy_and_noise_means_weak_dp():
    model, w = attacker_model()
    attack = ThreeDFed(target=3, num_neurons=2, poison_epochs=2, alpha_low=0.5, n_classes=4)
    attack_round(attack, model, 0, w)
    first = dict(attack.state)
    # the global weights did not move: every indicator reads 0, rejected; one decoy in the last row
    out = attack_round(attack, model, 1, w)
    assert int(attack.state["k"]) == 1 and int(attack.state["attackers"]) == 3
    assert all(0.5 <= a < 1 for a in attack.state["alpha"])
    decoy = np.flatnonzero(out[3] != out[0])  # trained on its own loss: it differs beyond the masks
    assert not set(decoy.tolist()) <= set(range(185, 209)) | set(attack.state["positions"].tolist())
    # a feedback above 1: the server adds noise; every alpha 0.1 from then on
    moved = w.copy()
    second = attack.state
    moved[second["positions"][0]] += np.float32(2 * second["values"][0])
    attack_round(attack, model, 2, moved)
    assert bool(attack.state["weak_dp"]) and attack.state["alpha"].tolist() == [0.1, 0.1]
    assert first["w"].tobytes() == w.tobytes()


RUN = [
    "run",
    "--dataset", "synthetic", "--model", "mlp", "--clients", "6", "--byzantine", "3", "--partition", "iid",
    "--topology", "server", "--aggregator", "mean", "--rounds", "3", "--eval-every", "1", "--quiet",
    "--attack", "threedfed", "--set", "attack.num_neurons=3", "--set", "attack.poison_epochs=2",
]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.slow
def test_a_run_is_the_same_on_one_and_two_ranks_and_records_the_success_rate(tmp_path):
    """Three attackers (two uploads and, once the indicators read a rejection, decoys), across two
    ranks on two: the attack runs on rank 0 and its rows reach the other rank's attackers."""
    one = same_on_one_and_two_ranks(RUN, tmp_path)
    asr = one["metrics/attack_success_rate"]
    assert asr.shape == (3,) and np.isfinite(asr).all()
