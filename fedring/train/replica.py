"""A rank's replica of the shared model: its weights, the server optimizer that applies each
round's aggregate, and the model's buffers (BatchNorm statistics).

Every rank holds the same replica and applies the same update, so the weights never travel; a
checkpoint stores them once, with the server optimizer's state and the buffers.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from .device import Staging
from .optim import ServerSGD, Vector
from .schedules import StepSizes
from .state import ModelBuffers


class Replica:
    """The flat float32 weights ``w`` (host memory), their staged copy ``w_staged`` (what the clients'
    updates read: ``w`` itself on the host path, a device copy on the device path), and ``model``,
    whose parameters hold ``w`` between rounds."""

    def __init__(
        self,
        model: nn.Module,
        w: np.ndarray,
        stage: Staging,
        optimizer: ServerSGD,
        step_sizes: StepSizes,
        buffers: ModelBuffers,
    ):
        self.model, self.w, self.stage, self.buffers = model, w, stage, buffers
        self.optimizer, self.step_sizes = optimizer, step_sizes
        self.state = optimizer.init(w.size)  # the same on every replica: it sees the same updates
        self.w0 = w.copy()  # the drift diagnostic measures w_t - w_0
        self.w_staged: Vector = stage.vector(w)

    def apply(self, update: np.ndarray, t: int, member: np.ndarray) -> None:
        """``w <- w - step`` of the server optimizer on round ``t``'s aggregate ``update``, and the
        round's BatchNorm statistics, the mean over its cohort (``member``, a mask over every client)."""
        eta = self.optimizer.eta(self.step_sizes.lr, self.step_sizes.factor(t))
        step, self.state = self.optimizer.update(self.state, update, eta, t)
        self.w -= step
        self.load()
        self.buffers.aggregate(member)

    def load(self) -> None:
        """After ``w`` changed: its staged copy, made once per change instead of once per client, and
        the model's parameters."""
        self.w_staged = self.stage.vector(self.w)
        self.stage.load(self.model, self.w_staged)

    def weight_mean_change(self) -> float:
        """Drift diagnostic: the mean over coordinates of ``w_t - w_0``."""
        return float(np.mean(self.w - self.w0, dtype=np.float64))

    def checkpoint(self) -> dict:
        """Collective (the buffers): what a resumed replica needs, on rank 0."""
        return {"w": self.w, **{f"optim_{k}": v for k, v in self.state.items()}, **self.buffers.checkpoint()}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Collective: continue from :meth:`checkpoint`'s arrays as stored."""
        self.w[:] = arrays["w"]
        self.load()
        self.state.update({k.removeprefix("optim_"): np.array(v) for k, v in arrays.items() if k.startswith("optim_")})
        self.buffers.restore(arrays.get("buffers"))
