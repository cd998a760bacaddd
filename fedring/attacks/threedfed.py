"""3DFed (Li, Ye, Guo, Zheng, Tang, Sun, Jia, Wang; IEEE S&P 2023): a backdoor that adapts to the
defence from what the previous global update shows at *indicators* it planted, and hides its
uploads behind noise masks and decoy models.

The attack is one central attacker, as in the authors' simulation: on rank 0 it trains on the
first Byzantine client's shard with its own copy of the model (:class:`ModelAccess`), then writes
every Byzantine upload of the round. The numbered steps of :class:`ThreeDFed` follow the authors'
``attacks/thrdfed.py`` (``perform_attack``) and ``attacks/components/`` (file commit 5b79ba5).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedring.validate import choice, integer, real

from ..errors import ConfigError
from .backdoor import Backdoor
from .base import ATTACKS, AttackContext, ModelAccess, ModelAttack

#: the weight a planted indicator is multiplied by (the authors' ``mul_(1e5)``)
INDICATOR_GAIN = 1e5


@dataclass(frozen=True)
class Profile:
    """The constants the authors' code picks by data set (``'MNIST' in params.task`` or not)."""

    ups: float  # weight of the inverse update-of-neuron terms of the noise masks
    norm: float  # weight of a mask's norm
    lagrange: float  # weight of the norm of a group's mask sum
    threshold: float  # indicator feedback at or below which an upload counts as rejected
    nudge: float  # added to an indicator whose planted value is 0
    noise_std: float  # standard deviation of the masks' initial noise
    noise_std_weak_dp: float  # the same once the server was found adding noise
    candidates: int  # candidate positions per indicator


PROFILES = {
    "mnist": Profile(1e-1, 8e-2, 1e-1, 1e-4, 1e-2, 0.05, 0.01, 10),
    "cifar": Profile(1e-1, 3e-2, 1e-2, 1e-5, 1e-3, 0.01, 0.01, 10),
}


def read_feedback(feedback: np.ndarray, threshold: float) -> tuple[list[str], bool]:
    r"""Each planted indicator's verdict from its feedback :math:`q_i = \Delta w_{I_i} / v_i`, the
    global update at the indicator over the value planted there (the authors' ``read_indicator``).

    A feedback above 1 or below :math:`-\tau` means the server adds noise (weak DP): reading stops
    there. Otherwise ``'r'`` (rejected) when :math:`q_i \le \tau` or is NaN (a non-finite
    global update; the authors' reading gives it no verdict and shifts the later ones), ``'c'``
    (clipped) when :math:`q_i \le 0.8 \max_j q_j`, else ``'a'`` (accepted).

    Examples
    --------
    >>> read_feedback(np.array([0.05, 0.03, 5e-5]), 1e-4)
    (['a', 'c', 'r'], False)
    >>> read_feedback(np.array([0.05, 1.5, 0.03]), 1e-4)
    (['c'], True)
    """
    accept: list[str] = []
    top = float(np.nanmax(feedback)) if np.isfinite(feedback).any() else 0.0
    for q in map(float, feedback):
        if q > 1 or q < -threshold:
            return accept, True
        accept.append("r" if not q > threshold else "c" if q <= top * 0.8 else "a")
    return accept, False


def tune(
    accept: list[str],
    alpha: np.ndarray,
    k: int,
    weak_dp: bool,
    attackers: int,
    group_size: int,
    alpha_low: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    r"""The authors' ``adaptive_tuning`` (Algorithm 4 of the paper): the number of decoy models ``k``
    and each group's mask weight :math:`\alpha_g` from the verdicts ``accept`` (attackers first,
    then decoys).

    Under weak DP every :math:`\alpha_g = 0.1` and ``k`` stays. Otherwise each accepted decoy
    lowers ``k`` by one (not below 0), and ``k`` grows by one when no attacker upload was accepted
    or clipped and no decoy accepted. A group (``attackers // group_size`` of them) is a candidate
    when at least 80% of its uploads were accepted; with one group and no candidate every
    :math:`\alpha` is drawn from :math:`U(\alpha_{low}, 1)`; with several, a group's
    :math:`\alpha` is drawn from :math:`U(c_1, c_2)` when every group is a candidate (``c`` the
    sorted candidates' weights), :math:`U(c_1, c_1 + 0.1)` when some are, else
    :math:`U(\alpha_{low}, 1)`; each :math:`\alpha` is then kept in [0.01, 0.99].

    Examples
    --------
    Two groups of two, the first accepted, one decoy accepted:

    >>> a, k = tune(list("aacra"), np.array([0.3, 0.7]), 1, False, 4, 2, 0.0, np.random.default_rng(0))
    >>> k, bool(0.3 <= a[0] <= 0.4 and 0.3 <= a[1] <= 0.4)
    (0, True)
    """
    alpha = np.array(alpha, dtype=np.float64)
    if weak_dp:
        alpha[:] = 0.1
        return alpha, k
    own, decoys = accept[:attackers], accept[attackers:]
    k = max(k - decoys.count("a"), 0)
    if "a" not in own and "c" not in own and decoys.count("a") <= 0:
        k += 1
    groups = attackers // group_size
    candidates = sorted(
        float(alpha[g])
        for g in range(groups)
        if accept[g * group_size : (g + 1) * group_size].count("a") >= group_size * 0.8
    )
    for g in range(groups):
        if groups <= 1:
            if not candidates:
                alpha[:] = [rng.uniform(alpha_low, 1.0) for _ in range(len(alpha))]
            break
        if len(candidates) == groups:
            alpha[g] = rng.uniform(candidates[0], candidates[1])
        elif candidates:
            alpha[g] = rng.uniform(candidates[0], candidates[0] + 0.1)
        else:
            alpha[g] = rng.uniform(alpha_low, 1.0)
    alpha[alpha >= 1] = 0.99
    alpha[alpha <= 0] = 0.01
    return alpha, k


def smallest_slots(values: np.ndarray, m: int) -> list[int]:
    """The positions of the ``m`` smallest of ``values`` (flat) in the slots of the authors' scan: the
    first ``m`` positions fill the slots, then each later value below the current largest takes the
    slot holding that largest (its first slot, as ``list.index``).

    >>> smallest_slots(np.array([0.5, 0.1, 0.4, 0.2, 0.3]), 3)
    [3, 1, 4]
    """
    values = np.asarray(values, np.float64).ravel()
    slots = list(range(min(m, len(values))))
    kept = [float(values[i]) for i in slots]
    i = m
    while i < len(values):  # a value at or above the current largest never enters: skip runs of them
        top = max(kept)
        below = np.flatnonzero(values[i:] < top)
        if not len(below):
            break
        i += int(below[0])
        j = kept.index(top)
        kept[j], slots[j] = float(values[i]), i
        i += 1
    return slots


def indicator_positions(analog: np.ndarray, curvature: np.ndarray, total: int, candidates: int) -> np.ndarray:
    r"""Where to plant ``total`` indicators in a layer (the authors' ``design_indicator``): among the
    ``candidates * total`` positions of smallest :math:`a = |u_{backdoor}| + |u_{benign}|`
    (:func:`smallest_slots`), the ``total`` of smallest absolute curvature :math:`|\partial_{w_j}
    \sum_i \partial_{w_i} L|`, scanned in slot order (a position of zero curvature replaces the
    slot of largest curvature only when its ``a`` is smaller). Flat positions within the layer.

    Examples
    --------
    >>> indicator_positions(np.array([0.5, 0.1, 0.4, 0.2, 0.3]), np.array([3.0, -1.0, 0.0, 2.0, 0.5]), 2, 2)
    array([4, 1])
    """
    analog = np.asarray(analog, np.float64).ravel()
    curv = np.abs(np.asarray(curvature, np.float64).ravel())
    index: list[int] = []
    kept: list[float] = []
    for idx in smallest_slots(analog, candidates * total):
        c = float(curv[idx])
        if len(index) < total:
            kept.append(c)
            index.append(idx)
        elif c == 0:
            j = kept.index(max(kept))
            if analog[idx] < analog[index[j]]:
                kept[j], index[j] = c, idx
        elif c < max(kept):
            j = kept.index(max(kept))
            kept[j], index[j] = c, idx
    return np.array(index, dtype=np.int64)


def decoy_positions(diff: np.ndarray, k: int) -> np.ndarray:
    r"""The ``k`` positions (flat, in :func:`smallest_slots` order) of smallest :math:`|u_{backdoor} -
    u_{benign}|` in the decoy layer, one per decoy model to train away from the benign model there.

    The authors' ``find_decoy_params`` means this but stores a replaced position in the slot of the
    *new* largest candidate, so its positions can differ from its values (docs/attacks.md).

    Examples
    --------
    >>> decoy_positions(np.array([[0.5, 0.1], [0.4, 0.2]]), 3)
    array([3, 1, 2])
    """
    return np.array(smallest_slots(diff, k), dtype=np.int64)


def noise_masks(
    weight: np.ndarray,
    bias: np.ndarray,
    init: np.ndarray,
    neurons: np.ndarray,
    alpha: float,
    profile: Profile,
    momentum: float,
    decay: float,
    lagrange_step: float,
    iterations: int = 30,
) -> tuple[np.ndarray, float]:
    r"""One group's noise masks on the output layer (the authors' ``noise_mask_design``), optimised
    by SGD (lr 0.1) from the centred ``init``.

    For the rows :math:`S` (``neurons``) of the backdoor update's output layer :math:`(W, b)` and
    mask :math:`M_i` (``init[i]``: weight columns then the bias, shape ``(classes, fan_in + 1)``),
    mask :math:`i` minimises

    .. math::
        L_i = \frac{\alpha\,U_i + (1 - \alpha)\,c_n \lVert M_{i,S}\rVert
        + \mu\,c_l \lVert \textstyle\sum_j M_{j,S}\rVert}{1 + \mu},\qquad
        U_i = \sum_{s \in S} \frac{c_u}{\lVert [W, b]_s + M_{i,s}\rVert_1},

    keeping its update on the rows :math:`S` large (:math:`U_i` small) and its own norm and the
    group's sum small; after each iteration :math:`\mu \mathrel{+}= \eta_\mu \lVert \sum_j
    M_{j,S}\rVert` (dual ascent). As in the authors' loop, mask :math:`i` steps after the
    backward passes of losses :math:`0..i`, so the gradient of the shared last term reaches it
    :math:`i + 1` times; SGD has torch's momentum and weight decay. Returns the masks and
    :math:`\mu`.
    """
    masks = np.array(init, dtype=np.float32)
    centre = np.zeros_like(masks[0])
    for m in masks:  # centred in the authors' order (float32): the group's masks sum to about 0
        centre += m / np.float32(len(masks))
    masks -= centre
    base = np.concatenate([weight, bias[:, None]], axis=1).astype(np.float32)[neurons]
    buf = np.zeros_like(masks)
    mu, lr, decay32, momentum32 = 1.0, np.float32(0.1), np.float32(decay), np.float32(momentum)
    rows = np.asarray(neurons)
    for it in range(iterations):
        m = masks[:, rows]  # (g, |S|, fan_in + 1), the values every loss of this iteration sees
        total = m.sum(axis=0)
        norm_total = np.linalg.norm(total)
        shared = np.float32(profile.lagrange) * (total / norm_total if norm_total > 0 else np.zeros_like(total))
        scale = np.float32(1 / (1 + mu))
        steps = masks.copy()
        for i in range(len(masks)):
            up = np.abs(base + m[i]).sum(axis=1)
            grad_u = -(np.float32(profile.ups) / up**2)[:, None] * np.sign(base + m[i])
            own = np.linalg.norm(m[i])
            grad_n = np.float32(profile.norm) * (m[i] / own if own > 0 else np.zeros_like(m[i]))
            g = np.zeros_like(masks[i])
            g[rows] = (
                np.float32(alpha) * grad_u + np.float32(1 - alpha) * grad_n + np.float32((i + 1) * mu) * shared
            ) * scale
            g += decay32 * masks[i]
            buf[i] = g if it == 0 else momentum32 * buf[i] + g
            steps[i] = masks[i] - lr * buf[i]
        masks = steps
        mu += lagrange_step * float(np.linalg.norm(masks[:, rows].sum(axis=0)))
    return masks, mu


@ATTACKS.register
class ThreeDFed(ModelAttack):
    r"""3DFed: a backdoor trained under a distance constraint, scaled to a benign update's norm,
    with indicators, noise masks and decoy models, tuned each round from the indicators' feedback.

    Each round from ``start_round`` on, the attacker (on rank 0, with the first Byzantine
    client's shard and a copy of the model, :class:`fedring.attacks.base.ModelAccess`), from the
    global weights :math:`w`:

    1. **Feedback** (after the first round): the global update :math:`\Delta w = w - w_{prev}` at
       each indicator planted last round over the value planted there
       (:func:`read_feedback`), then :func:`tune` (the decoy count ``k`` and each group's
       :math:`\alpha`; on the first round every :math:`\alpha_g \sim U(\text{alpha\_low}, 1)`).
    2. **Benign update** :math:`u_b`: ``steps`` SGD steps on clean batches.
    3. **Backdoor update** :math:`u_p`: ``poison_epochs * steps`` SGD steps on
       :math:`0.3\,L(B) + 0.3\,L(\tilde B) + 0.4\,\lVert w' - w\rVert_2`, :math:`\tilde B` the batch
       with the trigger, every label ``target``; then :math:`u_p \leftarrow \max(1, \min(\lVert
       u_b\rVert / \lVert u_p\rVert, \text{weight\_scale}))\,u_p`.
    4. **Indicators**: :func:`indicator_positions` in the indicator layer (the last convolution's
       weight, else the first weight matrix) from :math:`a = |u_p| + |u_b|` and the curvature
       summed over the shard's clean and triggered batches, one per upload.
    5. **Noise masks**: the attackers in groups of ``group_size``; each group draws
       ``num_neurons`` output neurons other than ``target`` and optimises its masks
       (:func:`noise_masks`, initial noise :math:`N(0, \sigma^2)`); attacker :math:`i` (in a
       random order) uploads :math:`u_p` plus its mask on those rows, with its indicator
       multiplied by :math:`10^5` (a zero there gets ``nudge``).
    6. **Decoys**: the last ``k`` Byzantine clients (at most all but two) upload decoy models
       instead: ``steps`` SGD steps on :math:`\tfrac12 (L(B) + \ell_p)` from :math:`w`, where
       :math:`\ell_p = -10\,|w'_p - w^b_p|` below a gap of 10 and :math:`10^{-10} |w'_p - w^b_p|`
       above, :math:`p` from :func:`decoy_positions` in the decoy layer (the weight matrix before
       the output layer, else the output layer's) and :math:`w^b` the benign model; with their
       indicators planted likewise.

    Uploads are in gradient units, :math:`-u / \eta` (``lr`` :math:`\eta`). SGD steps are torch's
    (``momentum``, ``weight_decay``, the round's lr). ``attack_success_rate`` is the backdoor's
    (:class:`~fedring.attacks.Backdoor`'s trigger, label ``target``).

    Runs on the host: the attacker trains its copy of the model (on the model's device) and builds
    the masks and uploads in numpy, on rank 0.

    Parameters
    ----------
    target : int >= 0, default 8
        The backdoor label (the authors' ``backdoor_label``).
    group_size : int >= 1, default 2
        Attackers per noise-mask group (``fl_adv_group_size``).
    num_neurons : int >= 1, default 8
        Output neurons each group's masks change (``fl_num_neurons``); at most classes - 1.
    alpha_low : float in [0, 1), default 0.0
        Lower end of the drawn :math:`\alpha` (``noise_mask_alpha``).
    weight_scale : float >= 1, default 5.0
        Largest factor the backdoor update is scaled up by (``fl_weight_scale``).
    poison_epochs : int >= 1, default 15
        Backdoor training, in multiples of the run's local steps (``fl_poison_epochs``).
    lagrange_step : float > 0, default 0.1
    momentum : float in [0, 1), default 0.9
    weight_decay : float >= 0, default 5e-4
        The attacker's SGD (the authors' MNIST configuration).
    profile : {"mnist", "cifar"}, default "mnist"
        The authors' per-data-set constants (:data:`PROFILES`).
    start_round : int >= 0, default 0
        The first round attacked (``poison_epoch``); before it the Byzantine clients are honest.

    References
    ----------
    H. Li, Q. Ye, H. Hu, J. Li, L. Wang, C. Fang, J. Shi, "3DFed: Adaptive and Extensible
    Framework for Covert Backdoor Attack in Federated Learning", IEEE S&P 2023, Algorithms 1-4;
    github.com/haoyangliASTAPLE/3DFed (``attacks/thrdfed.py``, ``attacks/components/``).

    Examples
    --------
    >>> a = ThreeDFed(num_neurons=3, n_classes=10)
    >>> a.trigger.target, a.knowledge
    (8, 'collusion')
    >>> a.check(20, 1) is not None
    True
    """

    name = "threedfed"
    knowledge = "collusion"
    needs_model = True

    def __init__(
        self,
        target: int = 8,
        group_size: int = 2,
        num_neurons: int = 8,
        alpha_low: float = 0.0,
        weight_scale: float = 5.0,
        poison_epochs: int = 15,
        lagrange_step: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        profile: str = "mnist",
        start_round: int = 0,
        *,
        n_classes: int | None = None,
        n_clients: int | None = None,
    ):
        top = None if n_classes is None else n_classes - 1
        self.target = integer("attack.target", target, lo=0, hi=top)
        self.group_size = integer("attack.group_size", group_size, lo=1)
        self.num_neurons = integer("attack.num_neurons", num_neurons, lo=1, hi=top)
        self.alpha_low = real("attack.alpha_low", alpha_low, lo=0.0, hi=1.0, hi_open=True)
        self.weight_scale = real("attack.weight_scale", weight_scale, lo=1.0)
        self.poison_epochs = integer("attack.poison_epochs", poison_epochs, lo=1)
        self.lagrange_step = real("attack.lagrange_step", lagrange_step, lo=0.0, lo_open=True)
        self.momentum = real("attack.momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
        self.weight_decay = real("attack.weight_decay", weight_decay, lo=0.0)
        self.profile = PROFILES[choice("attack.profile", profile, tuple(PROFILES))]
        self.start_round = integer("attack.start_round", start_round, lo=0)
        self.trigger = Backdoor(target=self.target, fraction=1.0, scale=1.0)
        #: what carries over between rounds (checkpointed with the run): empty before the first round
        self.state: dict[str, np.ndarray] = {}

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        if b < 2:
            return ConfigError("byzantine", f"threedfed needs at least 2 Byzantine clients in a round, got {b}")
        return None

    def craft(self, byz: np.ndarray, honest: np.ndarray | None, ctx: AttackContext) -> np.ndarray:
        if ctx.round < self.start_round:
            return byz
        run = ctx.model
        if run is None:
            raise ValueError("attack threedfed trains models: it needs the round's ModelAccess")
        b, rng, p = len(byz), ctx.rng, self.profile
        s = self.state
        groups = -(-b // self.group_size)
        if not s:
            alpha, k, weak_dp = np.array([rng.uniform(self.alpha_low, 1.0) for _ in range(groups)]), 0, False
        else:  # 1. feedback from last round's indicators
            alpha, k, weak_dp = s["alpha"], int(s["k"]), bool(s["weak_dp"])
            if not weak_dp:
                delta = run.w.astype(np.float64)[s["positions"]] - s["w"].astype(np.float64)[s["positions"]]
                accept, weak_dp = read_feedback(delta / s["values"], p.threshold)
                alpha, k = tune(accept, alpha, k, weak_dp, int(s["attackers"]), self.group_size, self.alpha_low, rng)
            else:
                alpha, k = tune([], alpha, k, True, 0, self.group_size, self.alpha_low, rng)
            if len(alpha) < groups:  # more attackers than last round: the new groups draw theirs
                alpha = np.concatenate([alpha, [rng.uniform(self.alpha_low, 1.0) for _ in range(groups - len(alpha))]])
        attackers = b - min(k, b - 2)  # the decoys this round can hold
        w = run.w.astype(np.float32)
        benign = self._sgd(run, w, run.steps, lambda v, x, y: run.gradient(v, x, y)[0]) - w  # 2.
        backdoor = self._backdoor(run, w)  # 3.
        nb, npn = float(np.linalg.norm(benign.astype(np.float64))), float(np.linalg.norm(backdoor.astype(np.float64)))
        if npn > 0:
            backdoor *= np.float32(max(min(nb / npn, self.weight_scale), 1.0))
        ind = run.indicator_layer  # 4.
        analog = np.abs(backdoor[ind]) + np.abs(benign[ind])
        curvature = np.zeros(analog.size, np.float64)
        for x, y in run.shard_batches():
            curvature += run.curvature(w, x, y)
            curvature += run.curvature(w, self.trigger.stamp(x), np.full_like(y, self.target))
        where = ind.start + indicator_positions(analog, curvature, b, p.candidates)
        uploads = np.empty((b, w.size), np.float32)
        values = np.empty(b, np.float64)
        self._masked(run, uploads, values, where, backdoor, alpha, attackers, weak_dp, rng)  # 5.
        self._decoys(run, uploads, values, where, w, benign, backdoor, attackers, b)  # 6.
        self.state = {
            "alpha": np.asarray(alpha, np.float64),
            "k": np.array(k),
            "weak_dp": np.array(weak_dp),
            "positions": where,
            "values": values,
            "attackers": np.array(attackers),
            "w": w.copy(),
        }
        return uploads / -np.float32(run.lr)

    def _sgd(self, run: ModelAccess, w: np.ndarray, steps: int, grad, batches=None) -> np.ndarray:
        """``steps`` torch SGD steps (the attack's momentum and weight decay, the round's lr) from ``w``
        along ``grad(v, x, y)`` on ``batches`` (default: the attacker's next ones)."""
        v, buf = w.copy(), None
        lr, m, wd = np.float32(run.lr), np.float32(self.momentum), np.float32(self.weight_decay)
        for _ in range(steps):
            x, y = next(run.batches if batches is None else batches)
            g = grad(v, x, y) + wd * v
            buf = g if buf is None else m * buf + g
            v = v - lr * buf
        return v

    def _backdoor(self, run: ModelAccess, w: np.ndarray) -> np.ndarray:
        """Step 3's update before scaling: the constrained backdoor objective's SGD from ``w``."""
        target = self.target

        def grad(v: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
            g = np.float32(0.3) * run.gradient(v, x, y)[0]
            g += np.float32(0.3) * run.gradient(v, self.trigger.stamp(x), np.full_like(y, target))[0]
            gap = v - w
            norm = np.float32(np.linalg.norm(gap))
            if norm > 0:
                g += np.float32(0.4) * gap / norm
            return g

        return self._sgd(run, w, self.poison_epochs * run.steps, grad) - w

    def _masked(self, run, uploads, values, where, backdoor, alpha, attackers, weak_dp, rng) -> None:
        """Step 5: the attackers' rows: the backdoor update plus their group's mask, indicator planted."""
        out = run.output_layer
        classes, fan_in = out.classes, out.fan_in
        weight = backdoor[out.start : out.start + classes * fan_in].reshape(classes, fan_in)
        bias = backdoor[out.start + classes * fan_in : out.start + classes * (fan_in + 1)]
        std = self.profile.noise_std_weak_dp if weak_dp else self.profile.noise_std
        masks: list[np.ndarray] = []
        neurons: list[np.ndarray] = []
        for g in range(-(-attackers // self.group_size)):
            pool = np.array([c for c in range(classes) if c != self.target])
            chosen = rng.permutation(pool)[: self.num_neurons]
            init = rng.normal(0.0, std, size=(self.group_size, classes, fan_in + 1))
            group, _ = noise_masks(
                weight,
                bias,
                init,
                chosen,
                float(alpha[g]),
                self.profile,
                self.momentum,
                self.weight_decay,
                self.lagrange_step,
            )
            masks.extend(group)
            neurons.append(chosen)
        for slot, i in enumerate(rng.permutation(attackers)):
            row = backdoor.copy()
            rows = neurons[slot // self.group_size]
            mask = masks[slot].astype(np.float32)
            wv = row[out.start : out.start + classes * fan_in].reshape(classes, fan_in)
            wv[rows] += mask[rows, :fan_in]
            row[out.start + classes * fan_in + rows] += mask[rows, fan_in]
            values[i] = self._plant(row, where[i])
            uploads[i] = row

    def _plant(self, row: np.ndarray, at: int) -> float:
        """Multiply ``row[at]`` by :data:`INDICATOR_GAIN` (a zero gets the profile's nudge); its new value."""
        row[at] *= np.float32(INDICATOR_GAIN)
        if row[at] == 0:
            row[at] += np.float32(self.profile.nudge)
        return float(row[at])

    def _decoys(self, run, uploads, values, where, w, benign, backdoor, attackers, b) -> None:
        """Step 6: the decoy models in the last ``b - attackers`` rows, indicators planted."""
        if b == attackers:
            return
        layer = run.decoy_layer
        spots = layer.start + decoy_positions(np.abs(backdoor[layer] - benign[layer]), b - attackers)
        w_benign = w + benign
        batches = [next(run.batches) for _ in range(run.steps)]  # every decoy steps on the same batches
        for j, spot in enumerate(spots):

            def grad(v: np.ndarray, x: np.ndarray, y: np.ndarray, spot: int = int(spot)) -> np.ndarray:
                g = np.float32(0.5) * run.gradient(v, x, y)[0]
                gap = v[spot] - w_benign[spot]  # the loss is -10 |gap| up to a gap of 10, 1e-10 |gap| above
                g[spot] += np.float32(0.5 * (-10.0 if abs(gap) <= 10 else 1e-10)) * np.sign(gap)
                return g

            row = self._sgd(run, w, run.steps, grad, iter(batches)) - w
            values[attackers + j] = self._plant(row, where[attackers + j])
            uploads[attackers + j] = row
