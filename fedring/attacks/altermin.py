"""Alternating minimization with explicit boosting (Bhagoji, Chakraborty, Mittal, Calo, ICML 2019):
a targeted attack that runs its client's local steps itself, alternating a stealth objective on
its benign data and a boosted malicious objective on a few relabelled samples."""

from __future__ import annotations

import numpy as np

from fedring.validate import integer, real

from ..errors import ConfigError
from .backdoor import Backdoor
from .base import ATTACKS, LocalRun


@ATTACKS.register
class AlterMin(Backdoor):
    r"""Stealth steps on the client's benign batches, then boosted steps on ``poisoned_sample_cnt``
    samples of class ``source_label`` labelled ``target_label``.

    The attack runs its Byzantine client's local training of a round
    (:meth:`fedring.attacks.DataAttack.local_steps`). From the global weights :math:`w_g`:

    1. **Stealth** (``benign_epochs`` SGD steps on the client's own mini-batches ``B``):

       .. math:: w \leftarrow w - \eta\,\bigl(\nabla L(w; B) + 2\rho\,(w - w_g)\bigr),

       the gradient of the stealth objective :math:`L(w; B) + \rho\,\lVert w - w_g\rVert_2^2`
       (:math:`\nabla L` clipped and decayed as an honest client's).
    2. **Malicious**, unless its loss at the stealth weights :math:`w_s` is already 0:
       ``malicious_epochs`` SGD steps on the poisoned samples :math:`P` (all of them in each step),
       :math:`w \leftarrow w - \eta\,\nabla L(w; P)`, ending at :math:`w_m`, then the boost

       .. math:: w_{end} = w_s + \lambda\,(w_m - w_s), \qquad \lambda = \text{boosting\_factor}.

    The client uploads :math:`(w_g - w_{end}) / \eta`. An *epoch* is one SGD step on one
    mini-batch, as in FLPoison, whose ``local_training`` takes one batch per local epoch.
    The poisoned samples are the first ``poisoned_sample_cnt`` of class ``source_label`` in the
    client's shard (fewer if it holds fewer; with none it only runs the stealth steps), the same
    every round, as the paper's fixed auxiliary set. ``attack_success_rate`` is the share of the
    test samples of class ``source_label`` that the model classifies as ``target_label``.

    The paper's stealth term weighs the distance of the malicious update to an estimate of the
    benign one; here, as in FLPoison, the reference is the global weights (an estimate of 0), and
    the distance is squared so that it has a gradient where the stealth steps start
    (:math:`w = w_g`), and is differentiated (FLPoison computes its unsquared distance on numpy
    copies: no gradient, so its stealth objective is the plain loss; docs/attacks.md).

    Parameters
    ----------
    source_label : int >= 0, default 3
    target_label : int >= 0, default 7
        Distinct classes of the data set.
    poisoned_sample_cnt : int >= 1, default 1
        The paper's r (1 to 10 auxiliary samples); FLPoison's default 1.
    boosting_factor : float > 0, default 10.0
        The paper's :math:`\lambda` (explicit boosting; FLPoison's default).
    rho : float >= 0, default 1e-4
        Weight of the distance term (FLPoison's default).
    benign_epochs : int >= 0 or None, default None
        Stealth steps; None: the run's local steps per client (1 under FedSGD), the honest
        clients' work. FLPoison's default is 10.
    malicious_epochs : int >= 1, default 1
        Malicious steps, boosted together (FLPoison's default).

    References
    ----------
    A. N. Bhagoji, S. Chakraborty, P. Mittal, S. Calo, "Analyzing Federated Learning through an
    Adversarial Lens", ICML 2019, Sections 3 and 4 (explicit boosting, alternating minimization);
    FLPoison ``attackers/altermin.py``.

    Examples
    --------
    A quadratic loss :math:`\tfrac12\lVert w - \bar x\rVert^2` (gradient :math:`w - \bar x`), lr 0.5,
    :math:`\rho = 0.25`, two stealth steps on the batch ``[[0, 2]]``: :math:`w = (0, 1)`, then
    :math:`(0, 1) - 0.5\,((0, -1) + 0.5\,(0, 1)) = (0, 1.25)`; one malicious step on the sample
    ``[2, 0]`` (class 3): :math:`(0, 1.25) - 0.5\,(-2, 1.25) = (1, 0.625)`, boosted
    :math:`(0, 1.25) + 10\,(1, -0.625) = (10, -5)`.

    >>> import itertools
    >>> import numpy as np
    >>> from fedring.attacks.base import LocalRun
    >>> def gradient(w, x, y):
    ...     return w - x.mean(axis=0), 1.0
    >>> samples = (np.array([[2.0, 0.0], [0.0, 2.0]], np.float32), np.array([3, 5]))
    >>> batches = itertools.repeat((samples[0][1:], samples[1][1:]))
    >>> run = LocalRun(np.zeros(2, np.float32), batches, samples, gradient, 0.5, 1)
    >>> AlterMin(rho=0.25, benign_epochs=2).local_steps(run).tolist()
    [10.0, -5.0]
    """

    name = "altermin"
    takes_text = True  # relabelling only: no trigger
    owns_steps = True

    def __init__(
        self,
        source_label: int = 3,
        target_label: int = 7,
        poisoned_sample_cnt: int = 1,
        boosting_factor: float = 10.0,
        rho: float = 1e-4,
        benign_epochs: int | None = None,
        malicious_epochs: int = 1,
        *,
        n_classes: int | None = None,
    ):
        top = None if n_classes is None else n_classes - 1
        super().__init__(target=integer("attack.target_label", target_label, lo=0, hi=top), scale=1.0)
        self.source_label = integer("attack.source_label", source_label, lo=0, hi=top)
        if self.source_label == self.target:
            raise ConfigError("attack.target_label", f"must differ from attack.source_label ({self.source_label})")
        self.poisoned_sample_cnt = integer("attack.poisoned_sample_cnt", poisoned_sample_cnt, lo=1)
        self.boosting_factor = real("attack.boosting_factor", boosting_factor, lo=0.0, lo_open=True)
        self.rho = real("attack.rho", rho, lo=0.0)
        self.benign_epochs = None if benign_epochs is None else integer("attack.benign_epochs", benign_epochs, lo=0)
        self.malicious_epochs = integer("attack.malicious_epochs", malicious_epochs, lo=1)

    def poison(
        self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` with the labels of class ``source_label`` set to ``target_label`` (x not copied)."""
        y = np.asarray(y)
        return x, np.where(y == self.source_label, self.target, y).astype(y.dtype, copy=False)

    def stamp(self, x: np.ndarray) -> np.ndarray:
        """No trigger: the success rate is measured on the clean source-class samples."""
        return np.array(x, copy=True)

    def counted(self, y: np.ndarray) -> np.ndarray:
        """The test samples the success rate counts: those of class ``source_label``."""
        return np.asarray(y) == self.source_label

    def poisoned_samples(self, samples: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The first ``poisoned_sample_cnt`` samples of class ``source_label``, labelled ``target_label``."""
        x, y = samples
        rows = np.flatnonzero(np.asarray(y) == self.source_label)[: self.poisoned_sample_cnt]
        return self.poison(x[rows], y[rows])

    def local_steps(self, run: LocalRun) -> np.ndarray:
        """The stealth steps, then the boosted malicious steps: the client's final weights."""
        rho2, lr = np.float32(2 * self.rho), run.lr
        w = run.w.copy()
        for _ in range(run.steps if self.benign_epochs is None else self.benign_epochs):
            x, y = next(run.batches)
            g, _ = run.gradient(w, x, y)
            g += rho2 * (w - run.w)
            w -= lr * g
        x, y = self.poisoned_samples(run.samples)
        if not len(y):
            return w
        stealth = w.copy()
        for step in range(self.malicious_epochs):
            g, loss = run.gradient(w, x, y)
            if step == 0 and not loss > 0:  # the malicious objective is met (FLPoison: asr_loss > 0)
                return stealth
            w -= lr * g
        return stealth + np.float32(self.boosting_factor) * (w - stealth)
