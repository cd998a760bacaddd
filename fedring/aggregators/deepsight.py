"""DeepSight (Rieger, Nguyen, Miettinen, Sadeghi, NDSS 2022), as FLPoison's ``aggregators/deepsight.py``."""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ._clustering import cosine_distances, require_sklearn, sklearn_cluster
from ._kernels import combine, row_stats
from .base import AggregateResult, Aggregator, register
from .probe import OutputLayer, Probe

#: HDBSCAN's smallest cluster, scikit-learn's and the ``hdbscan`` package's default
MIN_CLUSTER_SIZE = 5
#: the ``hdbscan`` package's ``min_samples = 3`` (FLPoison's) skips the point itself when it finds a
#: point's core distance; scikit-learn's ``min_samples`` counts it, so 3 there is 4 here
MIN_SAMPLES = 4
#: softmax outputs held at once while the DDifs are summed (float64 values: 32 MiB)
OUTPUT_BUDGET = 1 << 22


def hdbscan_labels(points: np.ndarray, precomputed: bool = False, single: bool = False) -> np.ndarray:
    """scikit-learn's HDBSCAN labels (-1: noise) of the points, or of the distances when ``precomputed``."""
    cluster = sklearn_cluster().HDBSCAN(
        min_cluster_size=MIN_CLUSTER_SIZE,
        min_samples=MIN_SAMPLES,
        metric="precomputed" if precomputed else "euclidean",
        allow_single_cluster=single,
        copy=True,
    )
    return cluster.fit(points).labels_


def cluster_distances(labels: np.ndarray) -> np.ndarray:
    """(n, n) 0 where two clients share a label, else 1; the noise label -1 counts as one cluster, as
    FLPoison's ``dists_from_clust``."""
    return (labels[:, None] != labels[None, :]).astype(np.float64)


def neups(layer: OutputLayer, X: np.ndarray, threshold_factor: float) -> tuple[np.ndarray, np.ndarray]:
    r"""The normalized update energies and threshold exceedings of the rows' output layers.

    .. math::
        e_{i,c} = |\Delta b_{i,c}| + \sum_j |\Delta W_{i,cj}|, \quad
        \mathrm{NEUP}_{i,c} = \frac{e_{i,c}^2}{\sum_{c'} e_{i,c'}^2}, \quad
        \mathrm{TE}_i = \#\{c : \mathrm{NEUP}_{i,c} > \max(\theta, 1/C)\,\max_{c'} \mathrm{NEUP}_{i,c'}\}

    A client whose output layer did not change (every :math:`e_{i,c} = 0`) gets NEUPs 0 and TE 0.

    >>> layer = OutputLayer(0, classes=2, fan_in=1)
    >>> N, te = neups(layer, np.array([[1.0, -1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]), 0.01)
    >>> N.tolist(), te.tolist()
    ([[0.8, 0.2], [0.5, 0.5]], [1.0, 2.0])
    """
    energy = np.abs(layer.bias(X)).astype(np.float64) + np.abs(layer.weight(X).astype(np.float64)).sum(axis=2)
    squared = energy**2
    total = squared.sum(axis=1, keepdims=True)
    N = np.divide(squared, total, out=np.zeros_like(squared), where=total > 0)
    exceeds = N > max(threshold_factor, 1.0 / layer.classes) * N.max(axis=1, keepdims=True)
    return N, exceeds.sum(axis=1).astype(np.float64)


@register
class DeepSight(Aggregator):
    r"""DeepSight: cluster the clients on three views of their models, keep the clusters with few
    suspicious (homogeneous) updates, clip to the median norm, average.

    Runs on the host: it inspects the model through the round's probe (the training loop gives
    it) and scikit-learn's HDBSCAN clusters the clients.

    1. Threshold exceedings: from client i's output-layer update the normalized update energies
       :math:`\mathrm{NEUP}_{i,c}` and their count above :math:`\max(\theta, 1/C)` times the
       largest, :math:`\mathrm{TE}_i` (:func:`neups`). A backdoor concentrates the update on few
       classes: client i is suspicious when :math:`\mathrm{TE}_i \le \mathrm{median}(\mathrm{TE})/2`.
    2. Division differences: for each of ``num_seeds`` fixed sets of ``num_samples`` inputs
       drawn uniformly from [0, 1) in the data set's shape,
       :math:`\mathrm{DDif}_{i,c} = \frac1m \sum_s p_i(s)_c / (p_G(s)_c + \epsilon)`, with
       :math:`p_i` the softmax output of client i's model :math:`w - \eta x_i` and :math:`p_G`
       the global model's.
    3. Ensemble clustering: HDBSCAN (smallest cluster 5) on the cosine distances of the bias
       updates, on the NEUPs, and on each seed's DDifs; each clustering gives the distances
       0 (same label) or 1; the DDifs' are averaged over the seeds, then the three views are
       averaged, and HDBSCAN on those distances, a single cluster allowed, gives the clusters.
    4. A cluster is accepted when fewer than :math:`\tau` times its size of its clients are
       suspicious; noise (label -1) is never accepted.
    5. :math:`S = \mathrm{median}_i \|x_i\|` over every client; each accepted row is scaled by
       :math:`\min(1, S / (\|x_i\| + 10^{-6}))` and the accepted rows are averaged (the zero
       vector when none is accepted).

    Rieger, Nguyen, Miettinen, Sadeghi, "DeepSight: Mitigating Backdoor Attacks in Federated
    Learning Through Deep Model Inspection", NDSS 2022 (Algorithm 1; DDifs eq. 2, NEUPs eq. 3-4,
    threshold exceedings eq. 5). As FLPoison's port (commit 368c940), with the paper's softmax
    probabilities in the DDifs where FLPoison divides its models' raw outputs (logits), and the
    inputs drawn from numpy's generator seeded 0, 1, ... (FLPoison seeds torch's global
    generator); docs/aggregators.md lists every difference.

    Parameters
    ----------
    num_seeds : int
        The number of random input sets, one DDif clustering each (3).
    num_samples : int
        Inputs per set (2000; FLPoison's 20000 makes every client's model run 60,000 inputs a
        round, minutes on a CPU for the CNNs). The DDifs are means over the inputs.
    threshold_factor : float
        :math:`\theta`, the NEUP threshold relative to the largest (0.01; at least 1/C is used).
    tau : float
        The fraction of suspicious clients that rejects a cluster (0.33).
    epsilon : float
        Added to the global model's probabilities in the DDifs (1e-6).

    selected: 1 for the accepted clients.

    Examples
    --------
    Eleven clients of a softmax regression on 2 inputs and 3 classes (d = 9: the weights
    row-major, then the biases), the global model 0 and lr 1. Six update every class alike;
    five (rows 6 to 10) push class 0 alone, as a backdoor does: one threshold exceeding each
    where the six have 3, so they are suspicious (TE <= 3/2). Every view puts the five apart,
    their cluster is rejected, and the update is the mean of the six rows (none is longer than
    the median norm, so the clipping moves them by at most 1e-6 relative):

    >>> from fedring.aggregators.probe import LinearProbe
    >>> rng = np.random.default_rng(0)
    >>> X = np.tile([0.1, 0.2, 0.2, 0.1, 0.15, 0.15, 0.1, 0.1, 0.1], (11, 1)) + rng.normal(0, 0.01, (11, 9))
    >>> X[6:] = np.array([-2.0, -2.0, 0, 0, 0, 0, -1.0, 0, 0]) + rng.normal(0, 0.01, (5, 9)) * [1, 1, 0, 0, 0, 0, 1, 0, 0]
    >>> probe = LinearProbe(np.zeros(9), lr=1.0, input_shape=(2,))
    >>> result = DeepSight(num_samples=200).aggregate(X, probe=probe)
    >>> result.selected.tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    >>> np.allclose(result.vector, X[:6].mean(axis=0))
    True
    >>> result.vector.round(4)
    array([0.0956, 0.2019, 0.2059, 0.1024, 0.1474, 0.152 , 0.1036, 0.1025,
           0.0992])
    """

    name = "deepsight"
    selects = True
    needs_probe = True

    def __init__(
        self,
        f: int = 0,
        *,
        num_seeds: int = 3,
        num_samples: int = 2000,
        threshold_factor: float = 0.01,
        tau: float = 0.33,
        epsilon: float = 1e-6,
    ):
        super().__init__(f)
        self.num_seeds = integer("deepsight.num_seeds", num_seeds, lo=1)
        self.num_samples = integer("deepsight.num_samples", num_samples, lo=1)
        self.threshold_factor = real("deepsight.threshold_factor", threshold_factor, lo=0.0, hi=1.0)
        self.tau = real("deepsight.tau", tau, lo=0.0, hi=1.0)
        self.epsilon = real("deepsight.epsilon", epsilon, lo=0.0, lo_open=True)
        require_sklearn(self.name)
        # the random input sets by sample shape, drawn once (shared by the copies with_f and with_probe make)
        self.inputs: dict[tuple[int, ...], list[np.ndarray]] = {}

    def check(self, n):
        if n < MIN_CLUSTER_SIZE:
            return f"deepsight clusters the clients (HDBSCAN, clusters of at least 5) and needs n >= 5, got n={n}"
        return super().check(n)

    def random_inputs(self, shape: tuple[int, ...]) -> list[np.ndarray]:
        """The ``num_seeds`` sets of ``num_samples`` float32 inputs of ``shape``, uniform on [0, 1),
        set s from ``default_rng(s)``: the same in every run and round."""
        if shape not in self.inputs:
            self.inputs[shape] = [
                np.random.default_rng(s).random((self.num_samples, *shape), dtype=np.float32)
                for s in range(self.num_seeds)
            ]
        return self.inputs[shape]

    def ddifs(self, probe: Probe, X: np.ndarray) -> np.ndarray:
        """The ``(num_seeds, n, classes)`` division differences (step 2), the inputs taken in chunks of
        at most :data:`OUTPUT_BUDGET` outputs. A client model whose outputs are not finite (an
        upload so large that its logits overflow) gets DDifs -1, apart from every finite one (>= 0)."""
        n, classes = X.shape[0], probe.output_layer.classes
        chunk = max(1, OUTPUT_BUDGET // (n * classes))
        D = np.zeros((self.num_seeds, n, classes))
        for s, x in enumerate(self.random_inputs(tuple(probe.input_shape))):
            for lo in range(0, len(x), chunk):
                clients, server = probe.softmax(X, x[lo : lo + chunk])
                server = np.asarray(server, np.float64) + self.epsilon
                D[s] += (np.asarray(clients, np.float64) / server).sum(axis=1)
        D /= self.num_samples
        return np.where(np.isfinite(D), D, -1.0)

    def _aggregate(self, X, state, reference, rng):
        probe = self.probe
        assert probe is not None, "aggregate checks that a rule that needs a probe has one"
        layer = probe.output_layer
        N, te = neups(layer, X, self.threshold_factor)
        bias = layer.bias(X).astype(np.float64)
        views = [
            np.mean([cluster_distances(hdbscan_labels(D)) for D in self.ddifs(probe, X)], axis=0),
            cluster_distances(hdbscan_labels(N)),
            cluster_distances(hdbscan_labels(cosine_distances(bias @ bias.T), precomputed=True)),
        ]
        labels = hdbscan_labels(np.mean(views, axis=0), precomputed=True, single=True)
        suspicious = te <= np.median(te) / 2
        accepted = np.zeros(len(X), bool)
        for c in set(labels.tolist()) - {-1}:
            members = labels == c
            if suspicious[members].sum() < self.tau * members.sum():
                accepted |= members
        if not accepted.any():
            return AggregateResult(np.zeros(X.shape[1], X.dtype), accepted.astype(float))
        norms = np.sqrt(row_stats(X)[0])
        factor = np.where(accepted, np.minimum(1.0, np.median(norms) / (norms + 1e-6)), 0.0)
        return AggregateResult(combine(factor, X) / int(accepted.sum()), accepted.astype(float))
