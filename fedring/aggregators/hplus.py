"""H+: similarity-aware selection on random segments (Zuo, Fan, Zhan, Zhao, Xu, Hu, arXiv:2509.24330, 2025)."""

from __future__ import annotations

import numpy as np

from fedring.arrays import array_namespace, host
from fedring.errors import ConfigError
from fedring.validate import choice, integer, real

from ._kernels import combine
from .base import AGGREGATORS, AggregateResult, Aggregator, register


def similarity_h(x: np.ndarray, Y: np.ndarray) -> np.ndarray:
    r"""The similarity check H(X, Y) of Eq. (10), reference first: :math:`\frac1r \sum_i \frac{|x_i|}{|y_i - x_i| + |x_i|}`.

    Y is one vector or a matrix of rows. The paper leaves 0/0 (x_i = y_i = 0) undefined; such a
    term counts as 1, since the two vectors agree there and 1 is the limit along y = x.
    H(x, 0) = 1/2 and H(x, -x) = 1/3 for x without zero coordinates:

    >>> similarity_h(np.array([1., 2.]), np.array([[0., 0.], [-1., -2.], [1., 2.]]))
    array([0.5       , 0.33333333, 1.        ])
    """
    x = np.asarray(x, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    num = np.abs(x)
    den = np.abs(Y - x) + num
    terms = np.divide(num, den, out=np.ones(np.broadcast_shapes(num.shape, den.shape)), where=den > 0)
    return terms.mean(axis=-1)


def anomaly_scores(ref_seg: np.ndarray, segs: np.ndarray, rho: float, tau: float) -> np.ndarray:
    r"""Eq. (13): :math:`H(\{g\}_r, \{g_m\}_r) - \rho \max(\|\{g_m\}_r\|, \tau / \|\{g_m\}_r\|)`; -inf for a zero segment."""
    norms = np.sqrt(np.einsum("mr,mr->m", segs.astype(np.float64), segs.astype(np.float64)))
    with np.errstate(divide="ignore"):
        penalty = np.where(norms > 0, np.maximum(norms, tau / np.where(norms > 0, norms, 1.0)), np.inf)
    return similarity_h(ref_seg, segs) - rho * penalty


@register
class HPlus(Aggregator):
    r"""H+ (paper Sec. 4; Algorithms 1-2 of its Appendix C). Equations and choices: docs/hplus.md.

    In each of K repetitions, draw r coordinates, score every client by Eq. (13) against the
    reference vector g on those coordinates and keep the N best (Eq. 14, ties to the lower
    index). The output is the mean of the clients kept in all K repetitions (Eq. 15; uniform
    weights, since self-reported data sizes are not trusted). The reference only selects:
    it is not averaged in, since Eq. (14) ranks the uploaded vectors only and Eqs. (15),
    (18) and (19) average the selected uploads.

    Reference vector (Eq. 12 / Eq. 17):

    - ``mode="base"``: g = AGG(g_1..g_M) with the rule ``base`` (any registered rule except
      hplus; its state is H+'s state). "H+Median", "H+Krum", ...
    - ``mode="clean"``: g = the server's gradient on its clean data, passed as ``reference``
      ("H+Clean data"; the clean set's size is the loop's ``server_samples``).

    If the intersection is empty (a case the paper does not cover) the round returns the
    reference vector, the robust estimate at hand, and every client's ``selected`` is 0.

    Parameters
    ----------
    base : str
        Rule giving the reference in base mode (``median``). Its parameters are its own
        settings section (``[krum]``), passed in ``sections`` (fedring does that):
        ``make_aggregator("hplus", f, {"base": "krum"}, sections={"krum": {"variant": "byzfl"}})``.
    mode : {"base", "clean"}
    K : int
        Repetitions (3).
    r : int
        Segment length (50; capped at d).
    N : int or None
        Clients kept per repetition; default M - f (the paper's N = M - B).
    rho, tau : float
        Penalty weight and scale. The paper uses (0.1, 100) on CIFAR-10 (the defaults here)
        and (10, 0.1) on Tiny-ImageNet and CIFAR-100.
    segments : {"random_coords", "contiguous"}
        "random_coords": K disjoint random sets of r coordinates, drawn in O(K r) (disjoint
        when K r <= d); "contiguous": K slices of r coordinates at uniform random starts. The
        paper's wording ("randomly partitioned", "slicing") fits both.

    selected: 1 for the clients in the final intersection.
    """

    name = "hplus"
    selects = True

    def __init__(
        self,
        f: int = 0,
        *,
        base: str = "median",
        mode: str = "base",
        K: int = 3,
        r: int = 50,
        N: int | None = None,
        rho: float = 0.1,
        tau: float = 100.0,
        segments: str = "random_coords",
        sections: dict | None = None,
    ):
        super().__init__(f)
        self.mode = choice("hplus.mode", mode, ("base", "clean"))
        # a rule that inspects the model reads whole rows, not H+'s segments of them
        allowed = tuple(sorted(k for k in AGGREGATORS if k != "hplus" and not AGGREGATORS[k].needs_probe))
        self.base = choice("hplus.base", base, allowed)
        self.K = integer("hplus.K", K, lo=1)
        self.r = integer("hplus.r", r, lo=1)
        self.N = None if N is None else integer("hplus.N", N, lo=1)
        self.rho = real("hplus.rho", rho, lo=0.0)
        self.tau = real("hplus.tau", tau, lo=0.0)
        self.segments = choice("hplus.segments", segments, ("random_coords", "contiguous"))
        base_params = (sections or {}).get(self.base)
        if base_params is not None and not isinstance(base_params, dict):
            raise ConfigError(self.base, f"parameters of hplus's base rule must be a table, got {base_params!r}")
        self.base_rule = AGGREGATORS.build(self.base, base_params, f=f) if self.mode == "base" else None
        self.needs_reference = self.mode == "clean" or bool(self.base_rule and self.base_rule.needs_reference)
        self.on_device = self.base_rule is None or self.base_rule.on_device

    def keep_count(self, n: int) -> int:
        return n - self.f if self.N is None else self.N

    def check(self, n):
        k = self.keep_count(n)
        if not 1 <= k <= n:
            return f"hplus keeps N={k} clients per repetition, needs 1 <= N <= n={n} (N defaults to n - f)"
        if self.base_rule is not None:
            reason = self.base_rule.check(n)
            if reason is not None:
                return f"base rule of hplus: {reason}"
        return super().check(n)

    def init_state(self, n, d):
        return self.base_rule.init_state(n, d) if self.base_rule is not None else {}

    def reads(self):
        return (self.name, self.base) if self.base_rule is not None else (self.name,)

    def with_f(self, f):
        other = super().with_f(f)
        if other is not self and self.base_rule is not None:
            other.base_rule = self.base_rule.with_f(f)
        return other

    def draw_segments(self, d: int, rng: np.random.Generator) -> list[np.ndarray]:
        r = min(self.r, d)
        if self.segments == "contiguous":
            starts = rng.integers(0, d - r + 1, size=self.K)
            return [np.arange(s, s + r) for s in starts]
        if self.K * r <= d:
            idx = rng.choice(d, size=self.K * r, replace=False)
            return [idx[k * r : (k + 1) * r] for k in range(self.K)]
        return [rng.choice(d, size=r, replace=False) for _ in range(self.K)]

    def _aggregate(self, X, state, reference, rng):
        n, d = X.shape
        if self.mode == "base":
            ref = self.base_rule.aggregate(X, state=state, reference=reference, rng=rng).vector
        else:
            ref = reference
        keep = self.keep_count(n)
        selected = np.ones(n, bool)
        for idx in self.draw_segments(d, rng):  # each segment's r values per client go to the host
            score = anomaly_scores(host(ref[idx]), host(X[:, idx]), self.rho, self.tau)
            top = np.argsort(-score, kind="stable")[:keep]
            mask = np.zeros(n, bool)
            mask[top] = True
            selected &= mask
        if not selected.any():
            return AggregateResult(array_namespace(X).asarray(ref, dtype=X.dtype, copy=True), np.zeros(n))
        return AggregateResult(combine(selected, X) / selected.sum(), selected.astype(float))
