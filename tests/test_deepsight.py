"""DeepSight (``fedring/aggregators/deepsight.py``), its probe of the model, and a run that uses it.

Reference: FLPoison, github.com/vio1etus/FLPoison at commit 368c9403e5dd27775a09af211a7a9d82fbe890ee,
``aggregators/deepsight.py`` with ``aggregator_utils.py`` and ``fl/models/model_utils.py``, loaded
on their own (the packages' ``__init__`` import every defence and model), run once outside this
repository to print the vectors below, in FLPoison's pinned versions of the libraries that decide
the clusters (scikit-learn 1.6.1, hdbscan 0.8.40) with numpy 2.4.6 and torch 2.13 CPU. Its
inputs: algorithm ``FedSGD`` with the uploads ``-lr * X`` (a FedSGD client uploads
``w_local - w``), lr 1; as the global model a float64 softmax regression on 1 x 2 x 2 images with
4 classes whose flat parameters are ``W_*`` (the clients' models are ``w - X[i]``), ending in a
softmax (the paper's probabilities; FLPoison's models return logits, docs/aggregators.md); and
fedring's random inputs (:meth:`DeepSight.random_inputs`) written into its ``RandDataset``\\ s, 500
per set, batch size 64. Its returned update, negated, is fedring's vector.

Agreement: the same clusters and accepted clients on every case; the vectors to 1.2e-16
(asserted to rtol 1e-12), the NEUPs exactly, the threshold exceedings exactly. FLPoison sums the
DDifs in a float32 accumulator (``torch.zeros(num_classes)``): each of its ceil(500 / 64) = 8
additions rounds by up to 2^-24 relative, so its DDifs are within 8 * 2^-24 = 4.8e-7 relative of
fedring's float64 sums (measured: 5e-7 absolute on values near 1; asserted to rtol 1e-6). Case E
accepts nobody: FLPoison's mean of no rows raises (its warnings filter turns numpy's
RuntimeWarning into an error); fedring returns the zero vector.
"""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from conftest import fedring
from mpi4py import MPI

from fedring.aggregators import make_aggregator
from fedring.aggregators.deepsight import DeepSight, neups
from fedring.aggregators.probe import LinearProbe, OutputLayer
from fedring.config import Config
from fedring.errors import ConfigError
from fedring.train.models import load_flat
from fedring.train.probe import output_layer

# fmt: off
W_A = [0.17, 0.41, 0.17, -0.65, 0.45, 0.22, -0.27, 0.29, 0.18, 0.15,
      0.01, 0.27, -0.37, -0.08, -0.24, 0.3, 0.02, -0.15, -0.39, -0.13]
X_A = np.array([[-0.12, -0.15, 0.38, 0.21, -0.82, -0.56, -0.05, -0.18, 0.12, 0.15,
                0.67, -0.42, -0.04, 0.56, 0.28, 0.09, -0.06, -0.5, -0.07, 0.0],
               [0.01, -0.06, 0.29, 0.19, -0.79, -0.61, -0.03, -0.05, -0.1, 0.09,
                0.76, -0.36, -0.19, 0.69, 0.22, 0.29, -0.19, -0.64, 0.04, -0.01],
               [0.08, -0.06, 0.23, 0.18, -0.72, -0.5, -0.12, -0.13, 0.11, 0.11,
                0.72, -0.31, -0.12, 0.59, 0.3, -0.03, -0.17, -0.49, -0.09, 0.07],
               [-0.06, 0.0, 0.38, 0.37, -0.69, -0.53, -0.14, -0.28, 0.24, 0.05,
                0.57, -0.32, -0.13, 0.7, 0.2, 0.2, -0.23, -0.45, -0.05, 0.1],
               [0.15, -0.24, 0.14, 0.36, -0.56, -0.67, -0.18, -0.07, -0.02, 0.01,
                0.6, -0.28, -0.15, 0.64, 0.18, 0.11, -0.19, -0.59, 0.05, -0.08],
               [-0.11, 0.06, 0.38, 0.3, -0.76, -0.61, -0.08, -0.08, 0.09, -0.05,
                0.72, -0.39, -0.22, 0.52, 0.15, 0.36, -0.27, -0.48, -0.16, 0.03],
               [0.09, -0.11, 0.33, 0.33, -0.74, -0.5, 0.14, -0.11, 0.0, 0.05,
                0.63, -0.32, -0.12, 0.63, 0.03, 0.28, -0.21, -0.61, 0.11, 0.16],
               [-0.96, -1.02, -1.01, -0.98, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.55, 0.0, 0.0, 0.0],
               [-0.98, -0.99, -1.03, -1.07, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.51, 0.0, 0.0, 0.0],
               [-1.04, -0.95, -0.99, -0.96, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.49, 0.0, 0.0, 0.0],
               [-0.99, -1.04, -0.97, -0.91, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.52, 0.0, 0.0, 0.0],
               [-1.03, -1.01, -1.02, -1.04, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.49, 0.0, 0.0, 0.0]])
W_B = [0.09, -0.26, -0.21, -1.22, 0.9, 0.57, -0.16, 0.39, 0.14, -0.28,
      0.49, -0.16, -0.16, -0.4, 0.23, -0.05, 0.27, -0.3, 0.06, -0.45]
X_B = np.array([[1.66, 1.42, 0.14, 0.09, -2.16, 1.99, 3.56, -2.15, -4.24, -2.03,
                2.14, -0.62, 2.03, 2.03, 0.43, 1.11, 1.12, 1.73, -2.2, -1.22],
               [0.32, 0.04, 0.08, 0.11, -0.24, 0.13, 0.46, -0.73, -0.4, -0.44,
                0.4, 0.04, 0.25, 0.26, 0.06, -0.04, -0.14, 0.44, -0.3, -0.08],
               [0.22, -0.01, 0.19, 0.11, -0.38, 0.22, 0.53, -0.47, -0.41, -0.54,
                0.4, -0.03, 0.34, 0.13, 0.04, 0.09, -0.09, 0.19, -0.41, -0.21],
               [0.1, 0.03, 0.14, 0.21, -0.24, 0.48, 0.65, -0.54, -0.33, -0.56,
                0.35, -0.06, 0.36, 0.02, 0.15, 0.07, -0.15, 0.43, -0.26, -0.12],
               [0.18, 0.05, 0.08, 0.2, -0.22, 0.17, 0.56, -0.54, -0.65, -0.51,
                0.24, 0.11, 0.46, 0.14, 0.12, 0.04, 0.16, 0.26, -0.29, -0.22],
               [0.17, 0.08, 0.06, 0.16, -0.46, 0.3, 0.53, -0.32, -0.55, -0.34,
                0.11, 0.08, 0.23, 0.17, 0.07, 0.05, -0.02, 0.34, -0.27, -0.14],
               [0.12, -0.02, 0.08, -0.09, -0.23, 0.21, 0.59, -0.4, -0.45, -0.43,
                0.15, 0.07, 0.36, 0.13, 0.17, 0.14, -0.25, 0.27, -0.47, -0.01],
               [-1.08, -0.97, -1.0, -0.99, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.46, 0.0, 0.0, 0.0],
               [-1.04, -1.06, -1.09, -1.02, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.46, 0.0, 0.0, 0.0],
               [-1.01, -0.97, -1.06, -1.02, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.54, 0.0, 0.0, 0.0]])
W_E = [-0.4, -0.66, -0.12, 0.21, 0.57, 0.05, -0.28, -0.39, 0.37, 0.82,
      0.14, -0.62, -0.48, 0.8, 0.1, -0.87, -0.04, -0.58, -0.31, -0.24]
X_E = np.array([[-0.1, 0.24, -0.22, -0.15, 0.01, 0.25, -0.49, -0.28, -0.32, -0.08,
                -0.29, -0.11, 0.06, -0.2, -0.35, -0.2, -0.18, -0.35, 0.31, -0.27],
               [-0.13, 0.25, -0.08, -0.18, 0.26, 0.21, -0.47, -0.08, -0.23, -0.09,
                -0.4, 0.03, -0.0, -0.18, -0.22, -0.25, -0.45, -0.53, 0.16, -0.37],
               [-0.31, 0.05, 0.02, -0.28, -0.0, 0.31, -0.61, -0.11, -0.29, -0.1,
                -0.39, 0.14, -0.06, -0.22, -0.5, -0.14, -0.36, -0.38, 0.02, -0.38],
               [-0.29, 0.11, -0.0, -0.21, 0.13, 0.44, -0.44, -0.23, -0.12, -0.02,
                -0.48, 0.1, -0.01, -0.15, -0.38, -0.22, -0.32, -0.3, 0.03, -0.29],
               [-0.03, 0.04, 0.01, -0.21, 0.02, 0.15, -0.49, -0.03, -0.35, -0.05,
                -0.31, 0.04, 0.08, -0.05, -0.27, 0.06, -0.27, -0.39, 0.14, -0.42],
               [-1.03, -1.11, -1.03, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.44, 0.0, 0.0, 0.0],
               [-1.05, -0.97, -0.96, -1.03, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.51, 0.0, 0.0, 0.0],
               [-0.91, -0.91, -0.96, -0.98, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.44, 0.0, 0.0, 0.0]])
VECTOR_A = [0.0056836949195549, -0.07981645523161511, 0.30339858123852065, 0.2765616320429717,
            -0.7232976129305514, -0.5667053900928489, -0.06562251333009327, -0.1284184745977745,
            0.06316305080445099, 0.058296111418851236, 0.6648179567433152, -0.34175587424683357,
            -0.1379902034715431, 0.6164606637350023, 0.19361271680163636, 0.1848271526670921,
            -0.1879902034715431, -0.535185046280085, -0.024408077464637547, 0.03860201936615938]
SELECTED_A = [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
VECTOR_B = [-0.07377843184581313, -0.16262985030410587, -0.14753726158857516, -0.13338766583667033,
            -0.2116017791492631, 0.18261625367648107, 0.3887711228563715, -0.33413658011342035,
            -0.3470649471328107, -0.31418049459047404, 0.19916771862632388, 0.011059003981026036,
            0.23238308134506433, 0.11772747882786776, 0.06778477280422013, 0.05283549297515093,
            -0.12941693087852485, 0.22047260886223952, -0.23522679608963318, -0.09755935423003338]
SELECTED_B = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
VECTOR_T = [0.0056836949195549, -0.07981645523161511, 0.30339858123852065, 0.2765616320429717,
            -0.7232976129305514, -0.5667053900928489, -0.06562251333009327, -0.1284184745977745,
            0.06316305080445099, 0.058296111418851236, 0.6648179567433152, -0.34175587424683357,
            -0.1379902034715431, 0.6164606637350023, 0.19361271680163636, 0.1848271526670921,
            -0.1879902034715431, -0.535185046280085, -0.024408077464637547, 0.03860201936615938]
SELECTED_T = [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
SELECTED_E = [0, 0, 0, 0, 0, 0, 0, 0]
TES_A = [2, 3, 3, 3, 3, 4, 4, 1, 1, 1, 1, 1]
DDIFS_A0 = [[0.5255256295204163, 2.1633617877960205, 0.4845171570777893, 0.37159278988838196],
            [0.5357860922813416, 2.214815855026245, 0.4401511549949646, 0.3379652798175812],
            [0.5811293721199036, 2.0983188152313232, 0.49207544326782227, 0.3904936909675598],
            [0.5412290692329407, 2.166193962097168, 0.48783496022224426, 0.33716148138046265],
            [0.5518999099731445, 2.13651442527771, 0.45801690220832825, 0.4115249216556549],
            [0.5588071346282959, 2.06485915184021, 0.579433023929596, 0.3792555034160614],
            [0.5659478902816772, 2.142423629760742, 0.47098347544670105, 0.3561728596687317],
            [3.0568957328796387, 0.2507022023200989, 0.2507019340991974, 0.2507016658782959],
            [3.0646610260009766, 0.24934329092502594, 0.24934300780296326, 0.24934275448322296],
            [3.0158493518829346, 0.26537126302719116, 0.2653709948062897, 0.2653707265853882],
            [3.0221660137176514, 0.26197636127471924, 0.26197606325149536, 0.26197579503059387],
            [3.0605406761169434, 0.25029510259628296, 0.2502948045730591, 0.2502945363521576]]
# fmt: on

SHAPE = (1, 2, 2)


def run(X, w, **params):
    rule = DeepSight(**{"num_samples": 500, **params})
    return rule, rule.aggregate(X, probe=LinearProbe(np.array(w), 1.0, SHAPE))


@pytest.mark.parametrize(
    "X,w,params,selected,vector",
    [
        (X_A, W_A, {}, SELECTED_A, VECTOR_A),
        (X_B, W_B, {}, SELECTED_B, VECTOR_B),
        (X_A, W_A, {"tau": 0.5, "threshold_factor": 0.3, "num_seeds": 2, "num_samples": 300}, SELECTED_T, VECTOR_T),
    ],
    ids=["backdoor-rejected", "backdoor-within-tau", "parameters"],
)
def test_deepsight_matches_flpoison(X, w, params, selected, vector):
    _, res = run(X, w, **params)
    assert res.selected.tolist() == selected
    np.testing.assert_allclose(res.vector, vector, rtol=1e-12, atol=1e-15)


def test_deepsight_statistics_match_flpoison():
    rule, _ = run(X_A, W_A)
    probe = LinearProbe(np.array(W_A), 1.0, SHAPE)
    N, te = neups(probe.output_layer, X_A, 0.01)
    assert te.tolist() == TES_A
    np.testing.assert_allclose(rule.ddifs(probe, X_A)[0], DDIFS_A0, rtol=1e-6)  # the reference's float32 sums
    # the five backdoor rows put their whole energy on class 0
    np.testing.assert_array_equal(N[7:], [[1.0, 0.0, 0.0, 0.0]] * 5)


def test_nobody_accepted_gives_the_zero_vector():
    """Three suspicious clients of eight are one cluster above tau: FLPoison raises, fedring moves nothing."""
    _, res = run(X_E, W_E)
    assert res.selected.tolist() == SELECTED_E
    assert res.vector.tolist() == [0.0] * 20


def test_random_inputs_are_fixed_per_set():
    rule = DeepSight(num_seeds=2, num_samples=3)
    a = rule.random_inputs((1, 2))
    assert [x.shape for x in a] == [(3, 1, 2)] * 2 and a[0].dtype == np.float32
    np.testing.assert_array_equal(a[1], np.random.default_rng(1).random((3, 1, 2), dtype=np.float32))
    assert rule.with_f(3).random_inputs((1, 2)) is a  # drawn once, shared by the rule's copies


def test_parameters_are_validated():
    for key, value in [
        ("num_seeds", 0),
        ("num_samples", 0),
        ("tau", 1.5),
        ("threshold_factor", -0.1),
        ("epsilon", 0.0),
    ]:
        with pytest.raises(ConfigError, match=f"deepsight.{key}"):
            make_aggregator("deepsight", 0, {key: value})
    assert "n >= 5" in make_aggregator("deepsight").check(4)


def test_missing_probe_is_a_clear_error():
    with pytest.raises(ValueError, match="deepsight inspects the model and needs the round's probe"):
        make_aggregator("deepsight").aggregate(X_A)
    with pytest.raises(ValueError, match="needs the round's probe"):  # behind a pre-aggregator too
        make_aggregator("deepsight", 0, {}, ["clipping"]).aggregate(X_A)


def test_probe_reaches_the_rule_behind_pre_aggregators_and_the_nonfinite_policy():
    probe = LinearProbe(np.array(W_A), 1.0, SHAPE)
    pipeline = make_aggregator("deepsight", 0, {"num_samples": 500}, ["clipping"], {"clipping": {"c": 1e9}})
    np.testing.assert_allclose(pipeline.aggregate(X_A, probe=probe).vector, VECTOR_A, rtol=1e-12, atol=1e-15)
    Y = np.vstack([X_A, np.full((1, 20), np.nan)])
    res = make_aggregator("deepsight", 1, {"num_samples": 500}).aggregate(Y, probe=probe)
    assert res.selected.tolist() == [*SELECTED_A, 0] and res.excluded.tolist() == [False] * 12 + [True]
    np.testing.assert_allclose(res.vector, VECTOR_A, rtol=1e-12, atol=1e-15)


def test_stateless_and_not_a_base_of_hplus():
    rule = make_aggregator("deepsight")
    assert rule.init_state(12, 20) == {} and dict(rule.client_state) == {}  # nothing to checkpoint
    with pytest.raises(ConfigError, match=r"hplus\.base"):
        make_aggregator("hplus", 0, {"base": "deepsight"})


def test_output_layer_of_a_model():
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert output_layer(mlp, 2, SHAPE) == OutputLayer(start=15, classes=2, fan_in=3)
    with pytest.raises(ConfigError, match=r"a \(5, k\) weight"):
        output_layer(mlp, 5, SHAPE)
    with pytest.raises(ConfigError, match="token sequences"):
        output_layer(mlp, 2, (80,))


def synthetic_trainer(**settings):
    from fedring.train.task import TrainTask
    from fedring.train.trainer import Trainer

    cfg = Config(
        dataset="synthetic",
        model="mlp",
        clients=6,
        topology="server",
        aggregator="deepsight",
        quiet=True,
        lr=0.05,
        **settings,
    )
    cfg.sections = {"deepsight": {"num_samples": 40}}
    return Trainer(cfg, MPI.COMM_WORLD, parts=TrainTask(cfg, 1).parts)


def test_the_trainers_probe_runs_the_clients_models():
    """The probe's softmax outputs are the torch model's with ``w - lr * row`` loaded, bit for bit, and
    the run's model keeps its weights."""
    from fedring.train.loop import train_round

    tr = synthetic_trainer()
    train_round(tr, 0)  # the weights move once
    w = tr.replica.w.copy()
    rows = np.random.default_rng(0).normal(0, 0.1, (3, tr.d)).astype(np.float32)
    x = np.random.default_rng(1).random((7, 1, 28, 28), dtype=np.float32)
    probe = tr.probe(1)
    clients, server = probe.softmax(rows, x)
    model = copy.deepcopy(tr.replica.model).eval()
    lr = np.float32(tr.lr_at(1))
    with torch.no_grad():
        for i, row in enumerate(rows):
            load_flat(model.parameters(), w - lr * row)
            np.testing.assert_array_equal(clients[i], torch.softmax(model(torch.from_numpy(x)), dim=-1).numpy())
        load_flat(model.parameters(), w)
        np.testing.assert_array_equal(server, torch.softmax(model(torch.from_numpy(x)), dim=-1).numpy())
    for p, q in zip(tr.replica.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)  # the run's model still holds w
    assert probe.output_layer == OutputLayer(start=784 * 100 + 100, classes=10, fan_in=100)


def test_an_aggregator_aware_attack_runs_the_rule_with_the_probe():
    """optimal_alie searches its scale against the defence's rule: the probe goes there as well."""
    from fedring.train.loop import train_round

    tr = synthetic_trainer(byzantine=1, attack="optimal_alie")
    calls = []
    aggregate = DeepSight.aggregate

    def recorded(self, X, *args, **kw):
        calls.append(self.probe is not None or kw.get("probe") is not None)
        return aggregate(self, X, *args, **kw)

    DeepSight.aggregate = recorded
    try:
        train_round(tr, 0)
    finally:
        DeepSight.aggregate = aggregate
    assert len(calls) > 1 and all(calls)


@pytest.mark.mpi
@pytest.mark.slow
def test_deepsight_run_is_the_same_on_one_and_two_ranks(tmp_path):
    args = [
        "run",
        "--dataset",
        "synthetic",
        "--model",
        "mlp",
        "--clients",
        "6",
        "--topology",
        "server",
        "--aggregator",
        "deepsight",
        "--set",
        "deepsight.num_samples=50",
        "--byzantine",
        "1",
        "--attack",
        "scaling",
        "--rounds",
        "3",
        "--eval-every",
        "3",
        "--lr",
        "0.05",
        "--quiet",
    ]
    files = []
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}.h5"
        fedring(ranks, *args, "--out", str(out))
        files.append(out)
    with h5py.File(files[0]) as a, h5py.File(files[1]) as b:
        np.testing.assert_array_equal(a["model/final"][()], b["model/final"][()])
        np.testing.assert_array_equal(a["aggregation/selected"][()], b["aggregation/selected"][()])
        assert a["aggregation/selected"].shape == (3, 6)
