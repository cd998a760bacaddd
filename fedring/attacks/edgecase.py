"""Edge-case backdoor (Wang, Sreenivasan, Rajput, Vishwakarma, Agarwal, Sohn, Lee, Papailiopoulos,
NeurIPS 2020): the attackers train on samples from the tail of the input distribution, taken
from another data set and labelled ``target``."""

from __future__ import annotations

import numpy as np

from fedring.validate import choice, integer, real, text

from ..errors import ConfigError
from .backdoor import Backdoor
from .base import ATTACKS
from .neurotoxin import project_l2


def data_sets() -> dict:
    """The registered data sets (imported here: :mod:`fedring.datasets` reads no files on import)."""
    from fedring.datasets import DATASETS

    return dict(DATASETS.items())


@ATTACKS.register
class EdgeCase(Backdoor):
    r"""Replace part of each Byzantine batch with edge-case samples of another data set, labelled ``target``.

    The edge cases are the samples of class ``source_class`` (every class if None) of data set
    ``source``: the first ``samples`` of its training set (in file order) are the attackers'
    pool, its test samples of that class are the success rate's test set. In each Byzantine
    batch, ``round(fraction * N)`` samples drawn from the round's generator are replaced by as
    many pool samples drawn from it (without replacement while the pool lasts) and labelled
    ``target``; the upload is projected to ``lr * ||u|| <= norm`` (the paper's L2 PGD, none by
    default; :func:`fedring.attacks.neurotoxin.project_l2`) and multiplied by ``scale`` (model
    replacement, default n). ``attack_success_rate`` is the share of the edge-case test set the
    model classifies as ``target``, client ``c`` evaluating its samples ``c, c + n, c + 2n ...``

    The paper's MNIST case is Ardis' sevens labelled 1; fedring has no Ardis, so name a data
    set of the run's sample shape: ``attack.source = "mnist"`` on a Fashion-MNIST run (digits as
    the edge cases of clothes), ``"fashion-mnist"`` or ``"emnist-letters"`` on an MNIST run. A
    source whose samples have another shape is refused before training. The default,
    ``synthetic``, needs no files (its random patterns are out of every real 28 x 28 set's
    distribution); on a synthetic run it is ordinary relabelling.

    Parameters
    ----------
    target : int >= 0, default 0
    fraction : float in (0, 1], default 0.5
    scale : float > 0 or None, default None (= number of clients)
    source : str, default "synthetic"
        A registered data set (``fedring.datasets.DATASETS``).
    source_class : int >= 0 or None, default None
        The edge-case class of ``source`` (Ardis: 7); None: every class.
    source_dir : str or None, default None
        Where ``source``'s files are (None: its own default and environment variable).
    samples : int >= 1, default 660
        Size of the attackers' pool (Ardis has 660 training sevens).
    norm : float > 0 or None, default None
        PGD radius on the model change (the paper's MNIST value: 0.25).

    References
    ----------
    H. Wang et al., "Attack of the Tails: Yes, You Really Can Backdoor Federated Learning",
    NeurIPS 2020; FLPoison ``attackers/edgecase.py``, ``datapreprocessor/edge_dataset.py``.
    """

    name = "edgecase"

    def __init__(
        self,
        target: int = 0,
        fraction: float = 0.5,
        scale: float | None = None,
        source: str = "synthetic",
        source_class: int | None = None,
        source_dir: str | None = None,
        samples: int = 660,
        norm: float | None = None,
        *,
        n_clients: int | None = None,
    ):
        super().__init__(target, fraction, scale, n_clients=n_clients)
        sets = data_sets()
        self.source = choice("attack.source", source, list(sets))
        if len(sets[self.source].shape) == 1:
            raise ConfigError("attack.source", f"{self.source}'s samples are token sequences: name an image data set")
        self.source_class = None if source_class is None else integer("attack.source_class", source_class, lo=0)
        if self.source_class is not None and self.source_class >= sets[self.source].classes:
            raise ConfigError(
                "attack.source_class",
                f"{self.source} has classes 0 to {sets[self.source].classes - 1}, got {self.source_class}",
            )
        self.source_dir = None if source_dir is None else text("attack.source_dir", source_dir)
        self.samples = integer("attack.samples", samples, lo=1)
        self.norm = None if norm is None else real("attack.norm", norm, lo=0.0, lo_open=True)
        self._pool: np.ndarray | None = None
        self._test: np.ndarray | None = None

    def fits(self, shape: tuple[int, ...]) -> None:
        """Refuse a run whose samples do not have the source's shape (ConfigError ``attack.source``)."""
        own = tuple(data_sets()[self.source].shape)
        if tuple(shape) != own:
            raise ConfigError(
                "attack.source",
                f"{self.source}'s samples have shape {own} and the run's {tuple(shape)}: "
                "name a data set whose samples have the run's shape",
            )

    def edge_cases(self, test: bool) -> np.ndarray:
        """The source's samples of ``source_class``: the first ``samples`` training ones, or every test one."""
        data = data_sets()[self.source](self.source_dir)
        labels = data.test_labels() if test else data.train_labels()
        rows = np.arange(len(labels)) if self.source_class is None else np.flatnonzero(labels == self.source_class)
        if not test:
            rows = rows[: self.samples]
        if not len(rows):
            raise ConfigError(
                "attack.source_class", f"{self.source} has no {'test' if test else 'training'} sample of it"
            )
        return np.asarray(data.test_images(rows) if test else data.train_images(rows), np.float32)

    def success_set(self, shape: tuple[int, ...]) -> np.ndarray:
        """The edge-case test set (loaded once); ConfigError if the run's samples have another ``shape``."""
        self.fits(shape)
        if self._test is None:
            self._test = self.edge_cases(test=True)
        return self._test

    def poison(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the batch with a random ``fraction`` of it replaced by pool samples labelled ``target``."""
        self.fits(x.shape[1:])
        if self._pool is None:
            self._pool = self.edge_cases(test=False)
        n = len(y)
        k = min(n, int(np.floor(self.fraction * n + 0.5)))
        chosen = np.sort(rng.choice(n, size=k, replace=False))
        drawn = rng.choice(len(self._pool), size=k, replace=k > len(self._pool))
        x, y = np.array(x, copy=True), np.array(y, copy=True)
        x[chosen] = self._pool[drawn]
        y[chosen] = self.target
        return x, y

    def stamp(self, x: np.ndarray) -> np.ndarray:
        """EdgeCase has no trigger: its success rate is measured on :meth:`success_set`."""
        raise TypeError("attack edgecase has no trigger to stamp: its success rate uses its edge-case test set")

    def release(
        self, upload: np.ndarray, lr: float, w: np.ndarray | None = None, memory: np.ndarray | None = None
    ) -> None:
        """The L2 projection (PGD) of the upload, before scaling."""
        project_l2(upload, lr, self.norm)
