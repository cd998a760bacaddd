"""The attacks ported from FLPoison and Blades (issue 33), against their references' own outputs.

Reference values are literal: computed once with the references' code (the functions copied
into a script, trainer plumbing removed, in float64) and pasted here:

* FLPoison, github.com/vio1etus/FLPoison at commit 368c9403e5dd27775a09af211a7a9d82fbe890ee:
  ``attackers/dba.py`` (``implant_distributed_backdoor``, ``setup_trigger_position``) with
  ``attackers/synthesizers/synthesizer.py`` and ``pixel_synthesizer.py``;
  ``attackers/neurotoxin.py`` (``get_gradient_mask``, ``step``);
  ``attackers/modelreplacement.py`` and ``attackers/edgecase.py`` (``non_omniscient``, ``step``);
  ``datapreprocessor/edge_dataset.py`` (``ARDIS.read_dataset``).
* Neurotoxin's authors, github.com/jhcknzzm/Federated-Learning-Backdoor at commit
  21a9eafc00240b6eea7c2c202bcb8249ee880491: ``FL_Backdoor_CV/helper.py`` (``grad_mask_cv``,
  ``aggregate_all_layer == 1``).
* Blades, github.com/lishenghui/blades at commit 711e8dfe535261155f6a991d9e0cc766831c0fa1:
  ``blades/adversaries/attackclippedclustering_adversary.py`` (``_chain_attack``, scikit-learn
  1.9 with ``metric="precomputed"`` for the removed ``affinity``) and
  ``blades/adversaries/signguard_adversary.py`` (``_attack_sign_guard``, its draws taken from
  ``torch.manual_seed(0)``).

The deliberate differences are in docs/attacks.md ("Backdoors and the FLPoison and Blades
attacks"). The end-to-end runs at the bottom train 3 rounds on 2 ranks and read
``/metrics/attack_success_rate``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from conftest import crash_at_round, fedring, fedring_many

from fedring import arrays
from fedring.attacks import AttackContext, Backdoor, ModelAttack, make_attack
from fedring.attacks import base as attack_base
from fedring.attacks.blades import chain_coefficients, signguard_noise
from fedring.attacks.dba import DBA, pattern_corner
from fedring.attacks.neurotoxin import Neurotoxin, bottom_mask, project_l2
from fedring.errors import ConfigError
from fedring.train.clients import ATTACK_MEMORY, Clients
from fedring.train.data import Shard
from fedring.train.device import Staging
from fedring.train.optim import ClientOptimizer


def upload(cl, client, u, w=None, lr=1.0):
    """``client``'s upload of ``u`` through :meth:`Clients.upload` (on the host path the vector is built in its row)."""
    cl.rows[client] = np.array(u, np.float32)
    cl.upload(client, w, lr)
    return cl.rows[client].copy()


def clients(attack, poisoned, d=4, shards=None):
    """A rank's :class:`Clients` holding every client of ``poisoned`` (a mask), built as a run builds it."""
    n = len(poisoned)
    cfg = SimpleNamespace(seed=0, batch_size=4, local_steps=1, local_epochs=None)
    layout = SimpleNamespace(n_local=n, lo=0, hi=n, n_clients=n, local_clients=range(n))
    stage = Staging(torch.device("cpu"), d)
    shards = shards or [Shard(np.zeros((4, 1, 8, 8), np.float32), np.arange(4) % 3) for _ in range(n)]
    return Clients(cfg, layout, shards, stage, None, ClientOptimizer(), np.array(poisoned), attack, lambda t: 0.1, d)


# -- DBA ------------------------------------------------------------------------------------

#: FLPoison's DBA on a 1 x 28 x 28 image: the flat indices of the pixels set by worker 0 ... 4 in
#: training and by the global trigger at test time, for trigger_factor [8, 2, 0] (its default)
#: and [4, 2, 0] (the paper's MNIST trigger); every poisoned sample is labelled target 7
FLPOISON_DBA = {
    8: {
        0: [0, 1, 2, 3, 4, 5, 6, 7],
        1: [10, 11, 12, 13, 14, 15, 16, 17],
        2: [84, 85, 86, 87, 88, 89, 90, 91],
        3: [94, 95, 96, 97, 98, 99, 100, 101],
        4: [0, 1, 2, 3, 4, 5, 6, 7],
        "test": [*range(0, 8), *range(10, 18), *range(84, 92), *range(94, 102)],
    },
    4: {
        0: [0, 1, 2, 3],
        1: [6, 7, 8, 9],
        2: [84, 85, 86, 87],
        3: [90, 91, 92, 93],
        4: [0, 1, 2, 3],
        "test": [0, 1, 2, 3, 6, 7, 8, 9, 84, 85, 86, 87, 90, 91, 92, 93],
    },
}


@pytest.mark.parametrize("size", [8, 4])
def test_dba_local_and_global_triggers_are_flpoisons(size):
    dba = DBA(size=size, scale=1)
    image = np.zeros((1, 1, 28, 28), np.float32)
    for worker in range(5):
        stamped = dba.attacker(worker).stamp(image)
        assert np.flatnonzero(stamped).tolist() == FLPOISON_DBA[size][worker], worker
    assert np.flatnonzero(dba.stamp(image)).tolist() == FLPOISON_DBA[size]["test"]
    assert not image.any()  # a copy


def test_dba_geometry_channels_and_refusals():
    assert [pattern_corner(i, 6, 3, 1) for i in range(5)] == [(1, 1), (1, 10), (5, 1), (5, 10), (9, 1)]
    rgb = DBA(size=6, gap=3, scale=1, value=0.5).stamp(np.zeros((2, 3, 32, 32)))
    assert (rgb[:, :, 0, 0:6] == 0.5).all() and (rgb[:, :, 0, 9:15] == 0.5).all() and (rgb[:, :, 4, 9:15] == 0.5).all()
    assert rgb.sum() == 2 * 3 * 24 * 0.5
    with pytest.raises(ValueError, match="at least 4 x 10 pixels"):
        DBA(scale=1).stamp(np.zeros((1, 1, 28, 9)))
    with pytest.raises(ValueError, match="images"):
        DBA(scale=1).stamp(np.zeros((1, 784)))
    for key, params in [("attack.parts", {"parts": 0}), ("attack.size", {"size": 1.5}), ("attack.gap", {"gap": -1})]:
        with pytest.raises(ConfigError) as err:
            make_attack("dba", params, n_clients=5)
        assert err.value.key == key
    assert make_attack("dba", {}, n_clients=5).scale == 5  # the backdoor's model replacement by default


def test_each_attacker_poisons_with_its_own_bar_and_the_evaluation_sees_the_global_trigger():
    dba = DBA(size=2, gap=1, fraction=1.0, scale=1)
    poisoned = [False, True, False, True, True]
    shards = [Shard(np.zeros((4, 1, 8, 8), np.float32), np.array([1, 2, 1, 2])) for _ in poisoned]
    cl = clients(dba, poisoned, shards=shards)
    for client, bar in ((1, 0), (3, 1), (4, 2)):  # attackers 0, 1, 2 in client order
        x, y = next(cl.batches(0, client))
        r, c = pattern_corner(bar, 2, 1, 0)
        expected = np.zeros((8, 8))
        expected[r, c : c + 2] = 1
        assert (x == expected).all() and (y == 0).all(), client
    x, _ = next(cl.batches(0, 0))
    assert not x.any()  # an honest client trains on its own data
    assert isinstance(dba, Backdoor) and np.flatnonzero(dba.stamp(np.zeros((1, 1, 8, 8)))).tolist() == [
        0,
        1,
        3,
        4,
        16,
        17,
        19,
        20,
    ]


def test_dba_poisons_the_backdoors_fraction_reproducibly():
    dba = make_attack("dba", {"fraction": 0.5}, n_clients=4).attacker(1)
    x, y = np.zeros((10, 1, 28, 28), np.float32), np.arange(10) % 3 + 1
    x1, y1 = dba.poison(x, y, np.random.default_rng(5))
    x2, y2 = dba.poison(x, y, np.random.default_rng(5))
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    hit = x1.reshape(10, -1).any(axis=1)
    assert hit.sum() == 5 and (y1[hit] == 0).all() and np.array_equal(y1[~hit], y[~hit])
    assert (x1[hit][:, 0, 0, 6:10] == 1).all() and x1[hit].sum() == 5 * 4  # bar 1 only


# -- Neurotoxin -----------------------------------------------------------------------------

GRADIENT = np.array([0.5, -2.0, 0.03, -0.2, 1.1, -0.04, 0.7, 0.001, -0.9, 0.3])

#: the authors' grad_mask_cv masks of GRADIENT: the int(10 * ratio) smallest |g|
AUTHORS_MASK = {
    0.7: [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0],
    0.95: [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    0.5: [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0],
}
#: FLPoison's get_gradient_mask of GRADIENT: the int(10 * topk_ratio) smallest *signed* values
FLPOISON_MASK = {0.1: [0, 1, 0, 0, 0, 0, 0, 0, 0, 0], 0.3: [0, 1, 0, 1, 0, 0, 0, 0, 1, 0]}


@pytest.mark.parametrize("keep", sorted(AUTHORS_MASK))
def test_neurotoxin_mask_is_the_authors(keep):
    assert bottom_mask(GRADIENT, keep).tolist() == AUTHORS_MASK[keep]


def test_flpoisons_mask_keeps_the_most_negative_coordinates_instead():
    # the documented difference: argpartition of the signed gradient, not of its magnitude
    for ratio, mask in FLPOISON_MASK.items():
        assert bottom_mask(GRADIENT, ratio).tolist() != mask
        assert bottom_mask(np.exp(GRADIENT), ratio).tolist() == mask  # small |exp(g)|: small signed g


def test_norm_projection_is_flpoisons_clip_and_edgecases_pgd():
    # FLPoison Neurotoxin.step, norm_threshold 0.2: [0.3, -0.4, 0] -> [0.12, -0.16, 0]; unchanged within
    for diff, expected in (([0.3, -0.4, 0.0], [0.12, -0.16000000000000003, 0.0]), ([0.01, 0.02, -0.02], None)):
        u = np.array(diff)
        project_l2(u, 1.0, 0.2)
        np.testing.assert_allclose(u, expected or diff, rtol=1e-7)  # a float32 factor
    # FLPoison EdgeCase.step (l_2, epsilon 0.25): G = w, X = w_local; fedring uploads (G - X) / lr
    G, X = np.array([0.5, -1.0, 2.0, 0.25]), np.array([0.4, -0.7, 2.2, 0.25])
    u = (G - X) / 0.1
    project_l2(u, 0.1, 0.25)
    np.testing.assert_allclose(G - 0.1 * u, [0.43318468952189393, -0.7995540685656818, 2.1336306209562124, 0.25])
    u = np.ones(3)
    project_l2(u, 0.1, None)
    assert u.tolist() == [1, 1, 1]


def test_neurotoxin_masks_with_the_update_since_it_last_took_part_and_remembers_it():
    nt = Neurotoxin(keep=0.7)
    cl = clients(nt, [False, True], d=10)
    memory = cl.state[ATTACK_MEMORY]
    assert memory.shape == (2, 10) and np.isnan(memory).all()
    w0 = np.zeros(10, np.float32)
    out = upload(cl, 1, np.ones(10), w0, 0.1)  # first time: nothing to mask with
    assert out.tolist() == [1.0] * 10 and np.array_equal(memory[1], w0) and np.isnan(memory[0]).all()
    w1 = (w0 + GRADIENT).astype(np.float32)  # the global model moved by GRADIENT
    out = upload(cl, 1, np.full(10, 2), w1, 0.1)
    assert out.tolist() == [2.0 * m for m in AUTHORS_MASK[0.7]] and np.array_equal(memory[1], w1)
    out = upload(cl, 0, np.full(10, 2), w1, 0.1)  # an honest client: untouched
    assert out.tolist() == [2.0] * 10


def test_neurotoxin_on_the_device_path_is_the_host_paths():
    """The remembered models and masks do not depend on where the clients compute (the device path
    on the CPU, as tests/test_device.py compares the paths): 3 rounds, every upload bit for bit."""
    from mpi4py import MPI

    from fedring.config import Config
    from fedring.train.loop import train_round
    from fedring.train.task import TrainTask
    from fedring.train.trainer import Trainer

    def uploads(host_path):
        settings = {"dataset": "synthetic", "model": "mlp", "clients": 4, "rounds": 3, "quiet": True}
        cfg = Config(**settings, byzantine=2, attack="neurotoxin", sections={"attack": {"keep": 0.5}})
        TrainTask(cfg, 1)
        tr = Trainer(cfg, MPI.COMM_WORLD, host_path)
        seen, aggregate = [], tr.topology.aggregate

        def recorded(rows, *args):
            seen.append(np.array(arrays.host(rows)))
            return aggregate(rows, *args)

        tr.topology.aggregate = recorded
        for t in range(3):
            train_round(tr, t)
        return seen, tr.clients.state[ATTACK_MEMORY]

    (host, memory), (device, device_memory) = uploads(None), uploads(False)
    for a, b in zip(host, device, strict=True):
        assert a.tobytes() == b.tobytes()
    assert memory.tobytes() == device_memory.tobytes() and not np.isnan(memory[:, 0]).all()
    assert (host[2] == 0).sum() > (host[0] == 0).sum()  # masked from round 1 on


def test_neurotoxin_settings():
    assert make_attack("neurotoxin", {}).scale == 1.0 and make_attack("neurotoxin", {}).keep == 0.95
    for key, params in [("attack.keep", {"keep": 0}), ("attack.keep", {"keep": 1.5}), ("attack.norm", {"norm": 0})]:
        with pytest.raises(ConfigError) as err:
            make_attack("neurotoxin", params)
        assert err.value.key == key
    assert Neurotoxin.remembers and not Backdoor.remembers


# -- ModelReplacement: fedring's backdoor with scale = n / eta --------------------------------


def test_model_replacement_is_the_backdoor_with_its_scale():
    """FLPoison's ModelReplacement.non_omniscient: FedSGD ``s * update``, FedAvg ``G + s (X - G)``,
    s = scaling_factor (50 = n / eta); fedring's backdoor multiplies the upload by ``attack.scale``."""
    bd = make_attack("backdoor", {"scale": 50})
    cl = clients(bd, [True])
    out = upload(cl, 0, [1.0, -3.0, -2.0, 0.0])
    assert out.tolist() == [50.0, -150.0, -100.0, 0.0]  # FLPoison FedSGD
    G, X, lr = np.array([0.5, -1.0, 2.0, 0.25]), np.array([0.4, -0.7, 2.2, 0.25]), 0.1
    out = upload(cl, 0, (G - X) / lr)  # several local steps: (w - w_local) / lr
    np.testing.assert_allclose(
        G - lr * out, [-4.499999999999999, 14.000000000000002, 12.000000000000009, 0.25], rtol=1e-6
    )  # FLPoison FedAvg: the mean of one client is the replaced model
    assert make_attack("backdoor", {}, n_clients=50).scale == 50  # n, the paper's n / eta with eta = 1


# -- EdgeCase -------------------------------------------------------------------------------


def test_edgecase_pgd_then_scaling_is_flpoisons():
    ec = make_attack("edgecase", {"norm": 0.25, "scale": 50})
    cl = clients(ec, [True])
    G, X, lr = np.array([0.5, -1.0, 2.0, 0.25]), np.array([0.4, -0.7, 2.2, 0.25]), 0.1
    out = upload(cl, 0, (G - X) / lr, None, lr)
    np.testing.assert_allclose(
        G - lr * out, [-2.8407655239053033, 9.022296571715911, 8.68153104781062, 0.25], rtol=1e-6
    )


def test_edgecase_replaces_part_of_the_batch_with_source_samples_labelled_target():
    ec = make_attack("edgecase", {"target": 3, "fraction": 0.5, "source_class": 2, "samples": 5}, n_clients=4)
    from fedring.datasets.synthetic import Synthetic

    src = Synthetic()
    rows = np.flatnonzero(src.train_labels() == 2)[:5]
    x, y = np.full((8, 1, 28, 28), -1.0, np.float32), np.arange(8)
    x1, y1 = ec.poison(x, y, np.random.default_rng(1))
    x2, _ = ec.poison(x, y, np.random.default_rng(1))
    assert np.array_equal(x1, x2)
    replaced = (x1 != -1).reshape(8, -1).any(axis=1)
    assert replaced.sum() == 4 and (y1[replaced] == 3).all() and np.array_equal(y1[~replaced], y[~replaced])
    pool = src.train_images(rows)
    assert all(any(np.array_equal(s, p) for p in pool) for s in x1[replaced])
    test = ec.success_set((1, 28, 28))
    assert np.array_equal(test, src.test_images(np.flatnonzero(src.test_labels() == 2)))
    with pytest.raises(TypeError, match="no trigger"):
        ec.stamp(x)


def test_edgecase_refuses_a_source_of_another_shape_and_bad_settings():
    ec = make_attack("edgecase", {"source": "cifar10"}, n_clients=4)
    with pytest.raises(ConfigError) as err:
        ec.success_set((1, 28, 28))
    assert err.value.key == "attack.source" and "(3, 32, 32)" in str(err.value) and "(1, 28, 28)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        ec.poison(np.zeros((2, 1, 28, 28), np.float32), np.zeros(2, np.int64), np.random.default_rng(0))
    assert err.value.key == "attack.source"
    for key, params in [
        ("attack.source", {"source": "ardis"}),
        ("attack.source", {"source": "shakespeare"}),
        ("attack.source_class", {"source_class": 10}),
        ("attack.samples", {"samples": 0}),
        ("attack.norm", {"norm": -1}),
        ("attack.value", {"value": 1.0}),
    ]:
        with pytest.raises(ConfigError) as err:
            make_attack("edgecase", params, n_clients=4)
        assert err.value.key == key, params


def test_flpoisons_ardis_filter_takes_one_image_again_and_again():
    # ARDIS.read_dataset: indices = train_y[train_y == 7] are label values, not rows, so every
    # "seven" is image number 7; fedring takes the rows of the class (np.flatnonzero)
    train_y = np.array([1, 7, 3, 7, 7, 0, 7])
    assert train_y[train_y == 7].tolist() == [7, 7, 7, 7]
    assert np.flatnonzero(train_y == 7).tolist() == [1, 3, 4, 6]


def test_trigger_attacks_are_backdoors_for_the_evaluation():
    built = {name: make_attack(name, {}, n_clients=6) for name in ("dba", "neurotoxin", "edgecase")}
    assert all(isinstance(a, Backdoor) for a in built.values())
    assert built["dba"].success_set((1, 28, 28)) is None and built["neurotoxin"].success_set((1, 28, 28)) is None
    assert built["edgecase"].success_set((1, 28, 28)).shape == (1000, 1, 28, 28)


# -- Blades ---------------------------------------------------------------------------------

#: honest rows and the three chained vectors of Blades' _chain_attack (3 malicious clients)
BLADES_CHAIN = {
    "A": (
        [
            [1.0, 0.2, 0.0, 0.5],
            [0.9, 0.3, 0.1, 0.4],
            [1.1, 0.1, -0.1, 0.6],
            [-0.5, 1.0, 0.3, 0.0],
            [0.8, 0.25, 0.05, 0.55],
        ],
        ([0, 0, 0, 1, 0], 0, 2),
        [
            [8.749379931706411, 0.5169592065517494, -0.9121629045694484, 4.727479542519665],
            [92.65336448596558, 5.196828691703487, -9.775957579087644, 50.01784325514209],
            [981.9531884391216, 54.814552288668985, -103.71688948399323, 530.0537462855065],
        ],
    ),
    "B": (
        [[0.3, -1.0, 0.2], [0.5, -0.8, 0.1], [-0.2, 0.4, 1.0], [0.4, -0.9, 0.3]],
        ([0, 0, 1, 0], 0, 1),
        [
            [5.4361947563727355, -8.381055972705472, 0.4535276762927375],
            [59.452877627985224, -91.35212065691668, 4.3456084298776965],
            [646.4258508635281, -992.9825926146135, 46.687632638642604],
        ],
    ),
    # the group is rows 1 and 2, its furthest row from the mean is its 2nd (row 2), and the chain
    # starts from honest row 1 (Blades' index); the second turn passes pi: -10 * mean
    "C": (
        [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.05]],
        ([1, 0, 0], 0, 1),
        [[0.0, -7.910635414283269], [-0.0, -3.5000000000000004], [-0.0, -3.5000000000000004]],
    ),
    # two clusters of two: scikit-learn's label 0 (the later-merged cluster) is the "larger group"
    "D": (
        [[1.0, 0.0], [0.95, 0.1], [0.0, 1.0], [0.1, 0.9]],
        ([1, 1, 0, 0], 0, 0),
        [
            [9.998720801922547, -0.046604103050218455],
            [100.40006780832287, -0.5145754380801265],
            [1008.5323375105787, -5.215398665837302],
        ],
    ),
}


def context(n, f, seed=0):
    return AttackContext(np.random.default_rng(seed), n=n, f=f, lr=0.1, round=0, aggregator=None)


@pytest.mark.parametrize("case", sorted(BLADES_CHAIN))
def test_clippedclustering_attack_is_blades_chain(case):
    rows, (labels, flag, k), expected = BLADES_CHAIN[case]
    honest = np.array(rows)
    out = make_attack("clippedclustering_attack", {})(np.zeros((3, honest.shape[1])), honest, context(len(rows) + 3, 3))
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-15)
    mu = honest.mean(axis=0)
    *_, k_found, figures = chain_coefficients(honest @ honest.T, honest @ mu, float(mu @ mu), 3, 10.0, 0.1)
    assert (figures["labels"].tolist(), figures["flag"], k_found) == (labels, flag, k)


def test_clippedclustering_attack_settings_and_check():
    attack = make_attack("clippedclustering_attack", {"scale": 1.0, "margin": 0.0})
    assert (attack.scale, attack.margin, attack.knowledge) == (1.0, 0.0, "omniscient")
    assert attack.check(4, 3) is not None and attack.check(4, 3).key == "byzantine" and attack.check(4, 2) is None
    for key, params in [("attack.scale", {"scale": 0}), ("attack.margin", {"margin": -0.1})]:
        with pytest.raises(ConfigError) as err:
            make_attack("clippedclustering_attack", params)
        assert err.value.key == key


def test_signguard_attack_is_blades_vector_from_the_same_draws():
    # Blades with torch.manual_seed(0) on the honest mean [0.75, -1.5, 0, 0, 0]:
    # torch.rand(1) = 0.9700530018065531, torch.rand(1) = 0.707819864399788, torch.randperm(5) = [3, 4, 0, 1, 2]
    mu = np.array([[1.0, -2.0, 0.0, 0.5, 0.0], [0.5, -1.0, 0.0, -0.5, 0.0]]).mean(axis=0)
    v = signguard_noise(mu, np.array([0.9700530018065531]), np.array([0.707819864399788]), np.array([3, 4, 0, 1, 2]))
    assert v.tolist() == [0.0, 0.0, 0.9700530018065531, -0.707819864399788, 0.0]  # Blades' output


def test_signguard_attack_keeps_the_sign_counts_of_the_honest_mean():
    rng = np.random.default_rng(2)
    honest = rng.normal(0.1, 1, (6, 200))
    honest[:, :20] = 0.0
    out = make_attack("signguard_attack", {})(np.zeros((2, 200)), honest, context(8, 2, seed=3))
    mu = honest.mean(axis=0)
    assert np.array_equal(out[0], out[1])  # every attacker sends the same vector
    for sign in (-1, 0, 1):
        assert (np.sign(out[0]) == sign).sum() == (np.sign(mu) == sign).sum()
    assert np.abs(out).max() < 1
    again = make_attack("signguard_attack", {})(np.zeros((2, 200)), honest, context(8, 2, seed=3))
    assert np.array_equal(out, again)


@pytest.mark.parametrize("name", ["clippedclustering_attack", "signguard_attack"])
def test_blades_attacks_blockwise_match_one_piece(name, monkeypatch):
    attack = make_attack(name, {})
    assert isinstance(attack, ModelAttack) and attack.blockwise
    rng = np.random.default_rng(7)
    honest = (rng.standard_normal((11, 23)) + 0.3).astype(np.float32)
    byz = rng.standard_normal((3, 23)).astype(np.float32)
    monkeypatch.setattr(attack_base, "BLOCK", 1 << 30)
    whole = attack(byz.astype(np.float64), honest.astype(np.float64), context(14, 3))
    for block in (2, 3, 5, 22):
        monkeypatch.setattr(attack_base, "BLOCK", block)
        assert attack(byz.astype(np.float64), honest, context(14, 3)).tobytes() == whole.tobytes(), block
        assert attack(byz, honest, context(14, 3)).tobytes() == whole.astype(np.float32).tobytes(), block


# -- end to end: 3 rounds on 2 ranks, the success rate recorded -----------------------------

COMMON = ["--dataset", "synthetic", "--model", "mlp", "--clients", "7", "--quiet", "--lr", "0.01"]
COMMON += ["--topology", "server", "--aggregator", "mean", "--byzantine", "2", "--eval-every", "1"]
FMNIST = "/usr/share/datasets/fashion-mnist"

RUNS = {
    "dba": ["--rounds", "3", "--attack", "dba"],
    "neurotoxin": ["--rounds", "3", "--attack", "neurotoxin", "--set", "attack.keep=0.5"],
    "edgecase": ["--rounds", "3", "--attack", "edgecase", "--set", "attack.source_class=3"],
    "edgecase-fmnist": [
        "--rounds",
        "3",
        "--attack",
        "edgecase",
        "--set",
        "attack.source=fashion-mnist",
        "--set",
        f"attack.source_dir={FMNIST}",
        "--set",
        "attack.norm=0.5",
    ],
    "backdoor": ["--rounds", "3", "--attack", "backdoor"],
    "clippedclustering": ["--rounds", "2", "--aggregator", "clippedclustering", "--attack", "clippedclustering_attack"],
    "signguard": ["--rounds", "2", "--aggregator", "signguard", "--attack", "signguard_attack"],
}
#: Neurotoxin's resumed run: its remembered models are in the checkpoint
NEUROTOXIN = [*COMMON, "--attack", "neurotoxin", "--set", "attack.keep=0.5", "--rounds", "5", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("backdoors")
    runs = {name: [*COMMON, *args, "--out", str(root / f"{name}.h5")] for name, args in RUNS.items()}
    if not Path(FMNIST).is_dir():
        del runs["edgecase-fmnist"]
    runs["neurotoxin-straight"] = [*NEUROTOXIN, "--out", str(root / "neurotoxin-straight.h5")]
    codes = fedring_many(2, runs, root, timeout=600)[0]
    return root, codes


def metrics(path):
    with h5py.File(path, "r") as f:
        return f.attrs["status"], {k: v[:] for k, v in f["metrics"].items()}, f["model/final"][:]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dba", "neurotoxin", "edgecase", "edgecase-fmnist", "backdoor"])
def test_backdoor_runs_record_the_attack_success_rate(runs, name):
    root, codes = runs
    if name not in codes:
        pytest.skip(f"no Fashion-MNIST files in {FMNIST}")
    assert codes[name] == 0
    status, m, model = metrics(root / f"{name}.h5")
    asr = m["attack_success_rate"]
    assert status == "complete" and asr.shape == (3,) and np.all((asr >= 0) & (asr <= 1)) and np.isfinite(model).all()
    if name in ("dba", "edgecase"):
        assert asr[-1] > 0.5  # the mean does not resist a backdoor scaled by n


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", ["clippedclustering", "signguard"])
def test_blades_attacks_run_against_their_defences(runs, name):
    root, codes = runs
    assert codes[name] == 0
    status, m, model = metrics(root / f"{name}.h5")
    assert status == "complete" and np.isfinite(model).all() and "attack_success_rate" not in m


@pytest.mark.mpi
@pytest.mark.slow
def test_neurotoxin_resumes_bit_identically(runs, tmp_path):
    root, codes = runs
    assert codes["neurotoxin-straight"] == 0
    out = tmp_path / "resumed.h5"
    crash_at_round(tmp_path, 2, 3, [*NEUROTOXIN, "--out", str(out)])  # the last checkpoint: round 2
    with h5py.File(out, "r") as f:
        slots = f["checkpoint"]
        assert "client_attack" in slots[slots.attrs["current"]]
    fedring(2, *NEUROTOXIN, "--out", str(out), "--resume")
    straight, resumed = metrics(root / "neurotoxin-straight.h5"), metrics(out)
    assert straight[0] == resumed[0] == "complete"
    assert straight[2].tobytes() == resumed[2].tobytes()
    for key in straight[1]:
        if key != "wall_seconds":
            assert straight[1][key].tobytes() == resumed[1][key].tobytes(), key


def test_edgecase_of_another_shape_is_refused_before_training(fedring_cli, tmp_path):
    proc = fedring_cli(
        *COMMON, "--rounds", "1", "--attack", "edgecase", "--set", "attack.source=cifar10", "--out", tmp_path / "x.h5"
    )
    assert proc.returncode != 0
    assert "attack.source" in proc.stderr + proc.stdout and "(3, 32, 32)" in proc.stderr + proc.stdout
