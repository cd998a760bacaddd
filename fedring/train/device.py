"""Where a rank's model, batches and gradients live: the ``device`` setting (docs/slurm.md, GPUs).

``cpu`` (the default) runs everything as before, bit for bit. ``cuda`` puts each rank on the
GPU of its node-local rank (MPI's shared-memory split) modulo the visible GPUs, so several
ranks may share one; ``CUDA_VISIBLE_DEVICES`` chooses which GPUs are visible. ``auto`` is
``cuda`` where a GPU is visible, else ``cpu``. On a GPU a client's whole update stays on it: the
flattened mini-batch gradients, clipping and weight decay, the local SGD steps, the
pseudo-gradient and the momentum, with the clients' optimizer rows (:mod:`fedring.train.optim`)
kept there as tensors (:class:`Staging`'s device path), and so are the uploads
(:attr:`fedring.train.clients.Clients.rows`), from the backward pass through the attack and the
ring or the server rule (docs/arrays.md, "Rows and the ring on the device"); what crosses ranks
goes through pinned host buffers, or straight from device memory where MPI is CUDA-aware
(:meth:`Staging.transfers`). The shared weights and the server optimizer's state are tensors on the
device too (:class:`fedring.train.replica.Replica`): the round's update is applied there and the
model's parameters are loaded from the device weights, with no host copy. A checkpoint copies the
rows, the weights and the optimizer's state to host memory and ``--resume`` back
(:mod:`fedring.train.state`).

On a GPU, :func:`select` turns on PyTorch's deterministic algorithms and sets
``CUBLAS_WORKSPACE_CONFIG``: the same seed gives the same file on the same GPU model and
PyTorch build, not across them (docs/slurm.md, GPUs).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from mpi4py import MPI

from fedring.comm.network import Transfers
from fedring.errors import ConfigError

from .models import flat_grad_into, load_flat
from .optim import Vector

#: cuBLAS's deterministic workspace (PyTorch's reproducibility notes); set before cuBLAS starts
CUBLAS_WORKSPACE = ":4096:8"


def require_visible(setting: str) -> None:
    """``device = "cuda"`` needs a visible GPU; raised on every rank before any work."""
    if setting == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        build = "" if torch.version.cuda else f"; this torch ({torch.__version__}) is a CPU-only build"
        raise ConfigError("device", f'"cuda" but no GPU is visible to this process{where}{build}: use "cpu" or "auto"')


def select(setting: str, comm: MPI.Comm) -> torch.device:
    """Collective: this rank's device. On ``cuda``: GPU ``local rank % visible GPUs``, where the
    local rank is the rank among those on the same node (``MPI.COMM_TYPE_SHARED``)."""
    require_visible(setting)
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = node.rank
    node.Free()
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.cuda.set_device(device)
    return device


def describe(comm: MPI.Comm, device: torch.device) -> str:
    """Collective: one line for rank 0's banner: rank 0's device and how many ranks use each one
    (a GPU is named by its host and index)."""
    name = "cpu"
    if device.type == "cuda":
        name = f"{MPI.Get_processor_name()}:cuda:{device.index} ({torch.cuda.get_device_name(device)})"
    names = comm.gather(name, root=0)
    if names is None:  # not rank 0
        return ""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    shared = ", ".join(f"{n} x{c}" for n, c in counts.items())
    return f"fedring: device: rank 0 on {names[0]}; {comm.size} rank{'s' if comm.size > 1 else ''}: {shared}"


def pinned(nbytes: int) -> np.ndarray:
    """A host buffer of ``nbytes`` bytes in page-locked (pinned) memory, which a GPU reads and writes
    by DMA without a staging copy of the driver's: the numpy view of a pinned uint8 tensor, which the
    view keeps alive (it is the view's base). Needs a CUDA build of torch."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class Staging:
    """The flat float32 vectors of a client's update, and their way between host memory and a
    model's parameters on ``device``.

    On the *host path* (the CPU) the vectors are numpy arrays and loads and gradients are
    :func:`fedring.train.models.load_flat` and :func:`~fedring.train.models.flat_grad_into`
    themselves, so CPU runs stay bit-identical. On the *device path* (a GPU) they are tensors on
    the device: a client's whole update is computed there, into its row of the clients' device
    rows, and a host array crosses only through one pinned host buffer of ``d`` floats
    (:meth:`vector`, which places the replica's initial weights, and :meth:`upload`, :meth:`load`
    and :meth:`grad_into` of a host array).
    ``host_path=False`` runs the device path on the CPU (tests compare the two paths).
    """

    def __init__(self, device: torch.device, d: int, host_path: bool | None = None):
        self.device = device
        self.on_host = device.type == "cpu" if host_path is None else host_path
        if not self.on_host:
            self.host = torch.empty(d, dtype=torch.float32, pin_memory=device.type == "cuda")
            self.flat = torch.empty(d, dtype=torch.float32, device=device)

    def transfers(self) -> Transfers:
        """How this rank's device rows cross ranks (:class:`fedring.comm.network.Transfers`): on a GPU
        through :func:`pinned` host buffers, or from device memory once the GPU's queued work is done
        where MPI moves it (``FEDRING_DEVICE_MPI``); elsewhere through numpy's buffers."""
        if self.device.type != "cuda":
            return Transfers()
        return Transfers(pinned, functools.partial(torch.cuda.synchronize, self.device))

    def tensor(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A batch (or any host array) as a tensor on the device (a tensor as it is: a batch
        gathered on the device, :meth:`fedring.train.clients.Clients.device_batches`)."""
        if isinstance(array, torch.Tensor):
            return array
        # a read-only array (a natural partition's shard, a view of the data set's file) is copied:
        # torch cannot share memory it may not write
        t = torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
        return t if self.on_host else t.to(self.device)

    def empty(self, shape: tuple[int, ...]) -> Vector:
        """An uninitialised float32 array of this path's kind."""
        if self.on_host:
            return np.empty(shape, np.float32)
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    def copy(self, vec: Vector) -> Vector:
        """A copy of ``vec``, of the same kind."""
        return vec.copy() if isinstance(vec, np.ndarray) else vec.clone()

    def vector(self, array: np.ndarray) -> Vector:
        """The host vector ``array`` on this path: itself on the host path, else a device copy."""
        if self.on_host:
            return array
        self.host.numpy()[:] = array
        return self.host.to(self.device, copy=True)

    def upload(self, vec: torch.Tensor, out: np.ndarray) -> None:
        """The device vector ``vec`` into the host array ``out``, through the pinned buffer."""
        self.host.copy_(vec)
        out[:] = self.host.numpy()

    def load(self, params: list[torch.Tensor], vec: Vector) -> None:
        """``params`` (a model's parameters, in order, as :meth:`grad_into` takes them) from ``vec``
        (float32, length d): a host array, or a vector of this path's kind."""
        if isinstance(vec, np.ndarray):
            if self.on_host:
                load_flat(params, vec)
                return
            self.host.numpy()[:] = vec
            self.flat.copy_(self.host)  # synchronous: the next load may overwrite the host buffer at once
            vec = self.flat
        with torch.no_grad():  # copies, all in one call: the parameters must not alias the vector
            parts = torch.split(vec, [p.numel() for p in params])
            torch._foreach_copy_(params, [part.view_as(p) for part, p in zip(parts, params)])

    def grad_into(self, params: list[torch.Tensor], out: Vector) -> None:
        """The gradients of ``params`` (a model's parameters, in order: a list kept, not walked from the
        model's modules at each call) into ``out`` (float32, length d): a host array, or a vector of
        this path's kind."""
        if isinstance(out, np.ndarray) and self.on_host:
            flat_grad_into(params, out)
            return
        flat = self.flat if isinstance(out, np.ndarray) else out
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads), "grad_into after a backward pass"
        with torch.no_grad():  # one concatenation into the row, not a copy per parameter
            torch.cat([g.reshape(-1) for g in grads if g is not None], out=flat)
        if isinstance(out, np.ndarray):
            self.upload(flat, out)
