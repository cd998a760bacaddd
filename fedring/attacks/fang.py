"""Fang et al.'s Krum and Trim attacks (USENIX Security 2020), in gradient form.

Fang et al. craft local *models* w'. With FedSGD (w <- w - lr * aggregate) a model w' is the
gradient (w - w') / lr, so the paper's parameter-space quantities translate as: the change
direction s_Fang = -sign(sum of gradients), a model distance D(w_i, w_l) = lr * ||g_i - g_l||,
and Krum's choice is unchanged (distances scale by lr^2). Public Fang-lineage code crafts its
gradients the same way (``-(direction * lambda) / lr``); the λ search follows the
FLDetector/FLPoison code (halving, stop below 1e-5).
"""

from __future__ import annotations

import math

import numpy as np

from fedring.arrays import Array, array_namespace, like, on_host
from fedring.validate import choice, real

from ..errors import ConfigError
from .base import (
    ATTACKS,
    AttackContext,
    ModelAttack,
    column_blocks,
    column_sum,
    empty,
    float64_rows,
    known,
    mean,
    row_products,
    squared_distances,
    std,
)


def _krum_pick(dist: np.ndarray, f: int) -> int:
    """Krum on a squared-distance matrix: n - f - 2 nearest others (at least 1), ties to lowest index."""
    n = dist.shape[0]
    m = min(max(n - f - 2, 1), n - 1)
    scores = np.sort(dist, axis=1)[:, 1 : m + 1].sum(axis=1)
    return int(np.argmin(scores))


def fang_krum_lambda(
    benign: Array,
    s: Array,
    b: int,
    f: int,
    lr: float,
    tol: float = 1e-5,
    start: float | None = None,
    copies_last: bool = False,
) -> tuple[float, bool]:
    r"""Fang et al.'s λ for the Krum attack, and whether Krum then picks an attacker.

    The b attackers all send :math:`\tilde g = -(\lambda/\eta)\,s`. λ starts at Fang's bound
    (Section 4.2, in parameter units; Γ_i = the n - f - 2 benign vectors nearest to g_i)

    .. math:: \lambda_{\max} = \frac{\eta}{(n - 2f - 1)\sqrt d}\,\min_{i}\sum_{l\in\Gamma_i}\|g_l - g_i\|
              + \frac{\eta}{\sqrt d}\,\max_i \|g_i\|

    (or at ``start`` if given; Fang's c is Krum's f) and is halved until Krum (squared
    distances, n - f - 2 neighbours, at least 1) over the b crafted copies followed by the benign
    rows (``copies_last``: the benign rows followed by the copies) selects a crafted one, or until
    halving would take it below ``tol`` (then the last λ tried is kept and the second value is
    False). Krum breaks ties towards the lower index, so the order decides exact ties: with one
    neighbour a copy's score equals that of its nearest benign row, and only the copies-first
    order lets the copy win. The distances from the copies to the benign rows are quadratics in
    λ with precomputed coefficients, so each trial costs O(n^2), not O(n^2 d); the one O(n d)
    pass sums the row norms, the products with s and the Gram matrix of the centred rows (smaller
    norms, less cancellation) one column block at a time
    (:func:`~fedring.attacks.base.row_products`).

    Parameters
    ----------
    benign : (h, d) gradients the attacker treats as benign.
    s : (d,) sign of the benign gradient sum (the honest update moves w along -s).
    b : number of crafted copies.  f : Krum's parameter.  lr : learning rate η.
    tol : stop threshold on λ.  start : initial λ instead of Fang's bound.
    copies_last : put the copies after the benign rows in the simulated Krum.

    Examples
    --------
    Honest 1, 2, 3, 4 with n = 5, f = 1: the nearest-2 sums are 3, 2, 2, 3, so
    λ_max = 2 / (5 − 2 − 1) + 4 = 5; Krum never prefers a point left of 1, so λ halves 18 times:

    >>> import numpy as np
    >>> fang_krum_lambda(np.array([[1.], [2.], [3.], [4.]]), np.array([1.]), b=1, f=1, lr=1.0)
    (1.9073486328125e-05, False)

    Rows (1, 0.2), (-0.9, -1.2), s = (1, -1), one copy (-λ, λ) and f = 1 (one neighbour): at
    λ = 1 the copy is 4.64 from its nearest row and so is that row from the copy. Copies first,
    the tie goes to the copy; copies last, to the row, and λ halves from 1 to 2^-16:

    >>> rows = np.array([[1.0, 0.2], [-0.9, -1.2]])
    >>> fang_krum_lambda(rows, np.array([1., -1.]), b=1, f=1, lr=1.0, start=1.0)
    (1.0, True)
    >>> fang_krum_lambda(rows, np.array([1., -1.]), b=1, f=1, lr=1.0, start=1.0, copies_last=True)
    (1.52587890625e-05, False)
    """
    h, d = benign.shape
    n = b + h
    centre = mean(benign)

    def products(c: slice, x: Array) -> tuple[Array, Array, Array]:
        norms = np.einsum("ij,ij->i", x, x) if on_host(x) else array_namespace(x).sum(x * x, axis=1)
        sg = x @ s[c]
        x -= centre[c]
        return norms, sg, x @ x.T

    sq_norms, sg, gram = row_products(benign, products)
    norms = np.sqrt(sq_norms)
    dist_bb = squared_distances(gram)
    k = min(max(n - f - 2, 0), h - 1)
    nearest = np.sort(np.sqrt(dist_bb), axis=1)[:, 1 : k + 1].sum(axis=1)
    if start is None:
        lam = float(lr * (nearest.min() / ((n - 2 * f - 1) * math.sqrt(d)) + norms.max() / math.sqrt(d)))
    else:
        lam = float(start)

    ss = float(s @ s)
    copies, rows = (slice(h, n), slice(0, h)) if copies_last else (slice(0, b), slice(b, n))
    dist = np.zeros((n, n))
    dist[rows, rows] = dist_bb
    while True:
        step = lam / lr
        cross = np.maximum(norms**2 + step**2 * ss + 2.0 * step * sg, 0.0)  # ||-step*s - g_i||^2
        dist[copies, rows] = cross
        dist[rows, copies] = cross[:, None]
        if copies.start <= _krum_pick(dist, f) < copies.stop:
            return lam, True
        if lam / 2 < tol:
            return lam, False
        lam /= 2


@ATTACKS.register
class FangKrum(ModelAttack):
    r"""Fang et al.'s attack on Krum: all attackers send a scaled inverse sign vector Krum selects.

    .. math:: \tilde g_j = -\frac{\lambda}{\eta}\,s, \qquad s = \operatorname{sign}\Big(\sum_i g_i\Big)

    with λ from :func:`fang_krum_lambda`. ``variant="full"`` (full knowledge, omniscient): s sums
    every pre-attack gradient (honest and the attackers' own), the benign set is the honest
    gradients, and Krum's f is the declared ``ctx.f`` (needs n > 2f + 1 for Fang's bound).

    ``variant="partial"`` (knowledge ``collusion``, Fang's partial knowledge): s comes from the
    attackers' own pre-attack gradients, which also stand in for the benign ones. Taken
    literally (Krum with f = b over b crafted copies and b before-attack rows) the copies are
    always selected and Fang's bound has a negative denominator, so this follows the public
    code (FLDetector ``dir_partial_krum_lambda``, FLPoison ``FangAttack``): for k = 1, 2, ...,
    b − 1 supporters, λ starts at 1 (gradient units, not scaled by η) and is halved until Krum
    with f = k over the b before-attack rows followed by the k copies selects a copy; the first
    k that succeeds fixes λ. Needs b >= 2. The copies come last, as in both codes, so Krum's
    ties go to the before-attack rows: with b <= 3 Krum uses one neighbour, a copy never beats
    its nearest row, and λ halves down to ``tol``.

    All copies are identical (Fang samples supporters within ε of w'_1; FLPoison and FLDetector
    copy it exactly). In the full variant the crafted copies come first, as in FLDetector's
    ``dir_full_krum_lambda`` (the attackers are its first f rows), so ties favour them.
    η = ``ctx.lr``.

    Parameters
    ----------
    variant : {"full", "partial"}, default "full"
    tol : float > 0, default 1e-5
        Stop threshold on λ (parameter units for ``full``, gradient units for ``partial``,
        as in the respective code).

    References
    ----------
    M. Fang, X. Cao, J. Jia, N. Gong, "Local Model Poisoning Attacks to Byzantine-Robust
    Federated Learning", USENIX Security 2020, Section 4.2.
    """

    name = "fang_krum"
    blockwise = True
    on_device = True

    def __init__(self, variant: str = "full", tol: float = 1e-5):
        self.variant = choice("attack.variant", variant, ("full", "partial"))
        self.tol = real("attack.tol", tol, lo=0.0, lo_open=True)
        self.knowledge = "omniscient" if variant == "full" else "collusion"

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if self.variant == "partial" and b < 2:
            return ConfigError("attack.variant", "'partial' needs at least 2 Byzantine clients")
        f = b if f is None else f
        if self.variant == "full" and n <= 2 * f + 1:
            return ConfigError("attack.variant", f"'full' needs n > 2f + 1 clients for Fang's bound (n = {n}, f = {f})")
        return None

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        b = byz.shape[0]
        xp = array_namespace(byz)
        if self.variant == "full":
            honest = known(honest)
            s = xp.sign(column_sum(byz) + column_sum(honest))
            lam, _ = fang_krum_lambda(honest, s, b, ctx.f, ctx.lr, self.tol)
            return xp.broadcast_to(-(lam / ctx.lr) * s, byz.shape)
        s = xp.sign(column_sum(byz))
        for supporters in range(1, b):
            lam, chosen = fang_krum_lambda(byz, s, supporters, supporters, 1.0, self.tol, start=1.0, copies_last=True)
            if chosen:
                break
        return xp.broadcast_to(-lam * s, byz.shape)


@ATTACKS.register
class FangTrim(ModelAttack):
    r"""Fang et al.'s attack on trimmed mean / median: push every coordinate past the extremes.

    Full knowledge (Fang's Section 4.3 rule in gradient form): with :math:`s = \operatorname{sign}(\sum_i g_i)` over
    all pre-attack gradients, per coordinate k

    .. math:: \text{base}_k = \begin{cases}\min_i g_{ik} & s_k > 0\\ \max_i g_{ik} & \text{otherwise}\end{cases}
        \qquad \tilde g_{jk} = \begin{cases}\text{base}_k / r_{jk} & s_k\,\text{base}_k > 0\\
        \text{base}_k \cdot r_{jk} & \text{otherwise}\end{cases}, \quad r_{jk}\sim U[1, b]

    so every value lies beyond the benign extreme on the side that opposes the honest update
    (in [base/b, base] or between base and b·base). Partial knowledge (knowledge
    ``collusion``): μ, σ (population std, as Fang's code) of the attackers' own pre-attack
    gradients and :math:`\tilde g_{jk} = \mu_k - \operatorname{sign}(\mu_k)\,\sigma_k\,u_{jk}`,
    u ~ U[3, 4] (Fang's [μ + 3σ, μ + 4σ] model range in gradient form; a single attacker has
    σ = 0 and sends its own gradient). r and u are drawn per attacker and coordinate from the
    context's generator.

    Parameters
    ----------
    variant : {"full", "partial"}, default "full"
    b : float >= 1, default 2
        Fang's range factor (full variant).

    References
    ----------
    Fang et al., USENIX Security 2020, Section 4.3.
    """

    name = "fang_trim"
    blockwise = True
    on_device = True

    def __init__(self, variant: str = "full", b: float = 2.0):
        self.variant = choice("attack.variant", variant, ("full", "partial"))
        self.b = real("attack.b", b, lo=1.0)
        self.knowledge = "omniscient" if variant == "full" else "collusion"

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        # The draws row by row give the values of one (b, d) draw (the generator fills it row by
        # row), so only one row of them and of the result is ever in float64.
        xp = array_namespace(byz)
        out = empty(byz)
        if self.variant == "partial":
            mu, sigma = mean(byz), std(byz, 0, "attack fang_trim")
            spread = xp.sign(mu) * sigma
            for row in out:
                row[:] = mu - spread * like(ctx.rng.uniform(3.0, 4.0, size=mu.shape[0]), mu)
            return out
        honest = known(honest)
        s, base = empty(byz, (byz.shape[1],), xp.float64), empty(byz, (byz.shape[1],), xp.float64)
        for c in column_blocks(byz.shape[1]):
            rows = float64_rows(byz, honest, c=c)
            s[c] = xp.sign(xp.sum(rows, axis=0))
            base[c] = xp.where(s[c] > 0, xp.min(rows, axis=0), xp.max(rows, axis=0))
        beyond = s * base > 0
        for row in out:
            r = like(ctx.rng.uniform(1.0, self.b, size=base.shape[0]), base)
            row[:] = xp.where(beyond, base / r, base * r)
        return out
