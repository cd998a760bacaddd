"""Per-client state that lives beside the shared model: rows of this rank's clients.

A rank holds one row per local client (client momentum, BatchNorm statistics kept per client), so
memory is O(local clients x row) per rank, rank 0 included: a checkpoint writes every client's
momentum rows one rank's block at a time (:func:`checkpoint_rows`), and ``--resume`` reads each
rank's block from the file and sends it there (:func:`rows_from_file`). BatchNorm rows are small and
simply gathered. These messages are outside the protocol's counted traffic, like the checkpoint.

:class:`ModelBuffers` keeps a model's buffers (BatchNorm running statistics), which are not
parameters: the flat vector the protocols move does not hold them (``docs/training.md``).
"""

from __future__ import annotations

import h5py
import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from fedring import names
from fedring.arrays import host
from fedring.comm import Layout

BN_STATS = ("aggregate", "local")


def _counts(layout: Layout, width: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.diff(layout.bounds) * width
    return counts, np.concatenate([[0], np.cumsum(counts)[:-1]])


def checkpoint_rows(comm: MPI.Comm, layout: Layout, local: np.ndarray | torch.Tensor) -> CheckpointRows | None:
    """Collective: every client's rows as a checkpoint array on rank 0 (:class:`CheckpointRows`); the
    other ranks send their block, which rank 0 receives when it writes, and get None. Rows on a
    device are copied to host memory first."""
    local = host(local)
    if layout.rank != 0:
        comm.Send(np.ascontiguousarray(local), dest=0)
        return None
    return CheckpointRows(comm, layout, local)


class CheckpointRows:
    """Every client's rows ``(n_clients, ...)`` as a checkpoint array that rank 0 writes block by block:
    :meth:`fedring.results.ResultsFile.write_checkpoint` asks it to :meth:`write_into` the dataset, and
    it receives each rank's block in turn."""

    def __init__(self, comm: MPI.Comm, layout: Layout, local: np.ndarray):
        self.comm, self.layout, self.local = comm, layout, np.ascontiguousarray(local)
        self.shape, self.dtype = (layout.n_clients, *local.shape[1:]), local.dtype
        self.nbytes = int(np.prod(self.shape)) * local.itemsize

    def write_into(self, ds: h5py.Dataset) -> None:
        bounds = self.layout.bounds
        for r in range(self.layout.size):
            block = self.local
            if r:
                block = np.empty((bounds[r + 1] - bounds[r], *self.shape[1:]), self.dtype)
                self.comm.Recv(block, source=r)
            ds[bounds[r] : bounds[r + 1]] = block


def rows_from_file(comm: MPI.Comm, layout: Layout, path: str | None, name: str, out: np.ndarray | torch.Tensor) -> None:
    """Collective: this rank's block of the current checkpoint's ``name`` into ``out``; rank 0 reads
    each rank's block from the file ``path`` in turn and sends it, never holding more than one block.
    Rows on a device are read into host memory and copied there."""
    if isinstance(out, torch.Tensor):
        host = torch.empty(out.shape, dtype=out.dtype)
        rows_from_file(comm, layout, path, name, host.numpy())
        out.copy_(host)
        return
    if layout.rank != 0:
        comm.Recv(out, source=0)
        return
    assert path is not None, "rank 0 resumes from the run's file"
    with h5py.File(path, "r") as f:
        slots = f[names.CHECKPOINT]
        ds = slots[slots.attrs["current"]][name]
        for r in range(layout.size - 1, -1, -1):
            block = np.ascontiguousarray(ds[layout.bounds[r] : layout.bounds[r + 1]], out.dtype)
            if r:
                comm.Send(block, dest=r)
            else:
                out[:] = block


def gather_rows(layout: Layout, local: np.ndarray) -> np.ndarray | None:
    """This rank's rows ``(n_local, ...)`` -> every client's rows ``(n_clients, ...)`` on rank 0, None elsewhere
    (for small rows: rank 0 holds them all)."""
    width = int(np.prod(local.shape[1:]))
    out = np.empty((layout.n_clients, *local.shape[1:]), local.dtype) if layout.rank == 0 else None
    counts, displs = _counts(layout, width)
    recv = [out, counts, displs, MPI._typedict[local.dtype.char]] if layout.rank == 0 else None
    layout.comm.Gatherv(np.ascontiguousarray(local), recv, root=0)
    return out


def scatter_rows(layout: Layout, rows: np.ndarray | None, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Rank 0's ``(n_clients, *shape)`` rows -> this rank's ``(n_local, *shape)``."""
    width = int(np.prod(shape))
    out = np.empty((layout.n_local, *shape), dtype)
    counts, displs = _counts(layout, width)
    send = (
        [np.ascontiguousarray(rows, dtype), counts, displs, MPI._typedict[out.dtype.char]] if layout.rank == 0 else None
    )
    layout.comm.Scatterv(send, out, root=0)
    return out


def allgather_rows(layout: Layout, local: np.ndarray) -> np.ndarray:
    """Every client's rows on every rank, in client order."""
    width = int(np.prod(local.shape[1:]))
    out = np.empty((layout.n_clients, *local.shape[1:]), local.dtype)
    counts, displs = _counts(layout, width)
    layout.comm.Allgatherv(np.ascontiguousarray(local), [out, counts, displs, MPI._typedict[local.dtype.char]])
    return out


class ModelBuffers:
    """A model's buffers as one float64 vector, with ``bn_stats`` deciding whose statistics a client uses.

    * ``aggregate`` (default): every client starts its local training from the shared statistics;
      after the round the shared statistics are the mean over all clients of theirs (the FedAvg of
      the model's state, as the buffers are averaged by FedAvg implementations), summed in client
      order in float64, so the result is the same on any number of ranks. Evaluation uses them.
    * ``local``: each client keeps its own statistics (FedBN, Li et al., ICLR 2021), trains and
      evaluates its test slice with them; nothing is exchanged.

    Integer buffers (``num_batches_tracked``) are averaged and rounded. Float32 buffers are exact in
    float64. A model without buffers makes every method a no-op (no communication).

    ``on_device`` (the device path): the clients' ``rows`` are a float64 tensor on the buffers'
    device and the shared vector has a copy there, so that a client's :meth:`use` and :meth:`keep`
    are copies on the device; each would otherwise move every buffer across the bus and wait for
    the device, twice per client and round. The mean of :meth:`aggregate` stays the host's (the
    rows cross once a round), so both paths give the same bits.
    """

    def __init__(self, model: nn.Module, mode: str, layout: Layout, on_device: bool = False):
        self.tensors = list(model.buffers())
        self.mode, self.layout = mode, layout
        self.on_device = on_device and bool(self.tensors)
        self.shared = self.host_read()
        self.rows = self.placed(np.tile(self.shared, (layout.n_local, 1)))
        self.shared_placed = self.placed(self.shared)

    @property
    def size(self) -> int:
        return self.shared.size

    def placed(self, vec: np.ndarray):
        """A host array where this object keeps its vectors: itself, or a copy on the buffers' device."""
        return torch.tensor(vec, device=self.tensors[0].device) if self.on_device else vec

    def host_read(self) -> np.ndarray:
        if not self.tensors:
            return np.zeros(0)
        return np.concatenate([b.detach().cpu().numpy().astype(np.float64).reshape(-1) for b in self.tensors])

    def read(self):
        """The buffers as one float64 vector: on their device on the device path."""
        if not self.on_device:
            return self.host_read()
        return torch.cat([b.detach().reshape(-1).to(torch.float64) for b in self.tensors])

    def write(self, vec) -> None:
        """Load the float64 vector ``vec`` (numpy, or a tensor on the buffers' device) into the buffers,
        integer buffers rounded half to even (``numpy.rint``, ``torch.round``)."""
        k = 0
        with torch.no_grad():
            for b in self.tensors:
                part = vec[k : k + b.numel()].reshape(b.shape)
                if isinstance(part, np.ndarray):
                    part = torch.from_numpy(np.asarray(part if b.is_floating_point() else np.rint(part)))
                elif not b.is_floating_point():
                    part = torch.round(part)
                b.copy_(part)
                k += b.numel()

    def use(self, k: int) -> None:
        """Load the statistics local client ``k`` trains or is evaluated with."""
        if self.size:
            self.write(self.rows[k] if self.mode == "local" else self.shared_placed)

    def keep(self, k: int) -> None:
        """Store local client ``k``'s statistics after its local training."""
        if self.size:
            self.rows[k] = self.read()

    def aggregate(self, member: np.ndarray | None = None) -> None:
        """End of a round: the shared statistics become the mean over the clients, or over the round's
        cohort (``member``: a ``(n_clients,)`` bool mask; ``aggregate`` mode)."""
        if self.size and self.mode == "aggregate":
            rows = allgather_rows(self.layout, host(self.rows))
            if member is None:
                self.shared = rows.sum(axis=0) / self.layout.n_clients
            else:
                self.shared = rows[member].sum(axis=0) / member.sum()
            self.shared_placed = self.placed(self.shared)
            self.write(self.shared_placed)

    def checkpoint(self) -> dict[str, np.ndarray | None]:
        """Collective: the arrays a checkpoint stores (on rank 0); every client's rows with ``local``, which
        are small (a few numbers per channel)."""
        if not self.size:
            return {}
        if self.mode == "aggregate":
            return {"buffers": self.shared}
        return {"buffers": gather_rows(self.layout, host(self.rows))}

    def restore(self, buffers: np.ndarray | None) -> None:
        """Collective: load a checkpoint's ``buffers`` (rank 0's copy; the shared vector is on every rank)."""
        if not self.size:
            return
        if self.mode == "aggregate":
            self.shared = np.array(buffers, np.float64) if self.layout.rank == 0 else np.empty(self.size)
            self.layout.comm.Bcast(self.shared, root=0)
            self.shared_placed = self.placed(self.shared)
            self.write(self.shared_placed)
        else:
            self.rows = self.placed(scatter_rows(self.layout, buffers, (self.size,), np.float64))
