"""Min-Max and Min-Sum (Shejwalkar & Houmansadr, NDSS 2021), AGR-agnostic forms."""

from __future__ import annotations

import numpy as np

from fedring.arrays import Array, array_namespace
from fedring.validate import choice, real

from .base import ATTACKS, AttackContext, ModelAttack, known, mean, norm, row_products, squared_distances, std

PERTURBATIONS = ("unit_vec", "std", "sign")


def perturbation(honest: Array, kind: str) -> Array:
    r"""The direction dev with :math:`\nabla^p = -\text{dev}`: μ/‖μ‖₂, sign(μ) or std (ddof = 1).

    A zero mean gives a zero unit vector (the attack then sends μ). In float64, whatever the
    dtype of ``honest``.
    """
    mu = mean(honest)
    xp = array_namespace(mu)
    if kind == "unit_vec":
        length = norm(mu)
        return mu / length if length > 0 else xp.zeros_like(mu)
    if kind == "sign":
        return xp.sign(mu)
    return std(honest, 1, "perturbation std")


def min_max_sum_gamma(
    honest: Array,
    kind: str,
    dev: Array,
    gamma_init: float = 10.0,
    tol: float = 1e-5,
    bound: str = "max",
) -> float:
    r"""The largest γ found by the authors' search such that μ − γ·dev meets the constraint.

    Min-Max (eq. 4 of the paper):
    :math:`\max_{i}\|\tilde g - g_i\|^2 \le \max_{i,j}\|g_i - g_j\|^2`;
    Min-Sum (eq. 5): :math:`\sum_i\|\tilde g - g_i\|^2 \le \max_i \sum_j \|g_i - g_j\|^2`
    (``bound="min"`` takes the minimum over i, as the authors' notebook does).
    Search (``our_attack_dist`` / ``our_attack_score`` of the authors' code,
    ``vrt1shjwlkr/NDSS21-Model-Poisoning``)::

        γ ← γ_init; step ← γ_init; γ_succ ← 0
        while |γ_succ − γ| > tol:
            if constraint(μ − γ·dev): γ_succ ← γ; γ ← γ + step/2
            else:                     γ ← γ − step/2
            step ← step/2

    so γ ∈ (0, 2 γ_init). Returns γ_succ (0 when no γ tried satisfied the constraint).
    With c_i = g_i − μ, ‖μ − γ·dev − g_i‖² = ‖c_i‖² + 2γ⟨c_i, dev⟩ + γ²‖dev‖², so each trial
    costs O(h) after one O(h d) pass, which sums the Gram matrix of the centred rows and their
    products with dev one column block at a time (:func:`~fedring.attacks.base.row_products`).
    """
    mu = mean(honest)

    def products(c: slice, x: Array) -> tuple[Array, Array]:
        x -= mu[c]
        return x @ x.T, x @ dev[c]

    gram, lin = row_products(honest, products)
    sq, pair, quad = np.diag(gram), squared_distances(gram), float(dev @ dev)
    if kind == "minmax":
        limit = pair.max()
        ok = lambda gamma: (sq + 2 * gamma * lin + gamma**2 * quad).max() <= limit  # noqa: E731
    else:
        limit = pair.sum(axis=1).max() if bound == "max" else pair.sum(axis=1).min()
        ok = lambda gamma: (sq + 2 * gamma * lin + gamma**2 * quad).sum() <= limit  # noqa: E731
    gamma, step, succ = gamma_init, gamma_init, 0.0
    while abs(succ - gamma) > tol:
        if ok(gamma):
            succ = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return succ


@ATTACKS.register
class MinMax(ModelAttack):
    r"""Min-Max: the honest mean pushed along −dev as far as its largest distance to any honest
    gradient stays within the largest honest pairwise distance.

    .. math:: \tilde g = \mu - \gamma^*\,\text{dev}, \qquad
        \gamma^* = \arg\max_\gamma\ \max_{i\in\mathcal H}\|\mu - \gamma\,\text{dev} - g_i\|
        \le \max_{i,j\in\mathcal H}\|g_i - g_j\|

    γ* by the authors' search (:func:`min_max_sum_gamma`); every attacker sends the same vector.
    Omniscient (the paper's AGR-agnostic setting with the benign gradients known).

    Parameters
    ----------
    perturbation : {"std", "unit_vec", "sign"}, default "std"
        dev = std (ddof 1; the authors' released runs), μ/‖μ‖ or sign(μ). The paper advises
        running all three and keeping the most damaging.
    gamma_init : float > 0, default 10
    tol : float > 0, default 1e-5

    References
    ----------
    V. Shejwalkar, A. Houmansadr, "Manipulating the Byzantine: Optimizing Model Poisoning Attacks
    and Defenses for Federated Learning", NDSS 2021, Section IV.

    Examples
    --------
    Honest (0, 0) and (2, 0): μ = (1, 0), dev = (1, 0); the distance to (2, 0) is 1 + γ, and the
    largest honest distance is 2, so γ* = 1 (to the search's tolerance):

    >>> import numpy as np
    >>> gamma, dev = MinMax(perturbation="unit_vec").gamma(np.array([[0., 0.], [2., 0.]]))
    >>> round(gamma, 4), dev
    (1.0, array([1., 0.]))
    """

    name = "minmax"
    knowledge = "omniscient"
    blockwise = True
    on_device = True
    constraint = "minmax"

    def __init__(self, perturbation: str = "std", gamma_init: float = 10.0, tol: float = 1e-5):
        self.perturbation = choice("attack.perturbation", perturbation, PERTURBATIONS)
        self.gamma_init = real("attack.gamma_init", gamma_init, lo=0.0, lo_open=True)
        self.tol = real("attack.tol", tol, lo=0.0, lo_open=True)
        self.bound = "max"

    def gamma(self, honest: Array) -> tuple[float, Array]:
        """γ* and dev for these honest gradients."""
        dev = perturbation(honest, self.perturbation)
        gamma = min_max_sum_gamma(honest, self.constraint, dev, self.gamma_init, self.tol, self.bound)
        return gamma, dev

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        honest = known(honest)
        mu = mean(honest)
        gamma, dev = self.gamma(honest)
        return array_namespace(mu).broadcast_to(mu - gamma * dev, byz.shape)


@ATTACKS.register
class MinSum(MinMax):
    r"""Min-Sum: like :class:`MinMax` with the sum of squared distances to the honest gradients.

    .. math:: \sum_{i\in\mathcal H}\|\tilde g - g_i\|^2 \le \max_{i\in\mathcal H}\sum_{j\in\mathcal H}\|g_i - g_j\|^2

    Parameters
    ----------
    perturbation, gamma_init, tol : as :class:`MinMax`
    bound : {"max", "min"}, default "max"
        The right-hand side's outer max over i (the paper's wording, FLPoison) or min (the
        authors' notebook, ``min_score``).

    References
    ----------
    Shejwalkar & Houmansadr, NDSS 2021, eq. (5).
    """

    name = "minsum"
    constraint = "minsum"

    def __init__(self, perturbation: str = "std", gamma_init: float = 10.0, tol: float = 1e-5, bound: str = "max"):
        super().__init__(perturbation, gamma_init, tol)
        self.bound = choice("attack.bound", bound, ("max", "min"))
