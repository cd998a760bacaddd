"""Where a rank's model, batches and gradients live: the ``device`` setting (docs/slurm.md, GPUs).

``cpu`` (the default) runs everything as before, bit for bit. ``cuda`` puts each rank on the
GPU of its node-local rank (MPI's shared-memory split) modulo the visible GPUs, so several
ranks may share one; ``CUDA_VISIBLE_DEVICES`` chooses which GPUs are visible. ``auto`` is
``cuda`` where a GPU is visible, else ``cpu``. The flat float32 vectors the protocols move stay
in host memory (the comm layer moves numpy buffers); on a GPU they pass through pinned host
buffers (:class:`Staging`). The clients' optimizer rows (:mod:`fedring.train.optim`: momentum)
are numpy arithmetic on those host vectors, so they stay in host memory too.

On a GPU, :func:`select` turns on PyTorch's deterministic algorithms and sets
``CUBLAS_WORKSPACE_CONFIG``: the same seed gives the same file on the same GPU model and
PyTorch build, not across them (docs/slurm.md, GPUs).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from fedring.errors import ConfigError

from .models import flat_grad_into, load_flat

#: cuBLAS's deterministic workspace (PyTorch's reproducibility notes); set before cuBLAS starts
CUBLAS_WORKSPACE = ":4096:8"


def check_visible(setting: str) -> None:
    """``device = "cuda"`` needs a visible GPU; raised on every rank before any work."""
    if setting == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        build = "" if torch.version.cuda else f"; this torch ({torch.__version__}) is a CPU-only build"
        raise ConfigError("device", f'"cuda" but no GPU is visible to this process{where}{build}: use "cpu" or "auto"')


def select(setting: str, comm: MPI.Comm) -> torch.device:
    """Collective: this rank's device. On ``cuda``: GPU ``local rank % visible GPUs``, where the
    local rank is the rank among those on the same node (``MPI.COMM_TYPE_SHARED``)."""
    check_visible(setting)
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


class Staging:
    """The flat float32 vectors between host memory and a model's parameters on ``device``.

    On the CPU these are :func:`fedring.train.models.load_flat` and
    :func:`~fedring.train.models.flat_grad_into` themselves (so CPU runs stay bit-identical);
    on a GPU every copy goes through one pinned host buffer of ``d`` floats and one device vector.
    """

    def __init__(self, device: torch.device, d: int):
        self.device = device
        self.on_host = device.type == "cpu"
        if not self.on_host:
            self.host = torch.empty(d, dtype=torch.float32, pin_memory=True)
            self.flat = torch.empty(d, dtype=torch.float32, device=device)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A batch (or any host array) as a tensor on the device."""
        t = torch.from_numpy(array)
        return t if self.on_host else t.to(self.device)

    def load(self, model: nn.Module, vec: np.ndarray) -> None:
        """The parameters from ``vec`` (float32, length d)."""
        if self.on_host:
            load_flat(model, vec)
            return
        self.host.numpy()[:] = vec
        self.flat.copy_(self.host)  # synchronous: the next load may overwrite the host buffer at once
        with torch.no_grad():  # copies: the parameters must not alias the staging vector
            k = 0
            for p in model.parameters():
                m = p.numel()
                p.copy_(self.flat[k : k + m].view_as(p))
                k += m

    def grad_into(self, model: nn.Module, out: np.ndarray) -> None:
        """The gradients into ``out`` (float32, length d), in parameter order."""
        if self.on_host:
            flat_grad_into(model, out)
            return
        with torch.no_grad():
            k = 0
            for p in model.parameters():
                m = p.numel()
                assert p.grad is not None, "grad_into after a backward pass"
                self.flat[k : k + m].copy_(p.grad.reshape(-1))
                k += m
        self.host.copy_(self.flat)
        out[:] = self.host.numpy()
