"""The communication layer: logical clients on MPI ranks, every payload byte counted.

- :mod:`fedring.comm.network`: which rank hosts which clients (:class:`Layout`), the byte
  :class:`Ledger`, and :class:`Network`, which moves numpy buffers between clients (a memory
  copy on one rank, mpi4py buffer messages between ranks).
- :mod:`fedring.comm.ring`: ring-all-reduce from point-to-point messages (reduce-scatter,
  then all-gather).
- :mod:`fedring.comm.brace`: BRACE and the sign-voting rules over the same ring.

Imports no torch.
"""

from . import brace  # noqa: F401  (registers BRACE, signSGD and RLR as ring rules)
from .network import SIDE_CHANNELS, Layout, Ledger, Network, block_bounds
from .ring import RING_RULES, all_gather, reduce_scatter, ring_allreduce

__all__ = [
    "RING_RULES",
    "SIDE_CHANNELS",
    "Layout",
    "Ledger",
    "Network",
    "all_gather",
    "block_bounds",
    "reduce_scatter",
    "ring_allreduce",
]
