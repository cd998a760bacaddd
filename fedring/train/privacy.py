r"""Client-level differential privacy for training: DP-FedAvg (McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018, Algorithm 1), central or local
(setting ``dp``; parameters in the section ``[dp]``; ``docs/training.md``).

``dp = "central"`` (the server topology with the ``mean`` rule): the server clips every upload it
receives to L2 norm ``C`` (the ``clipping`` pre-aggregator, put first), averages the cohort's ``m``
rows and adds Gaussian noise to the mean,

.. math:: \Delta_t = \frac{1}{m} \Big( \sum_{i \in S_t} \mathrm{clip}_C(u_i) + \mathcal N(0, z^2 C^2 I) \Big),

so the sum has sensitivity ``C`` to adding or removing one client's data (client-level
adjacency) and noise multiplier ``z``. The noise is drawn from the seed and the round
(:data:`fedring.rng.Stream.DP_NOISE`), the same on every replica. This is also the "weak DP"
defence of the backdoor literature (Sun et al., "Can You Really Backdoor Federated Learning?",
2019: norm clipping and a small noise).

``dp = "local"`` (either topology, any rule): every honest client that takes part clips its own
upload to ``C`` and adds ``N(0, z^2 C^2 I)`` before sending (stream ``DP_LOCAL``, per client and
round); Byzantine clients do not follow the protocol.

Privacy spent (:meth:`Privacy.epsilon`): the Rényi DP of the sampled Gaussian mechanism (Mironov,
Talwar and Zhang, 2019) as Opacus computes it (``opacus.accountants.analysis.rdp``), converted to
``(epsilon, delta)``. Central: noise multiplier ``z``, sampling rate ``q = m / n`` per round, over
the rounds so far (Opacus analyses Poisson sampling; fedring draws a fixed-size cohort without
replacement: the usual approximation, ``docs/training.md``). Local: each release is a Gaussian
mechanism on the client's own update, whose sensitivity to replacing its data is ``2C``, so the
noise multiplier is ``z / 2``, with no amplification by sampling (who sends is visible), composed
over every round: the guarantee of a client that took part in all of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedring import validate
from fedring.arrays import like
from fedring.comm.ring import Aggregation
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

from .optim import Vector, clip

MODES = ("none", "central", "local")
#: Rényi orders beyond Opacus' default (up to 63): strong privacy over few rounds is tightest at higher ones
ORDERS_BEYOND = (80, 128, 256, 512, 1024, 4096)


class Privacy:
    """DP-FedAvg's clipping bound ``clip`` (C), ``noise_multiplier`` (z) and the ``delta`` at which the
    privacy spent is reported, for ``mode`` central or local (module docstring); ``none`` changes
    nothing. Noise is drawn from the run's ``seed``.

    >>> p = Privacy("local", seed=0, clip=1.0, noise_multiplier=0.0)
    >>> rows = np.array([[3.0, 4.0], [0.3, 0.4], [3.0, 4.0]], np.float32)
    >>> p.release(rows, t=0, lo=0, honest=np.array([True, True, False])).tolist()  # z = 0: clipping alone
    [[0.6000000238418579, 0.800000011920929], [0.30000001192092896, 0.4000000059604645], [3.0, 4.0]]
    """

    def __init__(
        self, mode: str, *, seed: int = 0, clip: float = 1.0, noise_multiplier: float = 1.0, delta: float = 1e-5
    ):
        self.mode, self.seed = validate.choice("dp", mode, MODES), seed
        self.clip = validate.real("dp.clip", clip, lo=0, lo_open=True)
        self.noise_multiplier = validate.real("dp.noise_multiplier", noise_multiplier, lo=0)
        self.delta = validate.real("dp.delta", delta, lo=0, hi=1, lo_open=True, hi_open=True)

    def release(self, rows: Vector, t: int, lo: int, honest: np.ndarray) -> Vector:
        """Round ``t``'s uploads ``rows`` of this rank's clients ``lo, lo + 1, ...``: with local DP, the rows of
        the ``honest`` ones (a mask over the rows: the honest members of the cohort) clipped to ``C`` and
        noised, in place. Returns ``rows``. Device rows stay on their device: the noise, drawn on the
        host, is added there (the norm of the clipping is summed in another order, :func:`clip`)."""
        if self.mode != "local":
            return rows
        sigma = np.float32(self.noise_multiplier * self.clip)
        for k in np.flatnonzero(honest):
            clip(rows[k], self.clip)
            if sigma:
                draw = generator(self.seed, Stream.DP_LOCAL, client=lo + int(k), step=t)
                rows[k] += like(sigma * draw.standard_normal(rows.shape[1], dtype=np.float32), rows)
        return rows

    def noised(self, aggregation: Aggregation, t: int, m: int) -> Aggregation:
        """Round ``t``'s ``aggregation``: with central DP, its update (the mean of ``m`` clipped rows) plus
        ``N(0, (z C / m)^2 I)``, as a new array (of the update's kind; the noise is drawn on the host),
        the same on every replica."""
        if self.mode != "central" or not aggregation.updated:
            return aggregation
        sigma = np.float32(self.noise_multiplier * self.clip / m)
        update = aggregation.update
        noise = generator(self.seed, Stream.DP_NOISE, step=t).standard_normal(tuple(update.shape), np.float32)
        return dataclasses.replace(aggregation, update=update + like(sigma * noise, update))

    def epsilon(self, rounds: int, q: float) -> float | None:
        """The ``epsilon`` spent after ``rounds`` rounds at :attr:`delta`, with cohorts drawn at rate ``q``
        (central; local ignores it). Infinite without noise; None without DP."""
        if self.mode == "none":
            return None
        if self.noise_multiplier == 0:
            return float("inf")
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

        z, q = (self.noise_multiplier, q) if self.mode == "central" else (self.noise_multiplier / 2, 1.0)
        orders = [*RDPAccountant.DEFAULT_ALPHAS, *ORDERS_BEYOND]
        rdp = compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=orders)
        return float(get_privacy_spent(orders=orders, rdp=rdp, delta=self.delta)[0])


def from_settings(
    mode: str, section: dict, seed: int, topology: str, aggregator: str, pre_aggregators: list
) -> Privacy:
    """The run's :class:`Privacy`, its settings and their fit with the topology and the rule checked."""
    validate.choice("dp", mode, MODES)
    if mode != "none":
        validate.installed("dp", ["opacus"], f"{mode} needs Opacus for its privacy accounting", "dp")
    keys = () if mode == "none" else ("clip", "noise_multiplier", "delta")
    validate.known_keys("dp", f"dp {mode}", section, keys)
    privacy = Privacy(mode, seed=seed, **section)
    if mode == "central" and (topology != "server" or aggregator != "mean" or pre_aggregators):
        raise ConfigError(
            "dp",
            "central is DP-FedAvg: a server (--topology server) averaging the clipped uploads (--aggregator mean, no "
            "pre_aggregators, whose changes the noise does not cover); use dp = local with other rules or the ring",
        )
    return privacy
