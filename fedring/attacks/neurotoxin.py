"""Neurotoxin (Zhang, Panda, Song, Yang, Mahoney, Gonzalez, Ramchandran, Mittal, ICML 2022): a
backdoor whose update keeps off the coordinates the benign clients change most, so that it
lasts after the attack stops; and the L2 projection the backdoors share."""

from __future__ import annotations

import numpy as np

from fedring.validate import real

from .backdoor import Backdoor
from .base import ATTACKS


def bottom_mask(delta: np.ndarray, keep: float) -> np.ndarray:
    r"""The float32 0/1 mask of the ``int(d * keep)`` coordinates of smallest :math:`|\Delta_j|`.

    Neurotoxin's projection: the attacker may change those coordinates only, and leaves the
    top ``1 - keep`` of the benign update to the benign clients. Exact ties are broken towards
    the lower index (a stable sort), ``int`` floors as the authors' ``int(len(grad) * ratio)``.

    >>> bottom_mask(np.array([0.3, -0.01, 2.0, 0.05]), 0.5).tolist()
    [0.0, 1.0, 0.0, 1.0]
    """
    delta = np.asarray(delta)
    k = int(delta.size * keep)
    mask = np.zeros(delta.size, np.float32)
    mask[np.argsort(np.abs(delta), kind="stable")[:k]] = 1.0
    return mask


def project_l2(upload: np.ndarray, lr: float, norm: float | None) -> None:
    r"""Project the upload (in place) so that the model change it makes, :math:`\eta\,u`, has an L2
    norm of at most ``norm``: :math:`u \leftarrow u \cdot \min(1, \mathrm{norm} / (\eta \|u\|_2))`
    (FLPoison's Neurotoxin ``norm_threshold`` and EdgeCase's L2 PGD ``epsilon`` on
    ``w_local - w_global``). None: unchanged.

    >>> u = np.array([3.0, 4.0], np.float32); project_l2(u, 0.5, 1.0); u.tolist()
    [1.2000000476837158, 1.600000023841858]
    """
    if norm is None:
        return
    length = lr * float(np.linalg.norm(upload.astype(np.float64)))
    if length > norm:
        upload *= np.float32(norm / length)


@ATTACKS.register
class Neurotoxin(Backdoor):
    r"""The backdoor (:class:`fedring.attacks.Backdoor`: trigger, ``fraction``, ``target``) with its
    update masked to the coordinates the last global update changed least.

    A Byzantine client remembers the global model it trained from the last time it took part,
    :math:`w_{prev}`; now, from :math:`w_t`, it takes the global update
    :math:`\Delta = w_t - w_{prev}` (the previous round's with full participation) and sends

    .. math::  u = \mathrm{scale} \cdot P_{\mathrm{norm}}(M \odot g), \qquad
               M_j = 1 \iff j \text{ is among the } \lfloor d \cdot \mathrm{keep} \rfloor
               \text{ smallest } |\Delta_j|,

    with g its upload on the poisoned batches and :math:`P_{\mathrm{norm}}` the projection of
    :func:`project_l2` (none by default). The first time it takes part it knows no update and
    sends :math:`P(g)` unmasked. The remembered model is a row per client checkpointed with the
    clients' optimizer rows (``/checkpoint/.../client_attack``), so a resumed run goes on
    bit-identically. With one local step the mask on the upload is the paper's projection of
    every gradient step; with several it is applied once, to ``(w - w_local) / lr``.

    Parameters
    ----------
    target : int >= 0, default 0
    fraction : float in (0, 1], default 0.5
    scale : float > 0, default 1.0
        Neurotoxin does not scale (the backdoor's default is n).
    value : float, default 1.0
    keep : float in (0, 1], default 0.95
        Share of coordinates the attacker may change (the authors' ``gradmask_ratio``: 0.95 to
        0.99 in their CV runs; 1 is the plain backdoor).
    norm : float > 0 or None, default None
        Bound on ``lr * ||u||`` before scaling (FLPoison: 0.2).

    References
    ----------
    Z. Zhang et al., "Neurotoxin: Durable Backdoors in Federated Learning", ICML 2022, Algorithm 1
    (top-k% of the downloaded update excluded); code: jhcknzzm/Federated-Learning-Backdoor
    (``helper.grad_mask_cv``), FLPoison ``attackers/neurotoxin.py``.

    Examples
    --------
    >>> import numpy as np
    >>> nt = Neurotoxin(keep=0.5)
    >>> memory = np.full(4, np.nan, np.float32)              # never took part
    >>> u = np.ones(4, np.float32); nt.release(u, 0.1, np.zeros(4, np.float32), memory); u.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> w = np.array([0.3, -0.01, 2.0, 0.05], np.float32)   # the global model moved by w - 0
    >>> u = np.ones(4, np.float32); nt.release(u, 0.1, w, memory); u.tolist()
    [0.0, 1.0, 0.0, 1.0]
    """

    name = "neurotoxin"
    remembers = True

    def __init__(
        self,
        target: int = 0,
        fraction: float = 0.5,
        scale: float = 1.0,
        value: float = 1.0,
        keep: float = 0.95,
        norm: float | None = None,
    ):
        super().__init__(target, fraction, scale, value)
        self.keep = real("attack.keep", keep, lo=0.0, lo_open=True, hi=1.0)
        self.norm = None if norm is None else real("attack.norm", norm, lo=0.0, lo_open=True)

    def release(
        self, upload: np.ndarray, lr: float, w: np.ndarray | None = None, memory: np.ndarray | None = None
    ) -> None:
        """Mask the upload with the update since the remembered model (if any), remember ``w``, project."""
        if w is not None and memory is not None:
            if not np.isnan(memory).any():
                upload *= bottom_mask(w - memory, self.keep)
            memory[:] = w
        project_l2(upload, lr, self.norm)
