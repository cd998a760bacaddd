"""Pixel-pattern backdoor with model replacement (Bagdasaryan et al., AISTATS 2020), and its
success rate. The BRACE paper cites only Bagdasaryan et al., so trigger, target and scaling follow
the FedSGD form of the Fang/FLDetector code (docs/attacks.md).
"""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ..errors import ConfigError
from .base import ATTACKS, DataAttack

# (row, col) offsets from the bottom-right corner: on 28 x 28 images these are FLDetector's
# Fashion-MNIST pixels (26, 26), (24, 26), (26, 24), (25, 25), a small "x".
TRIGGER_OFFSETS = ((2, 2), (4, 2), (2, 4), (3, 3))
TRIGGER_FEATURES = 4


@ATTACKS.register
class Backdoor(DataAttack):
    r"""Stamp a trigger on part of each Byzantine batch, relabel it to a target, scale the gradient.

    For each Byzantine client's training batch, ``round(fraction * N)`` samples chosen by the
    context's generator get the trigger and label ``target``; the rest stay clean. The gradient
    computed on that batch is multiplied by ``scale`` (model replacement; default n, the number
    of clients, as FLDetector's ``scaling_attack``). Scaling does not matter to sign-based rules
    (BRACE, signSGD, RLR).

    Trigger (:meth:`stamp`): on images ``(N, ..., H, W)`` the pixels (H−2, W−2), (H−4, W−2),
    (H−2, W−4), (H−3, W−3) of every channel are set to ``value`` (1.0 = maximum intensity in
    [0, 1]; on 28 x 28 Fashion-MNIST these are exactly (26,26), (24,26), (26,24), (25,25));
    on feature vectors ``(N, p)`` the last 4 features are set to ``value``.

    Parameters
    ----------
    target : int >= 0, default 0
    fraction : float in (0, 1], default 0.5
    scale : float > 0 or None, default None (= number of clients)
    value : float, default 1.0

    References
    ----------
    E. Bagdasaryan, A. Veit, Y. Hua, D. Estrin, V. Shmatikov, "How To Backdoor Federated
    Learning", AISTATS 2020; trigger, target 0, half batch, scale n: FLDetector
    (``train_mnist.py``, ``train_cifar.py``, ``byzantine.py``).

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import Backdoor
    >>> Backdoor(scale=1).stamp(np.zeros((1, 1, 5, 5)))[0, 0]
    array([[0., 0., 0., 0., 0.],
           [0., 0., 0., 1., 0.],
           [0., 0., 1., 0., 0.],
           [0., 1., 0., 1., 0.],
           [0., 0., 0., 0., 0.]])
    """

    name = "backdoor"
    takes_text = False  # a pixel trigger; on tokens it would overwrite the last 4 characters with token 1

    def __init__(
        self,
        target: int = 0,
        fraction: float = 0.5,
        scale: float | None = None,
        value: float = 1.0,
        *,
        n_clients: int | None = None,
    ):
        self.target = integer("attack.target", target, lo=0)
        self.fraction = real("attack.fraction", fraction, lo=0.0, lo_open=True, hi=1.0)
        self.value = real("attack.value", value)
        if scale is None:
            if n_clients is None:
                raise ConfigError("attack.scale", "give attack.scale, or build the attack with the number of clients")
            scale = n_clients
        self.scale = real("attack.scale", scale, lo=0.0, lo_open=True)

    def stamp(self, x: np.ndarray) -> np.ndarray:
        """A triggered copy of ``x`` (images ``(N, ..., H, W)`` or feature vectors ``(N, p)``)."""
        out = np.array(x, copy=True)
        if out.ndim >= 3 and out.shape[-2] >= 4 and out.shape[-1] >= 4:
            h, w = out.shape[-2:]
            for dr, dc in TRIGGER_OFFSETS:
                out[..., h - dr, w - dc] = self.value
        elif out.ndim == 2 and out.shape[1] >= TRIGGER_FEATURES:
            out[:, -TRIGGER_FEATURES:] = self.value
        else:
            raise ValueError(
                f"attack backdoor: cannot stamp a trigger on samples of shape {out.shape[1:]} "
                f"(need images at least 4 x 4 or at least {TRIGGER_FEATURES} features)"
            )
        return out

    def success_set(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """Samples of the attack's own on which the success rate is measured, in a run whose samples
        have ``shape`` (EdgeCase's edge-case test set; it refuses a ``shape`` its samples do not
        have); None (here): the test samples whose label is not ``target``, with the trigger."""
        return None

    def counted(self, y: np.ndarray) -> np.ndarray:
        """Which test samples, by their labels ``y``, the success rate counts (with :meth:`stamp` applied):
        those not of class ``target`` (a targeted attack counts its source class instead)."""
        return y != self.target

    def poison(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the batch with a random ``fraction`` of it triggered and relabelled."""
        n = len(y)
        k = min(n, int(np.floor(self.fraction * n + 0.5)))
        chosen = np.sort(rng.choice(n, size=k, replace=False))
        x, y = np.array(x, copy=True), np.array(y, copy=True)
        x[chosen] = self.stamp(x[chosen])
        y[chosen] = self.target
        return x, y


def attack_success_rate(pred_on_triggered: np.ndarray, y_true: np.ndarray, target: int) -> float:
    """Share of triggered test samples whose true label is not ``target`` that are classified as it.

    Samples of the target class are left out (FLDetector's ``evaluate_backdoor``). NaN if none
    is left.

    Examples
    --------
    >>> import numpy as np
    >>> attack_success_rate(np.array([0, 0, 1, 0]), np.array([0, 2, 2, 3]), target=0)
    0.6666666666666666
    """
    pred, y_true = np.asarray(pred_on_triggered), np.asarray(y_true)
    if pred.shape != y_true.shape:
        raise ValueError(f"predictions {pred.shape} and labels {y_true.shape} differ in shape")
    keep = y_true != target
    return float(np.mean(pred[keep] == target)) if keep.any() else float("nan")
