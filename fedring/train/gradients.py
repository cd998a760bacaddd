"""Where a group of clients' mini-batch gradients come from: the model's backward pass, one client
at a time (:class:`ModelGradients`), or ``vmap`` over B clients (:mod:`fedring.train.batched`).

The local steps (:mod:`fedring.train.clients`) are written once over a :class:`Group` of ``B``
slots; a source of gradients provides the group's buffers and, at each step, the gradients of
every slot at its local weights. Both sources keep the same contract:

- ``start(w, group, steps, block)``: the ``(B, d)`` local weights (each row ``w`` at first), or
  ``w[None]``, one row for every slot, where a one-step group's slots all take ``w`` as it is; and
  the ``(B, d)`` gradient buffer, of the staging path's kind: ``block`` itself, the slots' rows of the
  clients' uploads, when there is one (the gradients of one local step are then the uploads'
  directions already, with no copy);
- ``gradients(step, w_local, batches, g)``: the slots' gradients at ``w_local`` into ``g``, and
  their losses, a ``(B,)`` tensor where the model computes (the clients read a round's losses
  once: on a device each read waits for it); ``batches`` is a list of each slot's batch, a pair of
  host arrays or of tensors gathered on the device, or the slots' batches gathered at once, a pair
  of ``(B, batch, ...)`` tensors (:meth:`fedring.train.clients.RoundBatches.stacked`);
- ``end(w, group, steps)``: after the group's last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .device import Staging
from .optim import Vector
from .state import ModelBuffers

#: a group's batches of one step: each slot's ``(x, y)`` (host arrays, or tensors gathered on the
#: device), or every slot's at once, ``(B, batch, ...)`` tensors
Batches = list | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Group:
    """Clients whose local steps run together: ``size`` slots for the clients ``first ..
    first + size - 1``, of which this rank computes ``held`` (sorted ids; the other slots are
    filled with a copy of a held client's batches and their results discarded)."""

    first: int
    size: int
    held: list[int]


class ModelGradients:
    """One client at a time through the model's own backward pass (every model, BatchNorm's
    statistics included: each client trains with its statistics, :class:`ModelBuffers`).

    The model holds the shared weights ``w`` between clients; a client with more than one local
    step loads its local weights before each later step and ``w`` back at its end."""

    size = 1

    def __init__(self, model: nn.Module, stage: Staging, buffers: ModelBuffers, lo: int):
        self.model, self.stage, self.buffers, self.lo = model, stage, buffers, lo
        self.params: list[torch.Tensor] = list(model.parameters())

    def groups(self, clients: range, taking: np.ndarray) -> list[Group]:
        """Each local client that takes part (``taking``, per local client) in a group of its own."""
        return [Group(c, 1, [c]) for k, c in enumerate(clients) if taking[k]]

    def start(self, w: Vector, group: Group, steps: int, block: Vector) -> tuple[Vector, Vector]:
        """Local weights (``w`` itself with one step) and the gradient, built in the client's row ``block``."""
        self.buffers.use(group.first - self.lo)
        w_local = self.stage.copy(w) if steps > 1 else w
        return w_local[None], block

    def gradients(self, step: int, w_local: Vector, batches: Batches, g: Vector) -> torch.Tensor:
        if step:
            self.stage.load(self.params, w_local[0])
        x, y = (batches[0][0], batches[1][0]) if isinstance(batches, tuple) else batches[0]
        loss = self.backward(x, y)
        self.stage.grad_into(self.params, g[0])
        return loss.reshape(1)

    def end(self, w: Vector, group: Group, steps: int) -> None:
        self.buffers.keep(group.first - self.lo)
        if steps > 1:
            self.stage.load(self.params, w)

    def backward(self, x, y) -> torch.Tensor:
        """The model's gradients of the mean cross-entropy on ``(x, y)``; returns the loss, detached."""
        # zero_grad(set_to_none=False) without walking the modules each call: one fused zeroing
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        loss = F.cross_entropy(self.model(self.stage.tensor(x)), self.stage.tensor(y))
        loss.backward()
        return loss.detach()

    def at(self, x: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
        """The gradient on ``(x, y)`` at the weights the model holds, as a new float32 host vector."""
        self.backward(x, y)
        out = np.empty(d, np.float32)
        self.stage.grad_into(self.params, out)
        return out
