"""Aggregator-aware (adaptive) attacks: one tailored to BRACE's sign consensus, one generic.

Both follow Shejwalkar & Houmansadr's AGR-tailored framework (NDSS 2021): the attackers know
the honest gradients and the defence's rule, and choose the malicious vector from the family
μ − γ·dev to make the rule's output deviate as much as possible from what it would have been.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from fedring.arrays import Array, array_namespace, device, host, like
from fedring.validate import choice, integer, real

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, columns, float64_rows, known, mean, norm
from .minmax import perturbation

TARGETS = ("brace", "generic")
DIRECTIONS = ("unit_vec", "sign", "std", "mean")
# parameter -> (target it belongs to, default)
_OWN = {
    "mode": ("brace", "closed_form"),
    "lam": ("brace", 5.0),
    "budget": ("brace", 1.0),
    "perturbation": ("generic", "unit_vec"),
    "evals": ("generic", 16),
    "start": ("generic", 0.0),
    "delta": ("generic", 1.0),
    "ratio": ("generic", 0.8),
}


def brace_closed_form(honest: Array) -> Array:
    r"""The default attack on BRACE: :math:`\mu - 1.001\,\|\mu\|_\infty\,\operatorname{sign}(\mu)`.

    The smallest vector of the inverse-sign family whose sign is −sign(μ) on every coordinate
    with μ_k ≠ 0, so each attacker votes against the benign direction everywhere. The BRACE
    paper only says its attack follows Shejwalkar & Houmansadr and is tailored to BRACE; since
    each attacker moves a vote count by at most one and BRACE is monotone in the count, this
    sign pattern turns the most coordinates away from sign(μ) (docs/brace.md).
    """
    mu = mean(honest)
    xp = array_namespace(mu)
    return mu - 1.001 * xp.max(xp.abs(mu)) * xp.sign(mu)


def brace_margin_flips(byz: Array, honest: Array, lam: float, budget: float) -> np.ndarray:
    r"""Coordinates the attackers flip against BRACE, smallest honest vote margin first.

    With :math:`S_{\mathcal H} = \sum_{i\in\mathcal H}\operatorname{sign}(g_i)`, t = sign(μ) and the
    consensus +1 iff S > λ, the b attackers' votes add anything in [−b, b] to S_𝓗 (their honest
    votes move by at most 2b). A coordinate is *gainable* if the round would give t without the
    attack (attackers voting their own signs) and gives −t when all b vote −t. The honest margin
    :math:`t_k (S_{\mathcal H,k} - \lambda)` orders them; the first ⌈budget·#gainable⌉ are returned
    (host indices; the vote counts are taken on the rows' device).
    """
    b = byz.shape[0]
    xp = array_namespace(honest)
    votes = lambda x: xp.sum(xp.sign(x), axis=0)  # noqa: E731
    s_honest = host(columns(votes, honest))
    t = host(xp.sign(mean(honest)))
    no_attack = np.where(s_honest + host(columns(votes, byz)) > lam, 1.0, -1.0)
    attacked = np.where(s_honest - b * t > lam, 1.0, -1.0)
    gainable = np.flatnonzero((t != 0) & (no_attack == t) & (attacked != t))
    margin = t[gainable] * (s_honest[gainable] - lam)
    order = gainable[np.argsort(margin, kind="stable")]
    return order[: math.ceil(budget * len(order))]


def line_maximize(
    objective: Callable[[float], float], evals: int = 16, start: float = 0.0, delta: float = 1.0, ratio: float = 0.8
) -> float:
    """Best-effort argmax over γ >= 0 by exploration: ByzFL's ``LineMaximize`` (releases 0.0.1 to 0.0.9).

    Expansion: step right with a doubling step while the objective improves; then contraction:
    step towards the last proposal with the step shrunk by ``ratio`` each time, never below 0.
    Uses exactly ``evals`` evaluations.
    """
    best_x, best_y = start, objective(start)
    prop_x, evals = best_x, evals - 1
    while evals > 0:
        prop_x = best_x + delta
        prop_y = objective(prop_x)
        evals -= 1
        if prop_y > best_y:
            best_x, best_y = prop_x, prop_y
            delta *= 2
        else:
            delta *= ratio
            break
    while evals > 0:
        if prop_x < best_x:
            prop_x += delta
        else:
            x = prop_x - delta
            while x < 0 < prop_x:
                x = (x + prop_x) / 2
            prop_x = max(x, 0.0)
        prop_y = objective(prop_x)
        evals -= 1
        if prop_y > best_y:
            best_x, best_y = prop_x, prop_y
        delta *= ratio
    return best_x


def direction(honest: Array, kind: str) -> Array:
    """dev for the family μ − γ·dev: Min-Max's μ/‖μ‖, sign(μ), std (ddof 1), or μ itself.

    With μ itself the family is (1 − γ)μ, ByzFL's ``FallOfEmpires(attack_factor=γ)`` (releases up
    to 0.0.9).
    """
    return mean(honest) if kind == "mean" else perturbation(honest, kind)


@ATTACKS.register
class Adaptive(ModelAttack):
    r"""An attack that knows the defence.

    ``target="brace"`` (the BRACE paper's "Adaptive" column; the design is in docs/brace.md):

    * ``mode="closed_form"`` (default): every attacker sends
      :math:`\mu - 1.001\|\mu\|_\infty\operatorname{sign}(\mu)` (:func:`brace_closed_form`), which
      maximises the number of coordinates where BRACE's output differs from sign(μ); the same
      real-valued vector is what non-sign defences receive.
    * ``mode="margin"``: the attackers keep their own gradients except on the coordinates
      :func:`brace_margin_flips` selects (those whose consensus their votes can turn, smallest
      honest margin first, a fraction ``budget`` of them), where they send −μ_k. With budget 1
      BRACE's output is the closed form's; a smaller budget changes fewer coordinates.
      Needs BRACE's threshold ``lam`` (sign(0) = 0 assumed, BRACE's default).

    ``target="generic"``: every attacker sends :math:`\mu - \gamma^*\,\text{dev}` with

    .. math:: \gamma^* = \arg\max_{\gamma\ge0}\ \big\|\mathrm{AGR}(\tilde g(\gamma)^{\times b},\ g_{\mathcal H})
              - \mathrm{AGR}(g_{\mathcal B},\ g_{\mathcal H})\big\|_2

    i.e. the deviation of the defence's output (``ctx.aggregator``, attackers' rows first) from
    its output had the attackers sent their honest gradients (Shejwalkar & Houmansadr's
    AGR-tailored objective), found by :func:`line_maximize`. That search is ByzFL's
    ``LineMaximize`` of releases 0.0.1 to 0.0.9, where it tuned the factor of ``FallOfEmpires``,
    (1 − τ)μ (``perturbation="mean"`` is that family), or of ``LittleIsEnough``; ByzFL measured
    the distance to the honest mean instead. ByzFL 0.0.10 and later have neither: their ``Optimal_InnerProductManipulation``
    searches the family −τμ against the honest mean, stepping only upwards from the best point
    once the expansion stops.

    Parameters
    ----------
    target : {"brace", "generic"}, default "brace"
    mode : {"closed_form", "margin"}, default "closed_form"  (brace)
    lam : float, default 5  (brace, margin mode: BRACE's λ)
    budget : float in (0, 1], default 1  (brace, margin mode)
    perturbation : {"unit_vec", "sign", "std", "mean"}, default "unit_vec"  (generic)
    evals : int >= 1, default 16; start : float >= 0, default 0; delta : float > 0, default 1;
    ratio : float in (0.5, 1), default 0.8  (generic: the defaults of ByzFL's LineMaximize)

    A parameter of the other target is refused.

    References
    ----------
    Shejwalkar & Houmansadr, NDSS 2021 (AGR-tailored attacks); BRACE paper §5; ByzFL 0.0.1 to
    0.0.9, ``byzfl/attacker/attack_optimizers.py`` (``LineMaximize``).

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks.adaptive import brace_closed_form
    >>> brace_closed_form(np.array([[1., -2., 0.], [3., -2., 0.]]))
    array([-0.002,  0.002,  0.   ])
    """

    name = "adaptive"
    knowledge = "omniscient"
    blockwise = True
    on_device = True
    params = ("target", *_OWN)

    def __init__(self, target: str = "brace", **params):
        self.target = choice("attack.target", target, TARGETS)
        for key in params:
            if _OWN[key][0] != target:
                raise ConfigError(f"attack.{key}", f"applies to attack.target={_OWN[key][0]!r}, not {target!r}")
        get = lambda key: params.get(key, _OWN[key][1])  # noqa: E731
        if target == "brace":
            self.mode = choice("attack.mode", get("mode"), ("closed_form", "margin"))
            self.lam = real("attack.lam", get("lam"))
            self.budget = real("attack.budget", get("budget"), lo=0.0, lo_open=True, hi=1.0)
            if self.mode == "closed_form" and ("lam" in params or "budget" in params):
                raise ConfigError("attack.mode", "lam and budget apply to mode 'margin' only")
        else:
            self.perturbation = choice("attack.perturbation", get("perturbation"), DIRECTIONS)
            self.evals = integer("attack.evals", get("evals"), lo=1)
            self.start = real("attack.start", get("start"), lo=0.0)
            self.delta = real("attack.delta", get("delta"), lo=0.0, lo_open=True)
            self.ratio = real("attack.ratio", get("ratio"), lo=0.5, lo_open=True, hi=1.0)
            if self.ratio == 1.0:
                raise ConfigError("attack.ratio", "must be < 1")

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        honest = known(honest)
        xp = array_namespace(honest)
        if self.target == "brace":
            if self.mode == "closed_form":
                return xp.broadcast_to(brace_closed_form(honest), byz.shape)
            out = xp.asarray(byz, copy=True)
            flip = like(brace_margin_flips(byz, honest, self.lam, self.budget), byz)
            out[:, flip] = xp.astype(-mean(honest)[flip], byz.dtype)
            return out
        aggregate = ctx.aggregator
        if aggregate is None:
            raise ConfigError("attack.target", "'generic' needs the defence's aggregation rule, and none was given")
        mu, dev = mean(honest), direction(honest, self.perturbation)
        b = byz.shape[0]
        where = device(honest)
        # the defence's rule runs on every row in float64, as it would on float64 copies
        reference = xp.asarray(aggregate(float64_rows(byz, honest)), dtype=xp.float64, device=where)

        def deviation(gamma: float) -> float:
            rows = float64_rows(xp.broadcast_to(mu - gamma * dev, (b, mu.shape[0])), honest)
            return norm(xp.asarray(aggregate(rows), dtype=xp.float64, device=where) - reference)

        gamma = line_maximize(deviation, self.evals, self.start, self.delta, self.ratio)
        return xp.broadcast_to(mu - gamma * dev, byz.shape)
