"""Calibration-phase attacks (paper Sec. II-E, V-A): what a Byzantine client reports
instead of its true calibration scores.

An attack is a small class registered in :data:`CALIB_ATTACKS` under its ``name``; its
parameters are its constructor's keyword parameters, set in the settings section named after
it (``--set coverage.factor=5``, or ``[random]`` ``variance = 0.5`` in a TOML file) and
checked in ``__init__``. ``--calib-attack none`` (the default) means no attack. Calling an
attack maps the ``(n, N)`` true scores of ``n`` Byzantine clients to the scores they report;
the Byzantine clients use the reported scores for their characterization vectors and for the
quantile alike. An attack that knows the benign clients' mean score (``knowledge =
"omniscient"``) receives it as ``benign_mean``. Adding an attack is one class here and its
test.
"""

from __future__ import annotations

import math

import numpy as np

from fedring.registry import Registry
from fedring.validate import choice, real

#: the calibration attacks, by name (``--calib-attack NAME``; parameters in the section NAME)
CALIB_ATTACKS = Registry("calibration attack")


@CALIB_ATTACKS.base
class CalibrationAttack:
    """Base of the calibration attacks.

    ``knowledge`` is ``"own"`` (each attacker knows its own scores) or ``"omniscient"`` (it
    also knows the benign clients' mean score, passed as ``benign_mean``).
    """

    name = ""
    knowledge = "own"

    def __call__(
        self, scores: np.ndarray, rng: np.random.Generator | None, benign_mean: float | None = None
    ) -> np.ndarray:
        raise NotImplementedError


@CALIB_ATTACKS.register
class EfficiencyAttack(CalibrationAttack):
    """Report every score as 0 (histogram ``e_1``): deflates the pooled quantile.

    >>> EfficiencyAttack()(np.array([[0.3, 1.2]]), None)
    array([[0., 0.]])
    """

    name = "efficiency"

    def __call__(self, scores, rng, benign_mean=None):
        return np.zeros_like(scores)


@CALIB_ATTACKS.register
class CoverageAttack(CalibrationAttack):
    """Report every score as ``factor`` x a mean score: inflates the quantile.

    The attackers' histograms are one-hot far up (``e_H``, the last bin, for the attacker whose
    reported score sets ``r_max``, or for all of them with ``mean = "benign"``).

    The paper's "10x the benign mean" is read by default as the attacker's own true mean
    score (``mean = "own"``: a Byzantine client's data are generated honestly, so its own
    mean is a benign mean it knows); ``mean = "benign"`` uses the mean over the benign
    clients instead, which only an omniscient adversary knows. Either way FCP's threshold
    becomes a Byzantine value. A ``benign_mean`` passed in is used whatever ``mean`` says.

    >>> CoverageAttack(factor=10.0)(np.array([[0.1, 0.3], [1.0, 3.0]]), None)
    array([[ 2.,  2.],
           [20., 20.]])
    """

    name = "coverage"

    def __init__(self, factor: float = 10.0, mean: str = "own"):
        self.factor = real("coverage.factor", factor, lo=0, lo_open=True)
        self.mean = choice("coverage.mean", mean, ("own", "benign"))
        self.knowledge = "omniscient" if self.mean == "benign" else "own"

    def __call__(self, scores, rng, benign_mean=None):
        if benign_mean is not None:
            return np.full_like(scores, self.factor * benign_mean)
        mean = scores.mean(axis=1, keepdims=True) if scores.shape[1] else np.zeros((scores.shape[0], 1))
        return np.broadcast_to(self.factor * mean, scores.shape).copy()


@CALIB_ATTACKS.register
class RandomAttack(CalibrationAttack):
    """``r~ = max(r + eta, 0)``, ``eta ~ N(0, variance)`` i.i.d. per score.

    The paper's sigma_C^2 is taken as a variance, and scores are kept nonnegative by clipping
    at 0 (not by an absolute value); large scores are not clipped (the histogram's ``r_max``
    clips them there only). Which reading of sigma_C^2 = 0.5 a run uses is set by its profile.

    >>> RandomAttack(variance=0.0)(np.array([[0.5, 0.7]]), np.random.default_rng(0))
    array([[0.5, 0.7]])
    """

    name = "random"

    def __init__(self, variance: float = 0.5):
        self.variance = real("random.variance", variance, lo=0)
        self.std = math.sqrt(self.variance)

    def __call__(self, scores, rng, benign_mean=None):
        return np.maximum(scores + self.std * rng.standard_normal(scores.shape), 0.0)


def make_calib_attack(name: str, params: dict | None = None) -> CalibrationAttack | None:
    """The attack ``name`` built from its settings ``params``; ``"none"`` gives None.

    >>> make_calib_attack("coverage", {"factor": 2.0}).factor
    2.0
    >>> make_calib_attack("coverage", {"factr": 2.0})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fedring.errors.ConfigError: coverage.factr: unknown parameter of ... coverage; did you mean 'factor'? allowed: factor, mean
    """
    if name == "none":
        return None
    return CALIB_ATTACKS.build(name, params, key="prism.calib_attack", prefix=name)
