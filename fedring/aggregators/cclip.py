"""Centered clipping (Karimireddy, He, Jaggi, ICML 2021) with random (Karimireddy et al., ICLR 2022)
and sequential (Özfatura et al., IEEE TIFS 2023; FedSECA Supp. E.7) bucketing."""

from __future__ import annotations

import math

import numpy as np

from fedring.arrays import host, like, on_host
from fedring.validate import choice, integer, real

from ._kernels import combine, gram, small, sqnorm
from .base import AggregateResult, GramRule, register


def _clip_factors(dist2: np.ndarray, tau: float) -> np.ndarray:
    """min(1, tau / ||g - v||), with factor 1 where g = v (the term is zero anyway)."""
    dist = np.sqrt(dist2)
    return np.minimum(1.0, np.divide(tau, dist, out=np.ones_like(dist), where=dist > 0))


@register
class CenteredClipping(GramRule):
    r"""Centered clipping around the previous aggregate, optionally after bucketing.

    CClip_Q (FedSECA Supp. E.5, Eq. 26; the printed reference g^(t+1) is a typo for the
    previous round's aggregate g^(t-1), which the text names as the reference):

    .. math::
        v^{(q)} = v^{(q-1)} + \frac1K \sum_k (g_k - v^{(q-1)}) \min\Big(1, \frac{\tau}{\|g_k - v^{(q-1)}\|}\Big),
        \quad v^{(0)} = \tilde g^{(t-1)} \ (0 \text{ at } t = 1)

    ``bucketing="random"`` (CC-RandBucket, Eq. 27): shuffle the clients, average buckets of
    S (the last bucket over its actual members, as the code does: the printed 1/S would halve
    a one-client bucket), then CClip_Q over the L = ceil(K/S)
    bucket means. ``bucketing="sequential"`` (CC-SeqBucket, Eq. 28): sort the clients by
    cosine to the previous aggregate (identity order while it is 0), cut the sorted list
    into S groups of R = ceil(K/S), shuffle inside each group (as the code does), bucket r
    takes the r-th member of every group, and CClip_1 runs bucket after bucket, each
    starting from the previous bucket's output.

    Everything lives in the span of the clients and the previous aggregate, so one Gram pass
    gives every distance and cosine; only the result is materialised. On a device (rows as a
    tensor), random bucketing first makes the L bucket means (one product) and takes the Gram
    pass over those: its arithmetic grows as the square of the rows, so L = n / 2 costs a
    quarter of n's; on the host the Gram pass of the clients' rows keeps its results' bits.

    Parameters
    ----------
    tau : float
        Clipping radius (100, FedSECA Supp. E.5-E.7; the H+ paper gives none for its CClip).
    iters : int or None
        Clipping iterations Q: default 3 without bucketing, 1 with (FedSECA Supp. E.5-E.7).
    bucketing : {"none", "random", "sequential"}
    bucket_size : int
        S, vectors per bucket (2).

    State: ``center``, the previous aggregate in float64 (zeros at the first round). On a device
    it moves there on the first round and stays, as a float64 tensor (a checkpoint stores a host
    copy): each round would otherwise move it across the bus, cast on the host, and back.
    selected: each client's last clipping factor min(1, tau / distance) (its bucket's with bucketing).

    Example
    -------
    With a radius larger than every distance, one iteration from 0 gives the mean:

    >>> CenteredClipping(tau=1e3, iters=1)(np.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]]))
    array([4., 5., 6.])
    """

    name = "cclip"
    selects = True
    on_device = True

    def __init__(
        self, f: int = 0, *, tau: float = 100.0, iters: int | None = None, bucketing: str = "none", bucket_size: int = 2
    ):
        super().__init__(f)
        self.tau = real("cclip.tau", tau, lo=0.0, lo_open=True)
        self.bucketing = choice("cclip.bucketing", bucketing, ("none", "random", "sequential"))
        self.iters = (3 if bucketing == "none" else 1) if iters is None else integer("cclip.iters", iters, lo=1)
        self.bucket_size = integer("cclip.bucket_size", bucket_size, lo=1)

    def init_state(self, n, d):
        return {"center": np.zeros(d)}

    def first_gram(self, X, state, reference):
        center = state["center"]
        if on_host(center) != on_host(X):  # the first round on a device: the center moves there
            center = state["center"] = host(center) if on_host(X) else like(center, X)
        if self.bucketing == "random" and not on_host(X):  # the bucket means' first
            return None
        return gram(X, center[None, :])

    def _aggregate_gram(self, X, G, state, reference, rng):
        n = X.shape[0]
        center = state["center"]
        w = np.zeros(n + 1)
        w[n] = 1.0  # v = previous aggregate
        client_factor = np.ones(n)
        rows = X  # the rows of the iterates' span (with the center)
        if self.bucketing == "sequential":
            w = self._sequential(G, n, w, client_factor, rng, math.sqrt(sqnorm(center)))
        else:
            if self.bucketing == "random":
                perm = rng.permutation(n)
                buckets = [perm[s : s + self.bucket_size] for s in range(0, n, self.bucket_size)]
            else:
                buckets = [np.array([i]) for i in range(n)]
            U = np.zeros((len(buckets), n + 1))
            for b, members in enumerate(buckets):
                U[b, members] = 1.0 / len(members)
            if self.bucketing == "random" and not on_host(X):  # the bucket means, once (class docstring)
                k = len(buckets)
                rows, U, w = combine(U[:, :n], X), np.eye(k, k + 1), np.eye(1, k + 1, k)[0]
                G = gram(rows, center[None, :])
            for _ in range(self.iters):
                c = _clip_factors(G.dist2_between(U, np.broadcast_to(w, U.shape)), self.tau)
                w = w * (1.0 - c.mean()) + (c / len(buckets)) @ U
            for b, members in enumerate(buckets):
                client_factor[members] = c[b]
        out = combine(w, rows, small(center[None, :], rows))
        center[...] = out
        return AggregateResult(out, client_factor)

    def _sequential(self, G, n, w, client_factor, rng, prev_norm):
        S = self.bucket_size
        R = math.ceil(n / S)
        if prev_norm > 0:
            inner = G.inner()
            norms = np.sqrt(np.maximum(np.diag(inner)[:n], 0.0))
            cos = inner[:n, n] / (np.where(norms > 0, norms, 1.0) * prev_norm)
            order = np.argsort(cos, kind="stable")
        else:
            order = np.arange(n)
        groups = [rng.permutation(order[R * s : R * (s + 1)]) for s in range(S) if R * s < n]
        for r in range(R):
            members = np.array([g[r] for g in groups if r < len(g)])
            rows = np.zeros((len(members), n + 1))
            rows[np.arange(len(members)), members] = 1.0
            for _ in range(self.iters):
                c = _clip_factors(G.dist2_between(rows, np.broadcast_to(w, rows.shape)), self.tau)
                w = w * (1.0 - c.mean()) + (c / len(members)) @ rows
            client_factor[members] = c
        return w
