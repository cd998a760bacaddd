"""The experiments of Plassier et al. (ICML 2023, Section 5): where the agents' scores come from.

An experiment has ``n_agents`` agents with label priors ``priors`` (n, C) and calibration sizes
``sizes`` (n,), a ``default_target`` (0-based) and two draws per trial:

- ``agent_data(trial, agent)``: the agent's calibration scores and labels, drawn on the rank
  that hosts the agent (stream ``LS_DATA``, keyed by agent and trial);
- ``test_data(trial, target)``: the target's test points, scored for every label, with the
  weights that turn hits into its coverage (drawn by the server, stream ``LS_TEST``).

:class:`GaussianExperiment` is the paper's simulation; :class:`LogitsExperiment` its CIFAR-10
protocol on any classifier's test logits: from an ``.npz`` (:func:`load_logits_npz`) or from a
fedring training run's CNN (:func:`logits_from_run`). ``docs/labelshift.md`` lists the choices
made where the paper is silent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from fedring.errors import ConfigError
from fedring.names import MODEL_FINAL
from fedring.rng import Stream, generator

from .scores import aps_scores, softmax
from .weights import calibration_prior


@dataclass
class AgentData:
    """One agent's calibration data for one trial, sorted by score."""

    scores: np.ndarray
    labels: np.ndarray


@dataclass
class EvalData:
    """Target agent's test points: scores of every label, labels, and estimator weights."""

    scores: np.ndarray  # (m, C)
    labels: np.ndarray  # (m,)
    weights: np.ndarray  # (m,), sum to 1: coverage = sum_j weights_j 1{y_j in C(x_j)}


def sorted_agent(scores: np.ndarray, labels: np.ndarray) -> AgentData:
    """An agent's scores and labels, sorted by score (the order the protocol keeps them in)."""
    order = np.argsort(scores, kind="stable")
    return AgentData(scores[order], labels[order].astype(np.int64))


class GaussianExperiment:
    """The simulated experiment of paper Section 5 ("Simulated Data Experiment", Fig. 1).

    Three labels, ``X | Y = y ~ N(theta_y, I_2)`` with ``theta = [-1, 0], [1, 0], [1, 3]``; two
    agents with ``P_Y^1 = (0.8, 0.1, 0.1)``, ``P_Y^2 = (0.1, 0.1, 0.8)`` and ``(N^1, N^2) =
    (1000, 50)``; inference for agent 2. The classifier is "the Bayes classifier"; the paper
    does not give its prior. It uses the pooled calibration prior ``P_Y^cal`` by default: under
    a uniform prior the scores of the three labels are distributed almost alike, and no
    label-shift effect would show (``bayes_prior`` offers ``uniform`` and ``target``). Each
    trial draws fresh calibration data and ``test_size`` test points from the target's
    distribution.
    """

    name = "gaussians"
    theta = np.array([[-1.0, 0.0], [1.0, 0.0], [1.0, 3.0]])
    priors = np.array([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]])
    sizes = np.array([1000, 50], dtype=np.int64)
    n_agents, n_classes = priors.shape
    default_target = 1  # agent 2, 0-based
    BAYES_PRIORS = ("pooled", "uniform", "target")

    def __init__(self, seed: int, test_size: int = 1000, bayes_prior: str = "pooled"):
        self.seed = seed
        self.test_size = test_size
        prior = {
            "pooled": calibration_prior(self.priors, self.sizes),
            "uniform": np.full(3, 1 / 3),
            "target": self.priors[self.default_target],
        }[bayes_prior]
        self.log_prior = np.log(prior)

    def _probs(self, x: np.ndarray) -> np.ndarray:
        d2 = ((x[:, None, :] - self.theta[None, :, :]) ** 2).sum(axis=2)
        return softmax(self.log_prior - d2 / 2)

    def _draw(self, rng: np.random.Generator, prior: np.ndarray, m: int):
        y = rng.choice(self.n_classes, size=m, p=prior)
        x = self.theta[y] + rng.standard_normal((m, 2))
        return self._probs(x), y, rng.random(m)

    def agent_data(self, trial: int, agent: int) -> AgentData:
        rng = generator(self.seed, Stream.LS_DATA, client=agent, step=trial)
        probs, y, u = self._draw(rng, self.priors[agent], int(self.sizes[agent]))
        return sorted_agent(aps_scores(probs, y, u), y)

    def test_data(self, trial: int, target: int) -> EvalData:
        rng = generator(self.seed, Stream.LS_TEST, step=trial, extra=(target,))
        probs, y, u = self._draw(rng, self.priors[target], self.test_size)
        return EvalData(aps_scores(probs, None, u), y, np.full(self.test_size, 1.0 / self.test_size))


def load_logits_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read ``logits`` (N, C) and ``labels`` (N,) from an ``.npz``; ConfigError if malformed."""
    key = "labelshift.logits"
    if not os.path.isfile(path):
        raise ConfigError(key, f"no such file: {path}")
    try:
        with np.load(path) as f:
            arrays = {name: np.asarray(f[name]) for name in f.files if name in ("logits", "labels")}
            files = sorted(f.files)
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"cannot read {path} as .npz: {e}") from None
    if len(arrays) != 2:
        raise ConfigError(key, f"{path} must contain arrays 'logits' (N, C) and 'labels' (N,); has {files}")
    logits, labels = arrays["logits"], arrays["labels"]
    if logits.ndim != 2 or labels.ndim != 1 or logits.shape[0] != labels.shape[0]:
        raise ConfigError(key, f"need logits (N, C) and labels (N,), got {logits.shape} and {labels.shape}")
    if labels.dtype.kind not in "iu" or labels.size == 0 or labels.min() < 0 or labels.max() >= logits.shape[1]:
        raise ConfigError(key, f"labels must be integers in [0, {logits.shape[1]})")
    if not np.all(np.isfinite(logits)):
        raise ConfigError(key, "logits contain NaN or inf")
    return logits.astype(np.float64), labels.astype(np.int64)


class LogitsExperiment:
    """The CIFAR-10 protocol of paper Section 5 on any classifier's test logits.

    Every trial splits the labelled set into calibration and test halves (stratified by class, so
    each half has every class); ``n = C`` agents, agent ``i`` (1-based) with the dominant class
    ``i - 1``: ``P_Y^i(i - 1) = 0.55`` and ``0.45 / (C - 1)`` elsewhere (``0.05`` for ten
    classes); ``N^i = 350`` except ``N^2 = 2150`` and the target ``N^4 = 50`` (5000 in all for
    ten classes). Agents draw their points i.i.d.: label from ``P_Y^i``, then a uniform
    calibration example of that class, with replacement, since the class counts the priors
    demand exceed what a half holds. The paper does not say how the target's test set is
    built; coverage and set size are averaged over the whole test half, reweighted to the
    target's label prior (``docs/labelshift.md``).
    """

    name = "logits"
    default_target = 3  # agent 4, 0-based

    def __init__(self, logits: np.ndarray, labels: np.ndarray, seed: int, temperature: float = 1.0):
        c = logits.shape[1]
        if c < 4:
            raise ConfigError(
                "labelshift.logits", f"the protocol needs at least 4 classes (agents 2 and 4 are special), got {c}"
            )
        per_class = np.bincount(labels, minlength=c)
        if per_class.min() < 2:
            k = int(per_class.argmin())
            raise ConfigError(
                "labelshift.logits", f"every class needs >= 2 examples (one per half); class {k} has {per_class[k]}"
            )
        self.seed = seed
        self.probs = softmax(logits, temperature)
        self.labels = labels
        self.n_agents = self.n_classes = c
        self.priors = np.full((c, c), 0.45 / (c - 1))
        np.fill_diagonal(self.priors, 0.55)
        self.sizes = np.full(c, 350, dtype=np.int64)
        self.sizes[1], self.sizes[3] = 2150, 50
        self.by_class = [np.flatnonzero(labels == k) for k in range(c)]
        self._split_cache: tuple[int, list[np.ndarray], np.ndarray] | None = None

    def _split(self, trial: int) -> tuple[list[np.ndarray], np.ndarray]:
        if self._split_cache is None or self._split_cache[0] != trial:
            rng = generator(self.seed, Stream.LS_SPLIT, step=trial)
            cal, test = [], []
            for idx in self.by_class:
                perm = rng.permutation(idx)
                half = perm.size // 2
                cal.append(perm[:half])
                test.append(perm[half:])
            self._split_cache = (trial, cal, np.sort(np.concatenate(test)))
        return self._split_cache[1], self._split_cache[2]

    def agent_data(self, trial: int, agent: int) -> AgentData:
        cal, _ = self._split(trial)
        rng = generator(self.seed, Stream.LS_DATA, client=agent, step=trial)
        m = int(self.sizes[agent])
        y = rng.choice(self.n_classes, size=m, p=self.priors[agent])
        idx = np.empty(m, dtype=np.int64)
        for k in range(self.n_classes):
            at = np.flatnonzero(y == k)
            idx[at] = cal[k][rng.integers(0, cal[k].size, size=at.size)]
        return sorted_agent(aps_scores(self.probs[idx], y, rng.random(m)), y)

    def test_data(self, trial: int, target: int) -> EvalData:
        _, test = self._split(trial)
        y = self.labels[test]
        u = generator(self.seed, Stream.LS_TEST, step=trial).random(test.size)  # one test half for all targets
        per_class = np.bincount(y, minlength=self.n_classes)
        weights = self.priors[target][y] / per_class[y]
        return EvalData(aps_scores(self.probs[test], None, u), y, weights)


def logits_from_run(run_h5: str, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Test-set logits of the model saved by a fedring training run (``/model/final``).

    Rebuilds the model with :func:`fedring.train.models.make_model` from the run's ``config``
    attribute (``model``, ``seed``), loads the flat float32 parameters and evaluates the test set
    of the run's data set (:mod:`fedring.datasets`; its files from ``data_dir``, else the run's
    ``data_dir`` or the data set's default location).
    """
    import h5py

    key = "labelshift.model_from"
    if not os.path.isfile(run_h5):
        raise ConfigError(key, f"no such file: {run_h5}")
    try:
        with h5py.File(run_h5, "r") as f:
            if MODEL_FINAL not in f:
                raise ConfigError(key, f"{run_h5} has no /{MODEL_FINAL} (did the training run finish?)")
            flat = np.asarray(f[MODEL_FINAL], dtype=np.float32)
            config = json.loads(f.attrs.get("config", "{}"))
    except OSError as e:
        raise ConfigError(key, f"cannot read {run_h5} as HDF5: {e}") from None
    import torch

    from fedring.datasets import DATASETS
    from fedring.train import models

    model = models.make_model(config.get("model", "cnn"), int(config.get("seed", 0)))
    if flat.size != models.n_parameters(model):
        need = models.n_parameters(model)
        name = config.get("model", "cnn")
        raise ConfigError(key, f"/{MODEL_FINAL} has {flat.size} values, model {name!r} needs {need}")
    models.load_flat(model.parameters(), flat)
    dataset = DATASETS.build(
        config.get("dataset", "fashion-mnist"), {}, key=key, data_dir=data_dir or config.get("data_dir")
    )
    labels = dataset.test_labels()
    images = dataset.test_images(np.arange(len(labels)))
    model.eval()
    with torch.no_grad():
        logits = np.concatenate(
            [model(torch.from_numpy(images[k : k + 1000])).numpy() for k in range(0, len(images), 1000)]
        )
    return logits.astype(np.float64), labels
