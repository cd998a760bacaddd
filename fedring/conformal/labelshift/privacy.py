"""Differential privacy of label-shift DP-FedCP: Theorem 4.4 and the noisy label counts.

Theorem 4.4 of Plassier et al. (ICML 2023) gives the Gaussian gradient noise ``sigma_g`` that
makes one run of Algorithm 1 (one query label) (epsilon, delta)-DP: :func:`sigma_g_min`, and its
inverse :func:`epsilon_for_sigma`. The paper's text does not define the neighbouring relation;
the guarantee is quoted as the paper states it, for one query label, and covers neither the
mixture weights ``lambda``, nor the weight sums, nor the subsample. The discrete Gaussian noise
on the label counts (Algorithm 2) is accounted separately by :func:`count_noise_epsilon`.
``docs/labelshift.md`` discusses both.
"""

from __future__ import annotations

import math

from fedring.errors import ConfigError
from fedring.validate import integer, real


def _delta_bar(epsilon: float, delta: float, rounds: int, participants: int, n_agents: int) -> float:
    return n_agents / participants * (1.0 - ((1.0 - delta) / (1.0 + math.sqrt(epsilon))) ** (1.0 / rounds))


def _check_privacy_args(delta, rounds, local_steps, participants, n_agents) -> None:
    real("delta", delta, lo=0, hi=1, lo_open=True, hi_open=True)
    integer("rounds", rounds, lo=1)
    integer("local_steps", local_steps, lo=1)
    integer("participants", participants, lo=1, hi=n_agents)


def sigma_g_min(
    epsilon: float, delta: float, rounds: int, local_steps: int, participants: int, n_agents: int, lam_max: float
) -> float:
    """Smallest gradient-noise ``sigma_g`` for which Algorithm 1 is (epsilon, delta)-DP, Theorem 4.4.

    .. math::
        \\sigma_g \\ge 2 \\sqrt{\\frac{K \\max_i \\lambda^i_y}{\\epsilon}
            \\Big(1 + \\frac{24 S \\sqrt T \\log(1/\\bar\\delta)}{\\epsilon n}\\Big)}, \\qquad
        \\bar\\delta = \\frac nS \\Big[1 - \\Big(\\frac{1-\\delta}{1+\\sqrt\\epsilon}\\Big)^{1/T}\\Big]

    for ``S`` agents sampled per round out of ``n``, valid when
    ``0 < delta < 1 - (1 + sqrt(epsilon)) (1 - S/n)^T``, i.e. ``delta_bar`` in (0, 1). The
    guarantee is the paper's, "towards a third party" for one run of Algorithm 1 (one query
    label). The paper's available text leaves the neighbouring relation undefined, so no
    record-level claim is made beyond it; it covers neither ``lambda``, nor the weight sums,
    nor the subsample (module docstring).

    Examples
    --------
    >>> round(sigma_g_min(1.0, 1e-5, 1000, 10, 11, 11, 0.5), 4)   # T=1000, K=10, 11 of 11 agents
    332.3261
    """
    _check_privacy_args(delta, rounds, local_steps, participants, n_agents)
    real("epsilon", epsilon, lo=0, lo_open=True)
    db = _delta_bar(epsilon, delta, rounds, participants, n_agents)
    if not 0 < db < 1:
        limit = 1 - (1 + math.sqrt(epsilon)) * (1 - participants / n_agents) ** rounds
        raise ConfigError(
            "delta", f"Theorem 4.4 needs 0 < delta < 1 - (1 + sqrt(eps))(1 - S/n)^T = {limit:.6g}, got {delta}"
        )
    sampling = 24 * participants * math.sqrt(rounds) * math.log(1 / db) / (epsilon * n_agents)
    return 2.0 * math.sqrt(local_steps * lam_max / epsilon * (1 + sampling))


def epsilon_for_sigma(
    sigma_g: float, delta: float, rounds: int, local_steps: int, participants: int, n_agents: int, lam_max: float
) -> float:
    """Smallest ``epsilon`` that Theorem 4.4 certifies for noise ``sigma_g`` (``inf`` if none).

    The theorem's bound decreases in ``epsilon``, so this inverts :func:`sigma_g_min` by bisection
    in ``log epsilon``; the paper gives only the forward direction. ``lam_max = 0`` (an
    instance with no weight at all) releases nothing: ``epsilon = 0``.
    """
    _check_privacy_args(delta, rounds, local_steps, participants, n_agents)
    if lam_max <= 0:
        return 0.0
    if sigma_g <= 0:
        return math.inf
    hi = 1e12
    if participants < n_agents:
        # delta_bar < 1 caps epsilon: (1 - delta) / (1 + sqrt(eps)) > (1 - S/n)^T.
        hi = min(hi, ((1 - delta) / (1 - participants / n_agents) ** rounds - 1) ** 2 * (1 - 1e-12))
        if hi <= 0:
            return math.inf

    def ok(eps: float) -> bool:
        db = _delta_bar(eps, delta, rounds, participants, n_agents)
        return 0 < db < 1 and sigma_g_min(eps, delta, rounds, local_steps, participants, n_agents, lam_max) <= sigma_g

    if not ok(hi):
        return math.inf
    lo = 1e-12
    if ok(lo):
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-12:
            break
    return hi


def count_noise_epsilon(sigma_bar: float, delta: float) -> float:
    """(epsilon, delta) of the discrete-Gaussian label counts (Algorithm 2), via zero-concentrated DP.

    The paper's available text does not account for this noise; from Canonne, Kamath & Steinke
    (2020): noise ``N_Z(0, sigma_bar^2)`` on a histogram of l2-sensitivity 1 (one example added
    or removed) is ``rho``-zCDP with ``rho = 1 / (2 sigma_bar^2)``; agents hold disjoint data, so
    the release of all agents' counts is ``rho``-zCDP for one example, and
    ``epsilon = rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 2016, Prop. 1.3).

    >>> round(count_noise_epsilon(10.0, 1e-5), 6)
    0.484853
    """
    real("delta", delta, lo=0, hi=1, lo_open=True, hi_open=True)
    if sigma_bar <= 0:
        return math.inf
    rho = 1.0 / (2.0 * sigma_bar**2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
