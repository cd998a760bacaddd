"""One trial's world: the synthetic generator (paper Sec. V-A) and the UCI Superconductivity
split (Sec. V-B), as seen by one rank (the hosted clients' data and the run-wide facts).

Every draw is keyed by the trial (:mod:`fedring.rng`): ``w*`` and the Byzantine set by the
run (``Stream.PRISM_ENVIRONMENT``), each client's samples by the client
(``Stream.PRISM_DATA``), so a rank builds exactly its clients' data and the result does not
depend on the number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedring.rng import Stream, generator

if TYPE_CHECKING:
    from .settings import ResolvedPrism
    from .uci import Superconductivity


@dataclass
class Environment:
    """One trial's world as seen by one rank: global facts and the hosted clients' data.

    Arrays are time-major for the training stream: ``x_train[n]`` holds iteration ``n``'s
    sample of every hosted client.
    """

    is_byzantine: np.ndarray  # (K,) bool, S_B, uniform and fixed for the trial
    w_star: np.ndarray | None  # (D,) or None (UCI)
    y_scale: float  # width multiplier to report (UCI: target std in Kelvin)
    lo: int
    hi: int
    x_train: np.ndarray  # (N_iter, n_local, D)
    y_train: np.ndarray  # (N_iter, n_local)
    x_cal: np.ndarray  # (n_local, N_k, D)
    y_cal: np.ndarray  # (n_local, N_k)
    x_test: np.ndarray  # (n_local, N_test, D)
    y_test: np.ndarray  # (n_local, N_test)


def byzantine_set(s: ResolvedPrism, rng: np.random.Generator) -> np.ndarray:
    """``|S_B|`` clients drawn uniformly; the same ones in training and calibration (the paper
    says so)."""
    byz = np.zeros(s.clients, dtype=bool)
    byz[rng.choice(s.clients, s.byzantine, replace=False)] = True
    return byz


def synthetic_environment(s: ResolvedPrism, seed: int, trial: int, lo: int, hi: int) -> Environment:
    """Sec. V-A: ``||w*|| = 1``; client k: ``x ~ N(0, varsigma_k^2 I)``, ``varsigma_k^2 ~
    U(input_var)``, ``y = w*^T x + nu``, ``nu ~ N(0, sigma_k^2)``, ``sigma_k^2 ~
    U(noise_var)``; one fresh sample per iteration, then the calibration and test samples.

    >>> from fedring.conformal.prism.settings import settings
    >>> env = synthetic_environment(settings(clients=4, byzantine=1, participants=2, dim=3, shared=1,
    ...                                      iterations=5, calib_samples=2, test_samples=2), 0, 0, 1, 3)
    >>> env.x_train.shape, env.x_cal.shape, int(env.is_byzantine.sum()), round(float(np.linalg.norm(env.w_star)), 12)
    ((5, 2, 3), (2, 2, 3), 1, 1.0)
    """
    env = generator(seed, Stream.PRISM_ENVIRONMENT, step=trial)
    w_star = env.standard_normal(s.dim)
    w_star /= np.linalg.norm(w_star)
    byz = byzantine_set(s, env)
    N, D, nl = s.iterations, s.dim, hi - lo
    sizes = (N, s.calib_samples, s.test_samples)
    xs = [np.empty((nl, n, D)) for n in sizes]
    ys = [np.empty((nl, n)) for n in sizes]
    (sx_lo, sx_hi), (sn_lo, sn_hi) = s.input_var, s.noise_var
    for j, k in enumerate(range(lo, hi)):
        rng = generator(seed, Stream.PRISM_DATA, client=k, step=trial)
        sx = math.sqrt(rng.uniform(sx_lo, sx_hi))
        sn = math.sqrt(rng.uniform(sn_lo, sn_hi))
        for x, y, n in zip(xs, ys, sizes):
            x[j] = sx * rng.standard_normal((n, D))
            y[j] = (x[j] * w_star).sum(axis=1) + sn * rng.standard_normal(n)
    return Environment(
        byz,
        w_star,
        1.0,
        lo,
        hi,
        np.ascontiguousarray(xs[0].transpose(1, 0, 2)),
        np.ascontiguousarray(ys[0].T),
        xs[1],
        ys[1],
        xs[2],
        ys[2],
    )


def uci_environment(s: ResolvedPrism, data: Superconductivity, seed: int, trial: int, lo: int, hi: int) -> Environment:
    """Sec. V-B: the decile/Dirichlet client split (:mod:`.uci`), each client's samples cut
    into ``iterations`` train, ``calib_samples`` calibration and ``test_samples`` test ones;
    widths are reported in Kelvin (the normalized width times the target's standard
    deviation)."""
    from .uci import client_indices, decile_bins

    byz = byzantine_set(s, generator(seed, Stream.PRISM_ENVIRONMENT, step=trial))
    bins = decile_bins(data.y)
    N, nc, nt = s.iterations, s.calib_samples, s.test_samples
    idx = np.stack(
        [
            client_indices(bins, generator(seed, Stream.PRISM_DATA, client=k, step=trial), N + nc + nt, s.dirichlet)
            for k in range(lo, hi)
        ]
    )
    tr, ca, te = idx[:, :N], idx[:, N : N + nc], idx[:, N + nc :]
    return Environment(
        byz, None, data.y_std, lo, hi, data.x[tr.T], data.y[tr.T], data.x[ca], data.y[ca], data.x[te], data.y[te]
    )


def environment(
    s: ResolvedPrism, data: Superconductivity | None, seed: int, trial: int, lo: int, hi: int
) -> Environment:
    """The trial's world for the clients ``lo .. hi-1``: synthetic, or the UCI split of ``data``."""
    if s.dataset == "synthetic":
        return synthetic_environment(s, seed, trial, lo, hi)
    assert data is not None, "uci runs load their data first"
    return uci_environment(s, data, seed, trial, lo, hi)
