"""``batched_clients = B``: B clients' local steps in one call (docs/training.md, batched clients).

The model is shared and only the weights and batches differ, so one step of B clients is
``vmap`` over clients of ``grad`` of the loss of ``functional_call(model, weights_b, x_b)``
(:mod:`torch.func`): :class:`VmapGradients`, a source of gradients for the local steps of
:mod:`fedring.train.clients`, which are the same for one client at a time. Each client keeps its
own batches, data attack, local weights and optimizer rows.

Chunks are aligned on client ids, not on a rank's block: chunk ``c`` is clients ``cB .. cB + B - 1``
and client ``i`` sits in slot ``i mod B``. A rank that holds part of a chunk fills the other
slots (and those of clients that sit out the round) with a copy of one of its clients' batches
and discards their results, so every call has
the same shape and every client the same slot whatever the number of ranks: the same seed gives
the same file on any number of ranks, for a given device and B. The results differ from the
per-client loop's by float rounding (a batched kernel sums in another order), not bit for bit.

Refused (:class:`fedring.errors.ConfigError`, naming the setting): models with buffers
(BatchNorm's running statistics, which ``vmap`` cannot update in place), models with dropout
(random per call), ``local_epochs`` (the last batch of a pass is shorter) and clients with fewer
training samples than ``batch_size`` (every slot's batch has the same size).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedring.errors import ConfigError

from .data import Shard
from .device import Staging
from .gradients import Batches, Group
from .optim import Vector


def refusal(model: nn.Module, model_name: str) -> str | None:
    """Why ``batched_clients`` cannot run ``model``, or None."""
    if any(True for _ in model.buffers()):
        return (
            f"model {model_name} has buffers (BatchNorm statistics), which vmap cannot update: use the per-client loop"
        )
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return f"model {model_name} has dropout, which draws per call: use the per-client loop"
    return None


class VmapGradients:
    """Collective (construction): ``size`` clients' gradients per call, in chunks aligned on client ids."""

    def __init__(
        self,
        model: nn.Module,
        model_name: str,
        stage: Staging,
        size: int,
        shards: list[Shard],
        batch_size: int,
        comm,
        shared_first_step: bool | None = None,
    ):
        why = refusal(model, model_name)
        if why is not None:
            raise ConfigError("batched_clients", why)
        short = min((len(s.y) for s in shards), default=batch_size) < batch_size
        if comm.allreduce(short, op=MPI.LOR):  # data-dependent: every rank refuses alike
            raise ConfigError(
                "batched_clients",
                f"a client has fewer than batch_size ({batch_size}) training samples: lower batch_size, "
                "or use the per-client loop",
            )
        self.stage, self.size = stage, size
        self.names = [name for name, _ in model.named_parameters()]
        self.shapes = [p.shape for p in model.parameters()]

        def loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, weights, (x,)), y)

        self.step = vmap(grad_and_value(loss))
        # at a group's first step every slot holds the shared weights: one set of weights for all
        # (in_dims None, a plain batched forward), where per-slot weights make vmap run grouped
        # convolutions; on a GPU only, as the CPU's kernels then sum in another order than the
        # per-slot ones, and the CPU keeps its results' bits
        self.shared_first_step = stage.device.type != "cpu" if shared_first_step is None else shared_first_step
        self.step_shared = vmap(grad_and_value(loss), in_dims=(None, 0, 0))

    def groups(self, clients: range, taking: np.ndarray) -> list[Group]:
        """The chunks of ``size`` client ids that hold a local client taking part (``taking``, per local
        client); a client that sits out keeps its slot, filled like another rank's."""
        lo, hi, B = clients.start, clients.stop, self.size
        out = []
        for first in range(lo - lo % B, hi, B):
            held = [c for c in range(first, first + B) if lo <= c < hi and taking[c - lo]]
            if held:
                out.append(Group(first, B, held))
        return out

    def start(self, w: Vector, group: Group, steps: int, block: Vector | None) -> tuple[Vector, Vector]:
        """The slots' local weights (with one shared-weights step on the device, ``w[None]``, one row
        for every slot: no copy) and gradient buffer (``block`` when given)."""
        g = self.stage.empty((group.size, w.shape[0])) if block is None else block
        if steps == 1 and self.shared_first_step and isinstance(w, torch.Tensor):
            return w[None], g
        w_local = self.stage.empty((group.size, w.shape[0]))
        w_local[:] = w
        return w_local, g

    def gradients(self, step: int, w_local: Vector, batches: Batches, g: Vector) -> torch.Tensor:
        x: torch.Tensor | np.ndarray
        y: torch.Tensor | np.ndarray
        if isinstance(batches, tuple):  # gathered at once on the device
            x, y = batches
        else:  # each slot's batch, gathered on the device or a host batch
            stack = torch.stack if isinstance(batches[0][0], torch.Tensor) else np.stack
            x = stack([b[0] for b in batches])
            y = stack([b[1] for b in batches])
        if step == 0 and self.shared_first_step:  # every slot's weights are the shared w
            weights = {n: v[0] for n, v in self.weights(w_local[:1]).items()}
            grads, losses = self.step_shared(weights, self.stage.tensor(x), self.stage.tensor(y))
        else:
            grads, losses = self.step(self.weights(w_local), self.stage.tensor(x), self.stage.tensor(y))
        parts = [grads[n].reshape(self.size, -1) for n in self.names]
        if isinstance(g, torch.Tensor):  # straight into the buffer, not through a (B, d) temporary
            torch.cat(parts, dim=1, out=g)
        else:
            g[:] = torch.cat(parts, dim=1)
        return losses.detach()

    def end(self, w: Vector, group: Group, steps: int) -> None:
        """Nothing to restore: the model's own parameters were never changed."""

    def weights(self, w_local: Vector) -> dict[str, torch.Tensor]:
        """``(B, d)`` flat weights as the model's parameters, each ``(B, *shape)``, on the device."""
        flat = torch.as_tensor(w_local)  # the host path's numpy rows, shared
        out, k = {}, 0
        for name, shape in zip(self.names, self.shapes):
            m = shape.numel()
            out[name] = flat[:, k : k + m].reshape(len(w_local), *shape)
            k += m
        return out
