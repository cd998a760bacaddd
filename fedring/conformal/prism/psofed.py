"""PSO-Fed training with Byzantine uplink noise (paper Sec. II-B, II-C), over
:class:`fedring.comm.Network`.

Online LMS on ``y = w*^T x + nu`` (eq. 1). Every iteration the server samples ``|S_n|``
clients; each downloads the ``M`` global coordinates its selection mask ``S_{k,n-1}`` picks,
takes one LMS step on its streaming sample, and uploads the ``M`` coordinates a fresh mask
``S_{k,n}`` picks; a Byzantine client adds ``tau * delta``, ``tau ~ Bernoulli(p_a)``,
``delta ~ N(0, sigma_B^2 I)``, to what it sends. Only the ``M`` values travel (server and
client derive the masks from the same seed), so the ledger measures ``M/D`` of full
sharing's bytes. The server is rank 0; every message goes through the network (a memory
copy for a client on the server's rank), which counts its bytes.

Choices the paper leaves open (``docs/prism-fcp.md``): masks are independent uniform
``M``-subsets, drawn for every client at every iteration, so that a client sampled at
iteration ``n`` has the ``S_{k,n-1}`` its download needs even if it was not sampled at
``n - 1``; ``w_0 = w_{k,0} = 0``; whether clients outside ``S_n`` keep learning
(``local_updates``) and how much of its own corruption a Byzantine client keeps
(``byz_persist``) are settings, chosen by the run's profile.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from fedring.comm import Network
from fedring.rng import Stream, generator

from .environment import Environment
from .settings import ResolvedPrism


def selection_masks(rng: np.random.Generator, n: int, dim: int, shared: int, scheme: str = "random") -> np.ndarray:
    """Index form of ``n`` selection matrices ``S`` (diagonal 0/1, ``M`` ones), ``(n, M)``.

    ``random``: independent uniform ``M``-subsets (the paper's assumption); masks for
    different ``M`` drawn from the same generator state are nested. ``roundrobin`` (original
    PSO-Fed): ``S_{n+1}`` is ``S_n`` shifted by ``M`` coordinates from a random start.

    >>> selection_masks(np.random.default_rng(0), 3, 5, 2, "roundrobin").tolist()
    [[0, 4], [1, 2], [3, 4]]
    """
    if shared == dim:
        return np.broadcast_to(np.arange(dim, dtype=np.intp), (n, dim))
    if scheme == "roundrobin":
        start = int(rng.integers(dim))
        return np.sort((start + shared * np.arange(n)[:, None] + np.arange(shared)) % dim, axis=1)
    u = rng.random((n, dim))
    return np.sort(np.argpartition(u, shared - 1, axis=1)[:, :shared], axis=1)


def participants(s: ResolvedPrism, seed: int, trial: int) -> np.ndarray:
    """``S_n`` for n = 1..N_iter, ``(N_iter, |S_n|)`` sorted client indices (the server's draws)."""
    rng = generator(seed, Stream.PRISM_PARTICIPANTS, step=trial)
    u = rng.random((s.iterations, s.clients))
    p = s.participants
    return np.sort(np.argpartition(u, p - 1, axis=1)[:, :p], axis=1)


def client_masks(s: ResolvedPrism, seed: int, trial: int, clients, shared: int) -> np.ndarray:
    """Time-major masks ``(N_iter + 1, len(clients), M)``; row 0 is ``S_{k,0}``.

    A client's masks come from its own generator, so the server (which derives every
    client's masks) and the client's rank draw the same ones."""
    out = np.empty((s.iterations + 1, len(clients), shared), dtype=np.intp)
    for j, k in enumerate(clients):
        rng = generator(seed, Stream.PRISM_MASK, client=int(k), step=trial)
        out[:, j] = selection_masks(rng, s.iterations + 1, s.dim, shared, s.mask_scheme)
    return out


class UplinkNoise:
    """The training attack's draws of the hosted Byzantine clients (Sec. II-C): ``tau``
    ``(N_iter, n_local)`` and ``delta[slot[j]]`` ``(N_iter, D)`` for hosted client ``j``,
    independent of the data and the masks."""

    def __init__(self, s: ResolvedPrism, seed: int, trial: int, env: Environment):
        nl = env.hi - env.lo
        self.slot = np.full(nl, -1)
        self.tau = np.zeros((s.iterations, nl), dtype=bool)
        local_byz = np.flatnonzero(env.is_byzantine[env.lo : env.hi])
        self.delta = np.empty((local_byz.size, s.iterations, s.dim))
        sd = math.sqrt(s.attack_var)
        for slot, j in enumerate(local_byz):
            rng = generator(seed, Stream.PRISM_TRAIN_ATTACK, client=env.lo + int(j), step=trial)
            self.slot[j] = slot
            self.tau[:, j] = rng.random(s.iterations) < s.attack_prob
            self.delta[slot] = sd * rng.standard_normal((s.iterations, s.dim))


@dataclass
class TrainResult:
    w: np.ndarray | None  # final global model w_{N_iter} (server rank only)
    bytes_up: int  # uplink payload bytes of this rank's clients
    bytes_down: int  # server's downlink payload bytes (0 off the server rank)
    seconds: float


def sent_bytes(net: Network) -> tuple[int, int]:
    """This rank's (client bytes, server bytes) so far, all protocol phases."""
    return int(net.ledger.client_bytes().sum()), net.ledger.server_bytes()


def train_psofed(
    s: ResolvedPrism,
    env: Environment,
    shared: int,
    net: Network,
    seed: int,
    trial: int,
    parts: np.ndarray | None = None,
) -> TrainResult:
    """PSO-Fed with Byzantine uplink noise (Sec. II-B, II-C); returns ``w_{N_iter}`` on rank 0.

    Per iteration n, for ``k in S_n``: download ``S_{k,n-1} w_{n-1}`` (M values), then

        eps_{k,n} = y_{k,n} - [S_{k,n-1} w_{n-1} + (I - S_{k,n-1}) w_{k,n-1}]^T x_{k,n}
        w_{k,n}   = S_{k,n-1} w_{n-1} + (I - S_{k,n-1}) w_{k,n-1} + mu x_{k,n} eps_{k,n}

    (with ``local_updates``, clients outside ``S_n`` take the same step from their own
    model), upload ``S_{k,n}(w_{k,n} + beta_k tau_{k,n} delta_{k,n})`` (M values), and the
    server sets

        w_n = (1/|S_n|) sum_{k in S_n} [S_{k,n} w_{k,n} + (I - S_{k,n}) w_{n-1}]

    with the received values in place of ``S_{k,n} w_{k,n}``. ``byz_persist``: the
    attacker's own model stays clean (``none``), keeps the corrupted shared coordinates
    (``sent``), or adds the whole ``delta`` (``full``). Returns ``w`` on rank 0 only (None
    elsewhere) and this rank's share of the bytes (phases ``train_down``, ``train_up``).
    """
    t0 = time.perf_counter()
    lo, hi, D, P, mu = env.lo, env.hi, s.dim, s.participants, s.step
    parts = participants(s, seed, trial) if parts is None else parts
    server = net.layout.rank == 0
    masks_all = client_masks(s, seed, trial, range(s.clients), shared) if server else None  # the server's
    masks = masks_all[:, lo:hi] if masks_all is not None else client_masks(s, seed, trial, range(lo, hi), shared)
    noise = UplinkNoise(s, seed, trial, env)
    w_loc = np.zeros((hi - lo, D))
    w_glob = np.zeros(D)
    up_before, down_before = sent_bytes(net)
    rows_all = np.arange(P)[:, None]
    for i in range(s.iterations):
        part = parts[i]
        a, b = np.searchsorted(part, (lo, hi))
        rows = part[a:b] - lo
        down = w_glob[masks_all[i, part]] if masks_all is not None else None
        down_loc = net.scatter_from_server(down, part, "train_down", (shared,), np.float64)
        if rows.size:
            w_loc[rows[:, None], masks[i, rows]] = down_loc
        if s.local_updates:
            x, y = env.x_train[i], env.y_train[i]
            eps = y - (w_loc * x).sum(axis=1)
            w_loc += (mu * eps)[:, None] * x
        elif rows.size:
            x, y = env.x_train[i, rows], env.y_train[i, rows]
            eps = y - (w_loc[rows] * x).sum(axis=1)
            w_loc[rows] += (mu * eps)[:, None] * x
        up_idx = masks[i + 1, rows]
        sent = np.take_along_axis(w_loc[rows], up_idx, axis=1)
        hit = noise.tau[i, rows]
        if hit.any():
            r = rows[hit]
            delta = noise.delta[noise.slot[r], i]
            sent[hit] += np.take_along_axis(delta, up_idx[hit], axis=1)
            if s.byz_persist == "full":
                w_loc[r] += delta
            elif s.byz_persist == "sent":
                w_loc[r[:, None], up_idx[hit]] = sent[hit]
        up = net.gather_to_server(sent, "train_up", clients=part)
        if masks_all is not None:
            full = np.tile(w_glob, (P, 1))
            full[rows_all, masks_all[i + 1, part]] = up
            w_glob = full.sum(axis=0) / P
    up_after, down_after = sent_bytes(net)
    return TrainResult(
        w_glob if server else None, up_after - up_before, down_after - down_before, time.perf_counter() - t0
    )
