"""Label flipping (as in Yin et al., ICML 2018) with ByzFL's map y -> L - 1 - y (the BRACE paper gives none)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedring.validate import integer

from ..errors import ConfigError
from .base import ATTACKS, DataAttack


@ATTACKS.register
class LabelFlip(DataAttack):
    r"""Relabel every sample of a Byzantine client's batch: :math:`y \mapsto L - 1 - y`, or a given map.

    The client then computes its gradient honestly on the relabelled batch. The default map
    is an involution (flipping twice is the identity). FedSECA prints y' = C − y, out of range
    for 0-based labels; L − 1 − y is its 0-based form.

    Parameters
    ----------
    num_classes : int >= 2 or None, default None
        L; None: the data set's number of classes when the run supplies it (``n_classes``), else 10.
    mapping : list of int or None, default None
        ``mapping[l]`` is the new label of class l (length num_classes, values in range).

    Examples
    --------
    >>> import numpy as np
    >>> from fedring.attacks import LabelFlip
    >>> LabelFlip().poison(np.zeros((3, 1)), np.array([0, 3, 9]), None)[1]
    array([9, 6, 0])
    """

    name = "labelflip"

    def __init__(
        self, num_classes: int | None = None, mapping: Sequence[int] | None = None, *, n_classes: int | None = None
    ):
        if num_classes is None:
            num_classes = 10 if n_classes is None else n_classes
        self.num_classes = integer("attack.num_classes", num_classes, lo=2)
        if mapping is None:
            self.mapping = np.arange(self.num_classes)[::-1].copy()
        else:
            values = list(mapping) if isinstance(mapping, (list, tuple)) else None
            if (
                values is None
                or len(values) != self.num_classes
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < self.num_classes for v in values)
            ):
                raise ConfigError(
                    "attack.mapping",
                    f"must be a list of {self.num_classes} class indices in "
                    f"[0, {self.num_classes - 1}], got {mapping!r}",
                )
            self.mapping = np.asarray(values, dtype=np.int64)

    def poison(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator | None = None):
        """Return ``(x, mapped y)``; x is returned unchanged (not copied)."""
        y = np.asarray(y)
        if not np.issubdtype(y.dtype, np.integer) or (y.size and (y.min() < 0 or y.max() >= self.num_classes)):
            raise ValueError(f"attack labelflip: labels must be integers in [0, {self.num_classes - 1}]")
        return x, self.mapping[y].astype(y.dtype, copy=False)
