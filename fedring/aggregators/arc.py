"""Adaptive robust clipping, ARC (Allouah, Guerraoui, Gupta, Jellouli, Rizk, Stephan, NeurIPS 2024)."""

from __future__ import annotations

import numpy as np

from .base import register_pre
from .preaggregators import RowScaling


def arc_clipped(n: int, f: int) -> int:
    r"""Number of rows ARC clips: :math:`k = \lfloor 2 f (n - f) / n \rfloor`, in integers.

    ByzFL computes ``int((2 * f / n) * (n - f))`` in floating point, which is one less when the
    quotient is a whole number that the rounding of 2f/n pushes below it: 120 pairs with
    n <= 3000, the first (n, f) = (121, 66), where k = 60 and ByzFL clips 59.

    >>> arc_clipped(3, 1), arc_clipped(10, 2), arc_clipped(121, 66), int((2 * 66 / 121) * (121 - 66))
    (1, 3, 60, 59)
    """
    return 2 * f * (n - f) // n


@register_pre
class ARC(RowScaling):
    r"""Adaptive robust clipping: clip the k largest rows to the norm of the (k + 1)-th largest
    (Allouah et al., "The vital role of gradient clipping in Byzantine-resilient distributed
    learning", arXiv:2405.14432, NeurIPS 2024; ByzFL ``ARC(f)``).

    .. math::
        y_i = \min\Big(1, \frac{\|x_{\pi(n - k)}\|_2}{\|x_i\|_2}\Big)\, x_i, \qquad
        k = \Big\lfloor \frac{2f}{n}(n - f) \Big\rfloor

    with π ordering the rows by increasing norm, so the threshold is the largest norm of the
    n - k rows left alone (rows tied with it at the threshold are unchanged whichever is
    counted as clipped). k is computed in integers (:func:`arc_clipped`; ByzFL's floating-point
    formula is one lower for some n, f). Row norms from one blocked pass; needs f <= n (as ByzFL).

    Example
    -------
    ByzFL's test vector: the largest row is clipped to the norm of the second, sqrt(77):

    >>> ARC(1).transform(np.array([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]]), None)[0]
    array([[1.        , 2.        , 3.        ],
           [4.        , 5.        , 6.        ],
           [4.41004009, 5.04004582, 5.67005155]])
    """

    name = "arc"
    on_device = True

    def check(self, n):
        if self.f > n:
            return f"arc needs f <= n, got n={n}, f={self.f}"
        return super().check(n)

    def factors(self, sq: np.ndarray) -> np.ndarray:
        """The rows' scale factors, from their squared norms ``sq``: 1, or the threshold over the norm."""
        n = sq.shape[0]
        k = arc_clipped(n, self.f)
        factor = np.ones(n)
        if k == 0:
            return factor
        norms = np.sqrt(sq)
        threshold = np.sort(norms)[n - k - 1]
        over = norms > threshold
        factor[over] = threshold / norms[over]
        return factor

    def clips(self, n):
        return arc_clipped(n, self.f) > 0
