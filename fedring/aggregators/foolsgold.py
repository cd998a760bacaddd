"""FoolsGold (Fung, Yoon, Beschastnikh, RAID 2020), as FLPoison's ``aggregators/foolsgold.py``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedring.validate import real

from ._clustering import cosines, inner_products
from ._kernels import BLOCK_BYTES, block_width, combine, map_blocks, row_stats
from .base import AggregateResult, Aggregator, register


def foolsgold_weights(cs: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    r"""FoolsGold's learning rates from the (n, n) cosine similarities of the clients' histories.

    ``cs`` has the self-similarities subtracted (diagonal 0, or -1 for an empty history). With
    :math:`v_i = \max_j cs_{ij} + \epsilon`, pardoning scales :math:`cs_{ij}` by
    :math:`v_i / v_j` where :math:`v_i < v_j`; then :math:`\alpha_i = 1 - \max_j cs_{ij}`
    clipped to [0, 1], divided by its maximum, 1 replaced by 0.99, and through the logit
    :math:`\ln(\alpha / (1 - \alpha) + \epsilon) + 0.5` clipped to [0, 1] (FLPoison's
    ``pardoning``; the original code has no ε). All weights are 0 when every :math:`\alpha_i`
    is 0, where FLPoison divides 0 by 0.

    Two clients with identical histories get weight 0, the third (orthogonal to both) 1:

    >>> cs = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> foolsgold_weights(cs)
    array([0., 0., 1.])
    """
    cs = np.array(cs, dtype=np.float64)
    n = cs.shape[0]
    v = cs.max(axis=1) + eps
    lower = (v[:, None] < v[None, :]) & ~np.eye(n, dtype=bool)
    cs[lower] *= (v[:, None] / v[None, :])[lower]
    wv = np.clip(1.0 - cs.max(axis=1), 0.0, 1.0)
    top = wv.max()
    if not top > 0:
        return np.zeros(n)
    wv = wv / top
    wv[wv == 1] = 0.99
    with np.errstate(divide="ignore"):
        wv = np.log(wv / (1 - wv) + eps) + 0.5
    wv[(np.isinf(wv) + wv) > 1] = 1
    wv[wv < 0] = 0
    return wv


@register
class FoolsGold(Aggregator):
    r"""FoolsGold: clients whose accumulated updates point the same way (sybils) lose weight.

    Runs on the host: its state holds every client's history (n x d numpy, checkpointed), read and written each round.

    Each round every upload is scaled to norm at most 1 (:math:`\hat x_i = x_i / \|x_i\|` when
    :math:`\|x_i\| > 1`) and added to the client's history :math:`h_i`; the weights
    :math:`\alpha` come from the cosine similarities of the histories (``foolsgold_weights``),
    and the output is the weighted sum :math:`\sum_i \alpha_i \hat x_i` (as in Fung et al. and
    FLPoison: a sum, not a mean, so each trusted client moves the model by up to a full step).

    Fung, Yoon, Beschastnikh, "The Limitations of Federated Learning in Sybil Settings",
    RAID 2020. FLPoison restricts the similarities to "indicative features" picked from the
    global model's output-layer weights; a server rule here sees the uploads only, so every
    coordinate counts, which is the original code's default (``importance=False``).

    Parameters
    ----------
    eps : float
        ε of the pardoning and of the logit (1e-6, FLPoison's ``epsilon``).

    State: ``history`` (n, d), the clients' summed scaled uploads (float32 unless init_state
    gets dtype=float64), kept per client.
    selected: the weights α_i.

    Examples
    --------
    Clients 0 and 1 send the same direction, client 2 another: the pair gets weight 0 (the
    cosine of their histories is 1); client 2's upload, of norm 5, is scaled to norm 1:

    >>> FoolsGold()(np.array([[1., 0.], [1., 0.], [0., 5.]]))
    array([0., 1.])
    """

    name = "foolsgold"
    selects = True
    client_state: Mapping[str, int] = {"history": 0}

    def __init__(self, f: int = 0, *, eps: float = 1e-6):
        super().__init__(f)
        self.eps = real("foolsgold.eps", eps, lo=0.0)

    def init_state(self, n, d, dtype=np.float32):
        return {"history": np.zeros((n, d), dtype)}

    def _aggregate(self, X, state, reference, rng):
        n, d = X.shape
        norms = np.sqrt(row_stats(X)[0])
        div = np.where(norms > 1, norms, 1.0)
        H = state["history"]
        dt = np.promote_types(H.dtype, X.dtype)
        scale = div[:, None].astype(dt)

        def task(sls):
            for sl in sls:
                H[:, sl] += (X[:, sl] / scale).astype(H.dtype, copy=False)

        map_blocks(task, d, block_width(n, X.itemsize, 4 * BLOCK_BYTES))
        G = inner_products(H)
        cos = cosines(G)
        np.fill_diagonal(cos, (np.diag(G) > 0).astype(float))
        wv = foolsgold_weights(cos - np.eye(n), self.eps)
        return AggregateResult(combine(wv / div, X), wv)
