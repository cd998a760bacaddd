"""Algorithm 1 of Plassier et al. (ICML 2023), DP-FedAvgQE: the federated smoothed quantile.

Each agent holds a local measure (eq. 14); the server holds the mixture weights ``lambda`` that
make the agents' local losses (eq. 19) sum to the global smoothed loss (eq. 13). Per round the
server broadcasts its quantile ``q_t``, every agent runs ``K`` noisy gradient steps on its local
loss (eq. 15) and sends back its change ``Delta q`` and the mean of its iterates ``Delta qbar``;
the server moves ``q`` by the ``lambda``-weighted changes and averages the ``Delta qbar`` over
the rounds (eq. 16). The messages go through a :class:`fedring.comm.Network`, so every byte is
counted in its ledger (phase ``labelshift/fedavgqe``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from fedring.comm import Layout, Network

from .quantiles import AtomRows


def fedavgqe_local_round(
    q: np.ndarray, rows: AtomRows, local_steps: int, eta: float, noise: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One round of Algorithm 1 on the agents' side, for ``A`` agents and ``Q`` queries at once.

    ``rows`` holds ``A * Q`` local measures, agent-major; ``q`` (Q,) is the server's quantile.
    For ``k = 0..K-1``: ``g = grad S^{i,gamma}_alpha(q_k) + z_k`` (eq. 15, ``noise[k]`` already
    scaled by ``sigma_g``), ``q_{k+1} = q_k - eta g``. Returns ``(Delta q, Delta qbar)``, both
    ``(A, Q)``: ``q_K - q_0`` and ``(1/K) sum_{k=1..K} q_k``. The paper's box of Algorithm 1
    averages over ``k in [K] = {1..K}`` while its proof averages ``k = 0..K-1``; the box is
    followed (``docs/labelshift.md``).
    """
    n_q = q.shape[0]
    x = np.tile(q, (rows.n_rows // n_q, 1))
    acc = np.zeros_like(x)
    for k in range(local_steps):
        g = rows.grad(x.reshape(-1)).reshape(x.shape)
        if noise is not None:
            g += noise[k]
        x -= eta * g
        acc += x
    return x - q, acc / local_steps


def dp_fedavgqe(
    rows: AtomRows,
    lam: np.ndarray | None,
    *,
    q0: np.ndarray,
    rounds: int,
    local_steps: int,
    eta: float,
    noise: Callable[[int], np.ndarray] | None = None,
    participation: Callable[[int], np.ndarray] | None = None,
    net: Network | None = None,
    phase: str = "labelshift/fedavgqe",
) -> np.ndarray:
    """Algorithm 1 (DP-FedAvgQE): the federated smoothed quantile ``Qhat^gamma_{1-alpha,T}``.

    Runs ``Q`` independent instances (one per query label, trial, ...) in lock-step. Per round
    ``t``: the server broadcasts ``q_t``; each agent runs :func:`fedavgqe_local_round` on its
    local losses (eq. 19) and sends ``(Delta q, Delta qbar)``; the server updates

    .. math::
        q_{t+1} = q_t + \\frac{n}{|S_{t+1}|} \\sum_{i \\in S_{t+1}} \\lambda^i_y \\Delta q^i_{t+1},
        \\qquad \\hat Q = \\frac1T \\sum_{t=1}^T \\frac{n}{|S_t|} \\sum_{i \\in S_t} \\lambda^i_y \\Delta\\bar q^i_t

    (eq. 16). The main text writes the server update without ``lambda``; Algorithm 1 and the
    convergence analysis weigh the agents by ``lambda``, which is what makes the local losses
    add up to the global one, so ``lambda`` is applied.

    Parameters
    ----------
    rows : AtomRows
        This rank's agents' local measures, ``A * Q`` rows agent-major (each row normalised to
        mass 1, or 0 for an agent without mass for that query).
    lam : (n, Q) array on the server (rank 0), ignored elsewhere
        Mixture weights ``lambda^i_y``.
    q0 : (Q,) array
        Initial quantile (the protocol starts at ``1 - alpha``: the paper leaves ``q_0`` open).
    rounds, local_steps, eta : int, int, float
        ``T``, ``K`` and the step size (Theorem 4.1 wants ``eta <= gamma / 10``).
    noise : callable ``t -> (K, A, Q)`` or None
        Gradient noise ``z^i_{t,k}`` (already multiplied by ``sigma_g``) for round ``t``.
    participation : callable ``t -> (n, Q) bool`` or None (server only)
        Server's sampled agents ``S_{t+1}`` per instance; None is full participation, which
        the convergence theorems assume. All agents compute and send every round (the sample
        differs between instances); the server discards the agents it did not sample.
    net : fedring.comm.Network or None
        Message transport (this rank's agents are its layout's local clients). None runs all
        ``n = A`` agents in this process, over a network on ``MPI.COMM_SELF``.

    Returns
    -------
    (Q,) array on every rank.
    """
    n_q = int(np.asarray(q0).shape[0])
    own = net is None
    if net is None:
        net = Network(Layout(rows.n_rows // max(n_q, 1), MPI.COMM_SELF))
    try:
        server = net.layout.rank == 0
        q = np.asarray(q0, dtype=np.float64).copy()
        qbar_sum = np.zeros(n_q)
        for t in range(rounds):
            q = net.broadcast_from_server(q if server else None, phase, (n_q,), np.float64)
            dq, dqbar = fedavgqe_local_round(q, rows, local_steps, eta, None if noise is None else noise(t))
            both = net.gather_to_server(np.concatenate([dq, dqbar], axis=1), phase)
            if both is not None:  # on the server
                coef = np.asarray(lam, dtype=np.float64)
                if participation is not None:
                    mask = participation(t)
                    coef = coef * mask * (mask.shape[0] / np.maximum(mask.sum(axis=0), 1))
                q = q + (coef * both[:, :n_q]).sum(axis=0)
                qbar_sum += (coef * both[:, n_q:]).sum(axis=0)
        out = qbar_sum / rounds if server else None
        return net.broadcast_from_server(out, phase + "-result", (n_q,), np.float64)
    finally:
        if own:
            net.comm.Free()
