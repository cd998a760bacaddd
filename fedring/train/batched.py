"""``batched_clients = B``: B clients' local steps in one call (docs/training.md, batched clients).

The model is shared and only the weights and batches differ, so one step of B clients is
``vmap`` over clients of ``grad`` of the loss of ``functional_call(model, weights_b, x_b)``
(:mod:`torch.func`). Each client keeps its own batches, data attack, local weights and
optimizer rows: the per-step clipping, weight decay and momentum are
:class:`fedring.train.optim.ClientOptimizer`'s, row by row, as in
:meth:`fedring.train.trainer.Trainer.client_gradient`, which stays the reference.

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

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedring.errors import ConfigError
from fedring.rng import Stream, generator

from .optim import Vector, f32

if TYPE_CHECKING:
    from .trainer import Trainer


def refusal(model: nn.Module, model_name: str) -> str | None:
    """Why ``batched_clients`` cannot run ``model``, or None."""
    if any(True for _ in model.buffers()):
        return (
            f"model {model_name} has buffers (BatchNorm statistics), which vmap cannot update: use the per-client loop"
        )
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return f"model {model_name} has dropout, which draws per call: use the per-client loop"
    return None


class BatchedClients:
    """Collective (construction): a rank's clients, ``size`` at a time; :meth:`round` fills their uploads."""

    def __init__(self, tr: Trainer, size: int):
        self.tr, self.size = tr, size
        why = refusal(tr.model, tr.cfg.model)
        if why is not None:
            raise ConfigError("batched_clients", why)
        short = min((len(s.y) for s in tr.data.shards), default=tr.cfg.batch_size) < tr.cfg.batch_size
        if tr.comm.allreduce(short, op=MPI.LOR):  # data-dependent: every rank refuses alike
            raise ConfigError(
                "batched_clients",
                f"a client has fewer than batch_size ({tr.cfg.batch_size}) training samples: lower batch_size, "
                "or use the per-client loop",
            )
        self.names = [name for name, _ in tr.model.named_parameters()]
        self.shapes = [p.shape for p in tr.model.parameters()]

        def loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(tr.model, weights, (x,)), y)

        self.step = vmap(grad_and_value(loss))

    def weights(self, w_local: Vector) -> dict[str, torch.Tensor]:
        """``(B, d)`` flat weights as the model's parameters, each ``(B, *shape)``, on the device."""
        flat = torch.as_tensor(w_local)  # the host path's numpy rows, shared
        out, k = {}, 0
        for name, shape in zip(self.names, self.shapes):
            m = shape.numel()
            out[name] = flat[:, k : k + m].reshape(len(w_local), *shape)
            k += m
        return out

    def round(self, t: int, batch_loss: np.ndarray, taking: np.ndarray) -> None:
        """Round ``t``: the upload of every local client that takes part (``taking``, per local client)
        into ``tr.grads``, its first batch loss into ``batch_loss``. A chunk keeps its slots: a client
        that sits out is a slot filled like another rank's."""
        lay = self.tr.layout
        for first in range(lay.lo - lay.lo % self.size, lay.hi, self.size):
            held = [c for c in range(first, first + self.size) if lay.lo <= c < lay.hi and taking[c - lay.lo]]
            if held:
                self.chunk(t, first, held, batch_loss)

    def chunk(self, t: int, first: int, held: list[int], batch_loss: np.ndarray) -> None:
        tr, B = self.tr, self.size
        lay, cfg = tr.layout, tr.cfg
        lr = f32(tr.lr_at(t))
        attack = tr.adversary.data_attack
        draws = {}
        for c in held:
            k = c - lay.lo
            rng = generator(cfg.seed, Stream.BATCH, client=c, step=t)
            draws[c] = (tr.local_batches(tr.data.shards[k], rng), generator(cfg.seed, Stream.POISON, client=c, step=t))
        steps = cfg.local_steps
        w = tr.w_staged  # on the device path: device vectors and rows
        w_local, g = tr.stage.empty((B, tr.d)), tr.stage.empty((B, tr.d))
        w_local[:] = w
        for step in range(steps):
            batches = {}
            for c in held:
                x, y = next(draws[c][0])
                if attack is not None and tr.adversary.poisons(c):
                    x, y = attack.poison(x, y, draws[c][1])
                batches[c] = (x, y)
            slots = [batches.get(c, batches[held[0]]) for c in range(first, first + B)]
            x = np.stack([s[0] for s in slots])
            y = np.stack([s[1] for s in slots])
            grads, losses = self.step(self.weights(w_local), tr.stage.tensor(x), tr.stage.tensor(y))
            g[:] = torch.cat([grads[n].reshape(B, -1) for n in self.names], dim=1)
            if step == 0:
                first_loss = losses.cpu().numpy()
            for c in held:
                s = c - first
                tr.client_opt.gradient(g[s], w_local[s])
                if steps > 1:
                    w_local[s] -= lr * g[s]
        for c in held:
            s, k = c - first, c - lay.lo
            out = tr.grads[k]
            u = tr.stage.output(out)
            u[:] = (w - w_local[s]) / lr if steps > 1 else g[s]
            tr.upload(k, u, out)
            batch_loss[c] = float(first_loss[s])
