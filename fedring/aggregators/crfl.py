"""CRFL's server step (Xie, Chen, Chen, Li, ICML 2021), as FLPoison's ``aggregators/crfl.py``."""

from __future__ import annotations

import numpy as np

from fedring.comm.network import Network
from fedring.comm.ring import RING_RULES, Aggregation, RingAllReduce
from fedring.rng import Stream, generator
from fedring.validate import real

from ._kernels import background, mean, small, sqnorm
from .base import AggregateResult, Aggregator, checked_mean, register


@register
class CRFL(Aggregator):
    r"""CRFL's server step: the mean of the uploads, clipped to norm at most ρ, plus Gaussian noise.

    .. math:: \bar x \min\Big(1, \frac{\rho}{\|\bar x\| + 10^{-10}}\Big) + \mathcal N(0, \sigma^2 I),
              \qquad \bar x = \frac1n \sum_i x_i

    Xie, Chen, Chen, Li, "CRFL: Certifiably Robust Federated Learning against Backdoor Attacks",
    ICML 2021. The paper clips and perturbs the global model's parameters (parameter smoothing,
    which its certificate needs); FLPoison, and this rule, which sees the uploads only, clip and
    perturb the aggregated update. No client is left out.

    Parameters
    ----------
    threshold : float
        ρ (3.0, FLPoison's ``norm_threshold``).
    noise : float
        σ (0.001, FLPoison's ``noise_std``; 0 turns the noise off), drawn from the round's ``rng``.

    Examples
    --------
    The mean (3, 4) has norm 5 and is scaled to norm 3:

    >>> CRFL(noise=0.0)(np.array([[2., 4.], [4., 4.]]))
    array([1.8, 2.4])
    """

    name = "crfl"
    on_device = True

    def __init__(self, f: int = 0, *, threshold: float = 3.0, noise: float = 0.001):
        super().__init__(f)
        self.threshold = real("crfl.threshold", threshold, lo=0.0, lo_open=True)
        self.noise = real("crfl.noise", noise, lo=0.0)

    def clipped_mean(self, X: np.ndarray) -> np.ndarray:
        """The deterministic part: the mean clipped to norm ρ."""
        return self.step(mean(X), None)

    def step(self, avg, draws: np.ndarray | None):
        """CRFL's step on a mean ``avg`` (a fresh array, changed in place): clipped to norm ρ, plus
        σ times the standard normal ``draws`` (float64, cast to ``avg``'s dtype; None: no noise)."""
        avg *= small(np.asarray(min(1.0, self.threshold / (float(np.sqrt(sqnorm(avg))) + 1e-10))), avg)
        if draws is not None:
            draws *= self.noise
            avg += small(draws, avg)
        return avg

    def _aggregate_checked(self, X, state, reference, rng):
        # The noise does not depend on the rows: it is drawn on a worker while the mean is summed,
        # and rng is rewound when a non-finite row means that this call must not draw.
        start = rng.bit_generator.state
        draws = background(rng.standard_normal, X.shape[1]) if self.noise > 0 else None
        avg, excluded = checked_mean(X)
        if excluded is not None:
            if draws is not None:
                draws.result()
                rng.bit_generator.state = start
            return excluded
        return AggregateResult(self.step(avg, None if draws is None else draws.result()))


@RING_RULES.register
class RingCRFL(RingAllReduce):
    r"""CRFL on the ring: ring-all-reduce's mean, then CRFL's server step on every replica.

    .. math:: \bar x \min\Big(1, \frac{\rho}{\|\bar x\| + 10^{-10}}\Big) + \mathcal N(0, \sigma^2 I)

    The step needs nothing but the mean, so every client takes it on the mean the ring gives
    it: the same clip (the same mean everywhere) and the same noise, drawn from the run's seed
    and the round (the stream and draw of the server rule :class:`CRFL`, so on integer-valued
    rows, whose ring sum is exact, the two rules give the same update). The noise is public to
    every client that knows the seed, as a server's would be to whoever knows its seed; the
    clip, which bounds what one round can move the model, is what defends. Settings: the
    server rule's ``[crfl]`` keys, ``threshold`` (ρ) and ``noise`` (σ).

    Example
    -------
    The mean (3, 4) has norm 5 and is scaled to norm 3 (in float32):

    >>> from mpi4py import MPI
    >>> from fedring.comm import Layout
    >>> rows = np.array([[2.0, 4.0], [4.0, 4.0]], np.float32)
    >>> RingCRFL(2, noise=0.0)(Network(Layout(2, MPI.COMM_SELF)), rows)
    array([1.8000001, 2.4      ], dtype=float32)
    """

    name = "crfl"
    params = ("threshold", "noise")
    on_device = True

    def __init__(self, n_clients: int, *, seed: int = 0, threshold: float = 3.0, noise: float = 0.001):
        super().__init__(n_clients)
        self.seed = seed
        self.crfl = CRFL(threshold=threshold, noise=noise)

    def aggregate(self, net: Network, grads, t: int = 0) -> Aggregation:
        avg = super().aggregate(net, grads, t).update
        rng = generator(self.seed, Stream.AGGREGATOR, step=t)
        return Aggregation(self.crfl.step(avg, rng.standard_normal(avg.shape[0]) if self.crfl.noise > 0 else None))

    def centralized(self, G: np.ndarray) -> np.ndarray:
        """The clipped mean: the noise does not depend on the rows."""
        return self.crfl.clipped_mean(G)
