"""LASA, layer-adaptive sparsified aggregation (Xu, Zhang, Hu, WACV 2025), as FLPoison's
``aggregators/lasa.py``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedring.errors import ConfigError
from fedring.validate import real

from ._kernels import BLOCK_BYTES, block_width, map_blocks, map_rows, row_stats
from .base import AggregateResult, Aggregator, register


def layer_shapes(key: str, value: Any) -> list[tuple[int, ...]] | None:
    """``layers``: None, or a list of parameter shapes (lists of positive integers)."""
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) > 0
    shapes = []
    for shape in value if ok else ():
        if not (isinstance(shape, (list, tuple)) and shape and all(type(s) is int and s > 0 for s in shape)):
            ok = False
            break
        shapes.append(tuple(shape))
    if not ok:
        raise ConfigError(key, "must be a list of parameter shapes, e.g. [[32, 1, 3, 3], [32], [10, 512], [10]]")
    return shapes


def median_z_keep(values: np.ndarray, bound: float) -> np.ndarray:
    r"""(n,) bool: :math:`|v_i - \mathrm{median}(v)| / \mathrm{std}(v) < b` (LASA's MZ-score, population
    std). A zero std, or a NaN among the values, keeps nobody, as in FLPoison's ``mz_score``.

    >>> median_z_keep(np.array([1.0, 1.1, 0.9, 1.0, 5.0]), 1.0)
    array([ True,  True,  True,  True, False])
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs((values - np.median(values)) / np.std(values))
    return z < bound


@register
class LASA(Aggregator):
    r"""LASA: per layer, keep the clients whose sparsified update has an ordinary norm and sign balance.

    Runs on the host: its per-layer sparsification partitions each client's row with numpy.

    1. Every upload is clipped to the median norm M: :math:`\tilde x_i = x_i \min(1, M/\|x_i\|)`.
    2. Each client's upload is sparsified: of the values of its weight layers (parameters of two
       or more dimensions), only those of magnitude above its k-th largest,
       :math:`k = \lfloor (1 - s) D_w\rfloor`, are kept; other layers stay dense.
    3. Per layer l, on the sparsified values: the norm :math:`\nu_i` and the sign balance
       :math:`\rho_i = \tfrac12 (1 - s) \sum_j \mathrm{sgn}(x_{ij}) / \sum_j |\mathrm{sgn}(x_{ij})|`;
       client i is kept when both MZ-scores :math:`|v_i - \mathrm{med}(v)|/\mathrm{std}(v)` are
       below their bounds (``median_z_keep``), every client if none is.
    4. Layer l of the output is the mean of the kept clients' clipped uploads :math:`\tilde x_i`.

    Xu, Zhang, Hu, "Achieving Byzantine-Resilient Federated Learning via Layer-Adaptive
    Sparsified Model Aggregation", WACV 2025 (arXiv:2409.01435). The uploads are flat vectors;
    ``layers`` gives the model's parameter shapes in the vector's order (``[list(p.shape) for p
    in model.parameters()]``). Without it the whole vector is one weight layer.

    Parameters
    ----------
    norm_bound, sign_bound : float
        Bounds of the two MZ-scores (2.0 and 1.0, FLPoison's; its comment suggests 1.0 and 1.0
        for CIFAR-10/100).
    sparsity : float in [0, 1)
        s, the share of each client's weight values dropped (0.3).
    layers : list of shapes or None
        The parameter shapes; their sizes must add up to d.

    selected: the share of the layers in which the client was kept.

    Examples
    --------
    One layer of four weights, sparsity 0. The norms 2, 2.4, 1.8, 2, 2.2 all have MZ-scores below
    2; the sign balances are 0.5 but for client 3's 0.25 (MZ-score 2.5), which drops client 3.
    Clients 1 and 4 are clipped to the median norm 2, and the mean of the four kept is 0.975:

    >>> X = np.array([[1.0] * 4, [1.2] * 4, [0.9] * 4, [1, 1, 1, -1], [1.1] * 4])
    >>> LASA(sparsity=0.0)(X)
    array([0.975, 0.975, 0.975, 0.975])
    """

    name = "lasa"
    selects = True

    def __init__(
        self,
        f: int = 0,
        *,
        norm_bound: float = 2.0,
        sign_bound: float = 1.0,
        sparsity: float = 0.3,
        layers: list | None = None,
    ):
        super().__init__(f)
        self.norm_bound = real("lasa.norm_bound", norm_bound, lo=0.0, lo_open=True)
        self.sign_bound = real("lasa.sign_bound", sign_bound, lo=0.0, lo_open=True)
        self.sparsity = real("lasa.sparsity", sparsity, 0.0, 1.0, hi_open=True)
        self.layers = layer_shapes("lasa.layers", layers)

    def segments(self, d: int) -> list[tuple[int, int, bool]]:
        """(start, stop, sparsified) per layer; ConfigError if the shapes do not cover d."""
        if self.layers is None:
            return [(0, d, True)]
        sizes = [math.prod(s) for s in self.layers]
        if sum(sizes) != d:
            raise ConfigError("lasa.layers", f"the shapes hold {sum(sizes)} values; the uploads have d={d}")
        stops = np.cumsum(sizes).tolist()
        return [(stop - size, stop, len(s) in (2, 4)) for stop, size, s in zip(stops, sizes, self.layers)]

    def thresholds(self, X: np.ndarray, segs: list[tuple[int, int, bool]]) -> np.ndarray:
        """Per client, the k-th largest magnitude of its weight values (FLPoison's ``kth_largest``);
        -inf (keep everything) when the sparsity is 0 or there is no weight layer."""
        n = X.shape[0]
        out = np.full(n, -np.inf)
        weights = [(a, b) for a, b, w in segs if w]
        total = sum(b - a for a, b in weights)
        if self.sparsity == 0 or total == 0:
            return out
        k = int(total * (1 - self.sparsity))

        def task(rows):
            buf = np.empty(total, X.dtype)
            for i in rows:
                pos = 0
                for a, b in weights:
                    np.abs(X[i, a:b], out=buf[pos : pos + b - a])
                    pos += b - a
                at = total - k if k > 0 else 0
                buf.partition(at)
                out[i] = float(buf[at])

        map_rows(task, n)
        return out

    def layer_stats(self, X: np.ndarray, segs, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(L, n) squared norms, sign sums and nonzero counts of the sparsified layers, one pass."""
        n, d = X.shape
        L = len(segs)
        starts = np.array([a for a, _, _ in segs])
        thr = tau[:, None].astype(X.dtype) if np.isfinite(tau).all() else None

        def task(sls):
            sq, sg, nz = np.zeros((L, n)), np.zeros((L, n), np.int64), np.zeros((L, n), np.int64)
            for sl in sls:
                first = int(np.searchsorted(starts, sl.start, side="right")) - 1
                for li in range(first, L):
                    a, b, weight = segs[li]
                    lo, hi = max(a, sl.start), min(b, sl.stop)
                    if lo >= hi:
                        break
                    B = X[:, lo:hi]
                    if weight and self.sparsity > 0:
                        B = np.where(np.abs(B) > (thr if thr is not None else tau[:, None]), B, 0)
                    B64 = B.astype(np.float64)
                    sq[li] += np.einsum("ij,ij->i", B64, B64)
                    pos, neg = (B > 0).sum(axis=1), (B < 0).sum(axis=1)
                    sg[li] += pos - neg
                    nz[li] += pos + neg
            return sq, sg, nz

        parts = map_blocks(task, d, block_width(n, X.itemsize, 4 * BLOCK_BYTES))
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    def select(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """((L, n) bool kept per layer, (n,) clipping factors, the layers)."""
        n, d = X.shape
        segs = self.segments(d)
        norms = np.sqrt(row_stats(X)[0])
        med = float(np.median(norms))
        factor = np.divide(np.minimum(norms, med), norms, out=np.ones(n), where=norms > 0)
        sq, sg, nz = self.layer_stats(X, segs, self.thresholds(X, segs))
        kept = np.zeros((len(segs), n), bool)
        with np.errstate(divide="ignore", invalid="ignore"):
            balance = 0.5 * sg / nz * (1 - self.sparsity)
        for li in range(len(segs)):
            k = median_z_keep(np.sqrt(sq[li]), self.norm_bound) & median_z_keep(balance[li], self.sign_bound)
            kept[li] = k if k.any() else True
        return kept, factor, segs

    def _aggregate(self, X, state, reference, rng):
        n, d = X.shape
        kept, factor, segs = self.select(X)
        W = (kept * factor) / kept.sum(axis=1, keepdims=True)
        out = np.empty(d, X.dtype)
        starts = np.array([a for a, _, _ in segs])
        Wx = W.astype(X.dtype)

        def task(sls):
            for sl in sls:
                first = int(np.searchsorted(starts, sl.start, side="right")) - 1
                for li in range(first, len(segs)):
                    lo, hi = max(segs[li][0], sl.start), min(segs[li][1], sl.stop)
                    if lo >= hi:
                        break
                    out[lo:hi] = np.dot(Wx[li], X[:, lo:hi])

        map_blocks(task, d, block_width(n, X.itemsize, 4 * BLOCK_BYTES))
        return AggregateResult(out, kept.mean(axis=0))
