"""ByzFL's line-searched ALIE and IPM (ByzFL 0.0.10 and later: ``Optimal_ALittleIsEnough``,
``Optimal_InnerProductManipulation``; used in Allouah et al., "Fixing by mixing", AISTATS 2023).

Both send one vector of a one-parameter family (ALIE's μ + τσ, IPM's −τμ) with τ chosen to push
the defence's output farthest from the honest mean: the defence (``ctx.aggregator``) runs on the
honest rows followed by the b crafted copies for each τ that ByzFL's line search proposes.
"""

from __future__ import annotations

from collections.abc import Callable

from fedring.arrays import Array, array_namespace, device
from fedring.validate import integer, real

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, by_columns, empty, known, mean, norm, std

#: smallest relative improvement of the objective that moves the line search (rounding is ~1e-16)
GAIN = 1e-12


def byzfl_line_search(
    objective: Callable[[float], float], evals: int = 20, start: float = 0.0, delta: float = 10.0, ratio: float = 0.8
) -> float:
    """The τ that ByzFL 0.0.11's ``Optimal_*`` attacks send, after exactly ``evals`` evaluations.

    Expansion: from ``start``, step by ``delta`` while the objective strictly improves, doubling
    the step each time; the first step that does not improve shrinks it by ``ratio`` and ends
    the phase. Contraction: with the remaining evaluations, try ``best + delta`` (only upwards of
    the best point, for a positive ``delta``), keep it if strictly better, shrink the step by
    ``ratio`` each time. (ByzFL 0.0.1 to 0.0.9's ``LineMaximize``,
    :func:`fedring.attacks.adaptive.line_maximize`, stepped back towards the best point instead.)

    One difference from ByzFL: an improvement must exceed a relative 1e-12 (:data:`GAIN`). On a
    plateau of the objective (a clipping pre-aggregator, or a rule that ignores the attackers,
    gives the same output for every τ beyond some point) ByzFL's strict comparisons are decided
    by the last bit of rounding, and its τ wanders along the plateau; here it stays at the first
    point of the plateau, which does the same to the defence.

    Examples
    --------
    The peak at 7: 10 improves on 0, 30 does not; the contraction then tries 10 + 16,
    10 + 12.8, ... only above 10:

    >>> byzfl_line_search(lambda t: -abs(t - 7.0))
    10.0
    >>> byzfl_line_search(lambda t: t, evals=4)  # always better: 0, 10, 30, 70
    70.0
    """
    best_x, best_y = start, objective(start)
    better = lambda y: y > best_y + GAIN * abs(best_y)  # noqa: E731
    left = evals - 1
    while left > 0:
        x = best_x + delta
        y = objective(x)
        left -= 1
        if better(y):
            best_x, best_y = x, y
            delta *= 2
        else:
            delta *= ratio
            break
    while left > 0:
        x = best_x + delta
        y = objective(x)
        left -= 1
        if better(y):
            best_x, best_y = x, y
        delta *= ratio
    return best_x


class _Optimal(ModelAttack):
    """Shared by the two attacks: the family ``candidate(tau)`` of ``statistics(honest)``."""

    knowledge = "omniscient"
    blockwise = True
    on_device = True
    min_honest = 1

    def __init__(self, evals: int = 20, start: float = 0.0, delta: float = 10.0, ratio: float = 0.8):
        self.evals = integer("attack.evals", evals, lo=1)
        self.start = real("attack.start", start)
        self.delta = real("attack.delta", delta)
        if self.delta == 0:
            raise ConfigError("attack.delta", "must be nonzero, got 0")
        self.ratio = real("attack.ratio", ratio, lo=0.5, hi=1.0, lo_open=True, hi_open=True)

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if n - b < self.min_honest:
            return ConfigError(
                "byzantine",
                f"attack {self.name} needs at least {self.min_honest} honest client(s), "
                f"got n={n} clients of which b={b} Byzantine",
            )
        return None

    def statistics(self, honest: Array) -> tuple[Array, Array]:
        raise NotImplementedError

    @staticmethod
    def candidate(tau: float, mu: Array, other: Array) -> Array:
        raise NotImplementedError

    def search(
        self,
        honest: Array,
        mu: Array,
        other: Array,
        b: int,
        aggregate: Callable[[Array], Array],
    ) -> float:
        """ByzFL's τ: maximise ``‖aggregate(honest rows, then b copies of candidate(τ)) − μ_H‖``."""
        h = honest.shape[0]
        xp = array_namespace(honest)
        rows = empty(honest, (h + b, honest.shape[1]), xp.float64)  # one buffer for every evaluation
        rows[:h] = honest

        def distance(tau: float) -> float:
            rows[h:] = self.candidate(tau, mu, other)
            out = xp.asarray(aggregate(rows), dtype=xp.float64, device=device(rows))
            return norm(out - mu)

        return byzfl_line_search(distance, self.evals, self.start, self.delta, self.ratio)

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        honest = known(honest)
        if ctx.aggregator is None:
            raise ConfigError("attack", f"{self.name} needs the defence's aggregation rule, and none was given")
        mu, other = self.statistics(honest)
        tau = self.search(honest, mu, other, byz.shape[0], ctx.aggregator)
        return by_columns(byz, lambda c: self.candidate(tau, mu[c], other[c]))


@ATTACKS.register
class OptimalALIE(_Optimal):
    r"""ALIE with the factor τ line-searched against the defence (ByzFL ``Optimal_ALittleIsEnough``).

    .. math::
        \tilde g = \mu_{\mathcal H} + \tau^\star \sigma_{\mathcal H}, \qquad
        \tau^\star = \arg\max_\tau \big\|\mathrm{AGR}(g_{\mathcal H}, \tilde g(\tau)^{\times b})
        - \mu_{\mathcal H}\big\|_2

    μ and σ are the honest rows' coordinate-wise mean and standard deviation (ddof = 1, as
    ByzFL and :class:`fedring.attacks.ALIE`); AGR is the defence's rule with its pre-aggregators
    (``ctx.aggregator``) on the honest rows followed by the b attackers' copies, ByzFL's order;
    the search is :func:`byzfl_line_search` with ByzFL's defaults. ByzFL simulates its own
    parameter f copies and a rule it is given (``agg``, ``pre_agg_list``, default the mean after
    clipping); here the copies are the b attackers and the rule is the run's defence. The
    defence runs ``evals`` times per round on float64 rows (as the generic ``adaptive`` attack's,
    so the result does not depend on whether the rows arrive in float32), held in one
    (h + b, d) float64 buffer; the statistics are taken one column block at a time.

    Parameters
    ----------
    evals : int >= 1, default 20
    start : float, default 0
    delta : float, nonzero, default 10
    ratio : float in (0.5, 1), default 0.8

    References
    ----------
    Baruch, Baruch, Goldberg, NeurIPS 2019 (ALIE); Allouah et al., AISTATS 2023; ByzFL 0.0.11,
    ``byzfl/attacks/attacks.py``.

    Examples
    --------
    Against the plain mean the objective grows with τ, so every expansion step succeeds
    (τ = 0, 10, 30, 70); σ = (3, 3, 3):

    >>> import numpy as np
    >>> from fedring.attacks import AttackContext
    >>> ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=lambda X: X.mean(0))
    >>> OptimalALIE(evals=4)(np.zeros((1, 3)), np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]), ctx)
    array([[214., 215., 216.]])
    """

    name = "optimal_alie"
    min_honest = 2  # a standard deviation with ddof = 1

    def statistics(self, honest):
        return mean(honest), std(honest, 1, f"attack {self.name}")

    @staticmethod
    def candidate(tau, mu, other):
        return mu + other * tau


@ATTACKS.register
class OptimalIPM(_Optimal):
    r"""IPM with the factor τ line-searched against the defence (ByzFL
    ``Optimal_InnerProductManipulation``).

    .. math::
        \tilde g = -\tau^\star \mu_{\mathcal H}, \qquad
        \tau^\star = \arg\max_\tau \big\|\mathrm{AGR}(g_{\mathcal H}, \tilde g(\tau)^{\times b})
        - \mu_{\mathcal H}\big\|_2

    The search, the rows the defence sees and the parameters are those of
    :class:`OptimalALIE`. τ = 0 sends zeros; :class:`fedring.attacks.IPM` is the fixed-τ form
    (its ε).

    References
    ----------
    Xie, Koyejo, Gupta, UAI 2019 (IPM); Allouah et al., AISTATS 2023; ByzFL 0.0.11,
    ``byzfl/attacks/attacks.py``.

    Examples
    --------
    Against the mean, every step succeeds (τ = 70 after 4 evaluations), μ = (4, 5, 6):

    >>> import numpy as np
    >>> from fedring.attacks import AttackContext
    >>> ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=lambda X: X.mean(0))
    >>> OptimalIPM(evals=4)(np.zeros((1, 3)), np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]), ctx)
    array([[-280., -350., -420.]])
    """

    name = "optimal_ipm"

    def statistics(self, honest):
        mu = mean(honest)
        return mu, mu

    @staticmethod
    def candidate(tau, mu, other):
        return mu * -tau
