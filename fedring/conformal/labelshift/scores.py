"""Classification scores of label-shift DP-FedCP: temperature softmax and randomised APS.

The paper (Plassier et al., ICML 2023, Section 5) scores every experiment with the randomised
adaptive prediction sets (APS) score of Romano et al. (2020). The score lies in [0, 1], which is
why every weighted measure of :mod:`.quantiles` puts the test point's atom at 1.
"""

from __future__ import annotations

import numpy as np

from fedring.validate import real


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of ``logits / temperature`` (temperature scaling, paper Section 5).

    >>> softmax(np.array([[0.0, np.log(3.0)]])).round(6).tolist()
    [[0.25, 0.75]]
    """
    real("temperature", temperature, lo=0, lo_open=True)
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def aps_scores(probs: np.ndarray, labels: np.ndarray | None, u: np.ndarray) -> np.ndarray:
    """Randomised APS non-conformity scores (paper Section 5, Romano et al. 2020).

    .. math::
        \\rho(x, y) = \\sum_{y'} p[y'] 1\\{p[y'] > p[y]\\}, \\qquad V(x, y) = \\rho(x, y) + U p[y]

    with ``p = f(x)`` and ``U ~ Uniform[0, 1]``. ``V`` lies in [0, 1] because
    ``rho + U p[y] <= sum(p) = 1``: this is why every weighted measure puts the test point's
    atom at 1.

    Parameters
    ----------
    probs : (m, C) array
        Class probabilities, rows summing to 1 (float32 or float64).
    labels : (m,) int array or None
        With labels: one score per row, ``V(x_k, y_k)``. Without: the ``(m, C)`` matrix of
        scores of every candidate label, with one ``U`` per row shared by all labels. The
        paper does not say how a test point is randomised; sharing ``U`` (as the APS
        reference code does) makes the sets nested in the threshold (``docs/labelshift.md``).
    u : (m,) array
        The uniform draws.

    Examples
    --------
    >>> p = np.array([[0.5, 0.3, 0.2]])
    >>> aps_scores(p, np.array([1]), np.array([0.5])).tolist()   # 0.5 + 0.5 * 0.3
    [0.65]
    >>> aps_scores(p, None, np.array([0.0])).round(12).tolist()
    [[0.0, 0.5, 0.8]]
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be (m, C), got shape {p.shape}")
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    if u.shape[0] != p.shape[0]:
        raise ValueError(f"u has {u.shape[0]} entries for {p.shape[0]} rows")
    m, c = p.shape
    # rho = mass of classes strictly more likely; ties share the mass of their tie group.
    order = np.argsort(-p, axis=1, kind="stable")
    ps = np.take_along_axis(p, order, axis=1)
    before = np.cumsum(ps, axis=1) - ps
    new_group = np.ones((m, c), dtype=bool)
    new_group[:, 1:] = ps[:, 1:] != ps[:, :-1]
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(c), 0), axis=1)
    rho_sorted = np.take_along_axis(before, group_start, axis=1)
    rho = np.empty_like(rho_sorted)
    np.put_along_axis(rho, order, rho_sorted, axis=1)
    # Rows summing to 1 only up to rounding could exceed the test atom at 1 by an ulp.
    if labels is None:
        return np.minimum(rho + u[:, None] * p, 1.0)
    lab = np.asarray(labels).reshape(-1)
    if lab.shape[0] != m:
        raise ValueError(f"labels has {lab.shape[0]} entries for {m} rows")
    rows = np.arange(m)
    return np.minimum(rho[rows, lab] + u * p[rows, lab], 1.0)
