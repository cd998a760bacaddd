"""A rank's replica of the shared model: its weights, the server optimizer that applies each
round's aggregate, and the model's buffers (BatchNorm statistics).

Every rank holds the same replica and applies the same update, so the weights never travel; a
checkpoint stores them once, with the server optimizer's state and the buffers.

The weights and the server optimizer's state live where the clients' rows do
(:class:`fedring.train.device.Staging`): numpy arrays on the host path, tensors on the device on
the device path, where a round's update is applied without leaving the device and the model's
parameters are loaded from the device weights. Host copies are made only for what is read in host
memory: a checkpoint (and the final model), :attr:`Replica.w`, and :meth:`Replica.restore`'s
arrays going back to the device. docs/arrays.md ("Rows and the ring on the device") says what
agrees with the host path, and why.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedring.arrays import host, like

from .device import Staging
from .optim import ServerSGD, State, Vector
from .schedules import StepSizes
from .state import ModelBuffers


class Replica:
    """The flat float32 weights ``w_staged`` (what the clients' updates read: a numpy array on the host
    path, a tensor on the device on the device path), the server optimizer's state beside them, and
    ``model``, whose parameters hold the weights between rounds.

    An optimizer without ``on_device`` (a plugin's, written for numpy) keeps its state in host
    memory on the device path: its update comes to the host and its step goes back, one ``d``-vector
    each way a round."""

    def __init__(
        self,
        model: nn.Module,
        w: np.ndarray,
        stage: Staging,
        optimizer: ServerSGD,
        step_sizes: StepSizes,
        buffers: ModelBuffers,
    ):
        self.model, self.stage, self.buffers = model, stage, buffers
        self.params: list[torch.Tensor] = list(model.parameters())
        self.optimizer, self.step_sizes = optimizer, step_sizes
        self.w_staged: Vector = stage.vector(w)  # w itself on the host path
        self.optimizer_on_host = stage.on_host or not getattr(optimizer, "on_device", False)
        # the same on every replica: it sees the same updates
        self.state: State = {k: self.placed(v) for k, v in optimizer.init(w.size).items()}
        self.w0 = stage.copy(self.w_staged)  # the drift diagnostic measures w_t - w_0

    @property
    def w(self) -> np.ndarray:
        """The weights in host memory: the weights themselves on the host path, a host copy on the
        device path (a CPU tensor's memory, shared), made at each reading."""
        return host(self.w_staged)

    def placed(self, array: np.ndarray) -> Vector:
        """A host state array where the optimizer keeps its state: beside the weights, or in host memory."""
        return array if self.optimizer_on_host else like(array, self.w_staged)

    def apply(self, update: Vector, t: int, member: np.ndarray) -> None:
        """``w <- w - step`` of the server optimizer on round ``t``'s aggregate ``update`` (of the weights'
        kind), in place, and the round's BatchNorm statistics, the mean over its cohort (``member``, a
        mask over every client)."""
        eta = self.optimizer.eta(self.step_sizes.lr, self.step_sizes.factor(t))
        if self.optimizer_on_host and not self.stage.on_host:
            step, self.state = self.optimizer.update(self.state, host(update), eta, t)
            step = like(np.asarray(step), self.w_staged)
        else:
            step, self.state = self.optimizer.update(self.state, update, eta, t)
        self.w_staged -= step
        self.load()
        self.buffers.aggregate(member)

    def load(self) -> None:
        """After the weights changed: the model's parameters (a copy; on the device path from the device)."""
        self.stage.load(self.params, self.w_staged)

    def weight_mean_change(self) -> float:
        """Drift diagnostic: the mean over coordinates of ``w_t - w_0``, ``np.mean(w - w0, dtype=np.float64)``
        (on the device path of a host copy: read at evaluations only, and numpy's summation order is
        what makes the number the same on both paths)."""
        return float(np.mean(host(self.w_staged - self.w0), dtype=np.float64))

    def checkpoint(self) -> dict:
        """Collective (the buffers): what a resumed replica needs, on rank 0, as host arrays."""
        state = {f"optim_{k}": host(v) for k, v in self.state.items()}
        return {"w": self.w, **state, **self.buffers.checkpoint()}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Collective: continue from :meth:`checkpoint`'s arrays as stored (onto the device on its path)."""
        self.w_staged[...] = like(np.asarray(arrays["w"], np.float32), self.w_staged)
        self.load()
        self.state.update(
            {k.removeprefix("optim_"): self.placed(np.array(v)) for k, v in arrays.items() if k.startswith("optim_")}
        )
        self.buffers.restore(arrays.get("buffers"))
