"""The attacks Blades built against two of its defences: clipped clustering (a chain of vectors,
each just inside the angle the benign updates span) and SignGuard (random magnitudes with the
benign mean's sign counts)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import Array, array_namespace, host, like
from fedring.validate import installed, real

from ..errors import ConfigError
from .base import ATTACKS, AttackContext, ModelAttack, by_columns, known, mean, row_products

#: the angle Blades subtracts at every link of the chain (``- 1e-4`` in ``_chain_attack``)
CHAIN_STEP = 1e-4


def single_linkage_labels(distances: np.ndarray) -> np.ndarray:
    """scikit-learn's ``AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="single")``
    labels of the (h, h) distance matrix (Blades' call, with ``affinity`` renamed ``metric``)."""
    import sklearn.cluster  # type: ignore[import-untyped,unused-ignore]

    model = sklearn.cluster.AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="single")
    return np.asarray(model.fit(distances).labels_)


def chain_coefficients(
    gram: np.ndarray, to_mean: np.ndarray, mean_sq: float, b: int, scale: float, margin: float
) -> tuple[np.ndarray, np.ndarray, int, dict]:
    r"""The b chained vectors of Blades' ``_chain_attack`` as :math:`\alpha_j \mu + \beta_j h_k`.

    From the honest rows' inner products ``gram`` (:math:`\langle h_i, h_j \rangle`),
    ``to_mean`` (:math:`\langle h_i, \mu \rangle`) and ``mean_sq`` (:math:`\|\mu\|^2`), with
    :math:`D_{ij} = 1 - \cos(h_i, h_j)`:

    * the honest rows are split in two by single linkage on D; the *larger group* is cluster 1
      if it has more than h // 2 members, else cluster 0;
    * :math:`\theta_c = \arccos(1 - \min_{i \ne j} D_{ij}) - \mathrm{margin}` (the smallest angle
      between any two honest rows, as Blades' loop computes it, whatever their clusters);
    * k is the position, within the larger group, of its row furthest in angle from μ, and
      :math:`\theta = \arccos(1 - D(h, \mu))` that row's angle; the chain starts from
      :math:`v_0 = h_k / \|h_k\|`, the k-th honest row (Blades indexes all honest rows with
      the position in the group);
    * attacker j = 1 ... b sends :math:`v_j = \mathrm{scale}\,(a\,\mu/\|\mu\| + c\,v_{j-1})`, with
      :math:`a = \cos(\theta + \theta_c - \epsilon) - \sin(\theta + \theta_c - \epsilon)/\tan\theta`,
      :math:`c = \cos(\theta_c - \epsilon) + \sin(\theta_c - \epsilon)/\tan\theta`, ε = 1e-4, and then
      :math:`\theta \leftarrow \theta + \theta_c - \epsilon`; once :math:`\theta + \theta_c \ge \pi`,
      :math:`v_j = -\mathrm{scale}\cdot\mu`.

    Returns ``(alpha, beta, k, figures)``: :math:`v_j = \alpha_j \mu + \beta_j h_k`, and the
    labels, group and angles for tests.
    """
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    den = np.outer(norms, norms)
    cos = np.divide(gram, den, out=np.zeros_like(gram), where=den > 0)  # torch: a zero row has cosine 0
    dist = 1.0 - cos
    np.fill_diagonal(dist, 0.0)
    dist[np.isnan(dist)] = 2.0
    h = len(gram)
    labels = single_linkage_labels(dist)
    cross = np.min(dist[~np.eye(h, dtype=bool)])
    theta_cross = np.arccos(1.0 - cross) - margin
    flag = 1 if int(labels.sum()) > h // 2 else 0
    group = np.flatnonzero(labels == flag)
    mean_norm = np.sqrt(mean_sq)
    den_mean = norms[group] * mean_norm
    to_mean_cos = np.divide(to_mean[group], den_mean, out=np.zeros(len(group)), where=den_mean > 0)
    dis2mean = 1.0 - to_mean_cos
    k = int(np.argmax(dis2mean))
    theta = np.arccos(1.0 - dis2mean[k])
    alpha, beta = np.zeros(b), np.zeros(b)
    a_prev, b_prev = 0.0, 1.0 / norms[k]
    with np.errstate(divide="ignore", invalid="ignore"):
        for j in range(b):
            if theta + theta_cross >= np.pi:
                a_prev, b_prev = -scale, 0.0
            else:
                a = np.cos(theta + theta_cross - CHAIN_STEP) - np.sin(theta + theta_cross - CHAIN_STEP) / np.tan(theta)
                c = np.cos(theta_cross - CHAIN_STEP) + np.sin(theta_cross - CHAIN_STEP) / np.tan(theta)
                a_prev, b_prev = scale * (a / mean_norm + c * a_prev), scale * c * b_prev
                theta = theta + theta_cross - CHAIN_STEP
            alpha[j], beta[j] = a_prev, b_prev
    figures = {"labels": labels, "flag": flag, "group": group, "theta_cross": theta_cross}
    return alpha, beta, k, figures


@ATTACKS.register
class ClippedClusteringAttack(ModelAttack):
    r"""Blades' attack on clipped clustering: a chain of vectors that walks away from the honest
    mean, each link at the largest angle the clustering still accepts.

    Every attacker (in client order) sends the next vector of the chain of
    :func:`chain_coefficients`, from the honest rows of the round: the first is
    :math:`\mathrm{scale}\,(a\,\mu/\|\mu\| + c\,h_k/\|h_k\|)`, rotated from μ by the angle of the
    honest row furthest from it plus :math:`\theta_c`, the smallest angle between two honest
    rows less ``margin``; each next one turns :math:`\theta_c` further from the one before (and
    grows by about ``scale``), until the turn reaches π, after which the attackers send
    :math:`-\mathrm{scale}\cdot\mu`.

    Parameters
    ----------
    scale : float > 0, default 10
        Blades' factor 10.
    margin : float >= 0, default 0.1
        Blades' 0.1 rad subtracted from the smallest honest angle.

    Needs at least 2 honest clients (two clusters) and scikit-learn.

    References
    ----------
    Blades (Li, Ngai, Voigt): ``blades/adversaries/attackclippedclustering_adversary.py``; the
    defence: Li, Ngai, Voigt, "An Experimental Study of Byzantine-Robust Aggregation Schemes in
    Federated Learning", IEEE TBD 2023.

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import AttackContext
    >>> honest = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.05]])
    >>> ctx = AttackContext(np.random.default_rng(0), n=5, f=2, lr=0.1, round=0, aggregator=None)
    >>> ClippedClusteringAttack()(np.zeros((2, 2)), honest, ctx).round(6)   # Blades: [0, -7.910635], [0, -3.5]
    array([[ 0.      , -7.910635],
           [ 0.      , -3.5     ]])
    """

    name = "clippedclustering_attack"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def __init__(self, scale: float = 10.0, margin: float = 0.1):
        installed(
            "attack", ["sklearn"], "clippedclustering_attack splits the honest updates with scikit-learn", "defences"
        )
        self.scale = real("attack.scale", scale, lo=0.0, lo_open=True)
        self.margin = real("attack.margin", margin, lo=0.0)

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if n - b < 2:
            return ConfigError(
                "byzantine", f"clippedclustering_attack splits the honest clients in two: needs 2 or more, got {n - b}"
            )
        return None

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        rows = known(honest)
        xp = array_namespace(rows)
        mu = mean(rows)
        gram, to_mean = row_products(rows, lambda c, x: (x @ x.T, x @ mu[c]))
        alpha, beta, k, _ = chain_coefficients(gram, to_mean, float(mu @ mu), byz.shape[0], self.scale, self.margin)
        a, b, base = like(alpha[:, None], mu), like(beta[:, None], mu), rows[k]
        return by_columns(byz, lambda c: a * mu[c] + b * xp.astype(base[c], xp.float64))


def signguard_noise(mu: np.ndarray, up: np.ndarray, down: np.ndarray, perm: np.ndarray) -> np.ndarray:
    r"""Blades' SignGuard vector from its draws: ``[up, -down, 0 ...][perm]``.

    ``up`` holds one U(0, 1) draw per positive coordinate of μ, ``down`` one per negative one;
    the vector puts them first, then zeros (one per zero coordinate), and is shuffled by
    ``perm``: it has μ's numbers of positive, negative and zero coordinates, at random places.

    >>> signguard_noise(np.array([1.0, -2.0, 0.0]), np.array([0.5]), np.array([0.25]), np.array([2, 0, 1]))
    array([ 0.  ,  0.5 , -0.25])
    """
    pos, neg = int((mu > 0).sum()), int((mu < 0).sum())
    if len(up) != pos or len(down) != neg or len(perm) != mu.size:
        raise ValueError("signguard_noise: one draw per positive and per negative coordinate, and a permutation of d")
    return np.concatenate([up, -down, np.zeros(mu.size - pos - neg)])[perm]


@ATTACKS.register
class SignGuardAttack(ModelAttack):
    r"""Blades' attack on SignGuard: random magnitudes with the sign statistics of the honest mean.

    With p, m and z the numbers of positive, negative and zero coordinates of the honest mean
    μ, every attacker sends the same vector: p draws of U(0, 1), m draws of −U(0, 1) and z zeros,
    shuffled by a uniform random permutation (:func:`signguard_noise`), all from the round's
    generator. SignGuard's sign-statistics filter sees a vector with the benign proportions of
    signs; its norm (about :math:`\sqrt{d/3}`) is what the norm filter checks.

    References
    ----------
    Blades: ``blades/adversaries/signguard_adversary.py``; the defence: Xu, Huang, Song, Lan,
    "SignGuard: Byzantine-robust Federated Learning through Collaborative Malicious Gradient
    Filtering", ICDCS 2022.
    """

    name = "signguard_attack"
    knowledge = "omniscient"
    blockwise = True
    on_device = True

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        mu = host(mean(known(honest)))  # the draws and their placement are the host's (one d-vector moves)
        up = ctx.rng.random(int((mu > 0).sum()))
        down = ctx.rng.random(int((mu < 0).sum()))
        perm = ctx.rng.permutation(mu.size)
        v = like(signguard_noise(mu, up, down, perm), byz)
        return by_columns(byz, lambda c: v[c])
