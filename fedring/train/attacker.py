"""The model and data of an attack that trains models itself (``ModelAttack.needs_model``, 3DFed):
:class:`AttackerModel` holds, on rank 0, a copy of the run's model and the first Byzantine client's
shard, and gives the attack each round's :class:`fedring.attacks.base.ModelAccess`.

The copy runs in train mode on the model's device, with buffers of its own (BatchNorm statistics
of the attacker's batches); its gradients are the plain mean cross-entropy's (the attack applies
its own SGD). Its batches come from the run's seed, the attacker's id and the round
(``Stream.ATTACK``), so a resumed run draws them again.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from itertools import count

import numpy as np
import torch
from torch import nn

from fedring.aggregators.probe import OutputLayer
from fedring.attacks.base import ModelAccess
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

from .data import Shard


def layer_slices(model: nn.Module) -> tuple[slice, slice, int]:
    """Where the attack's layers sit in the flat weights: the indicator layer (the last 4-d weight,
    a convolution's, else the first 2-d weight), the decoy layer (the 2-d weight before the output
    layer's, else the output layer's), and the indicator layer's index among the parameters.

    >>> net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 4), nn.Linear(4, 3))
    >>> layer_slices(net)
    (slice(0, 18, None), slice(20, 52, None), 0)
    """
    params = list(model.parameters())
    starts = np.cumsum([0] + [p.numel() for p in params])
    span = [slice(int(starts[i]), int(starts[i + 1])) for i in range(len(params))]
    convs = [i for i, p in enumerate(params) if p.ndim == 4]
    matrices = [i for i, p in enumerate(params) if p.ndim == 2]
    if not matrices:
        raise ConfigError("attack", "threedfed needs a model with a weight matrix (its output layer)")
    indicator = convs[-1] if convs else matrices[0]
    decoy = matrices[-2] if len(matrices) > 1 else matrices[-1]
    return span[indicator], span[decoy], indicator


class AttackerModel:
    """Rank 0's copy of ``model`` with the attacker's ``shard`` (module docstring); :meth:`at` gives a
    round's :class:`~fedring.attacks.base.ModelAccess`."""

    def __init__(
        self, model: nn.Module, shard: Shard, client: int, output: OutputLayer, batch_size: int, steps: int, seed: int
    ):
        self.model = copy.deepcopy(model).train()
        self.params = list(self.model.parameters())
        self.device = self.params[0].device
        self.shard, self.client, self.output = shard, client, output
        self.batch_size, self.steps, self.seed = min(batch_size, len(shard.y)), steps, seed
        self.indicator, self.decoy, self.which = layer_slices(self.model)

    def _load(self, w: np.ndarray) -> None:
        with torch.no_grad():
            flat = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(self.device)
            nn.utils.vector_to_parameters(flat, self.params)

    def _loss(self, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
        out = self.model(torch.from_numpy(np.ascontiguousarray(x)).to(self.device))
        return nn.functional.cross_entropy(out, torch.from_numpy(np.asarray(y, np.int64)).to(self.device))

    def gradient(self, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        """The mean cross-entropy's gradient at ``w`` on ``(x, y)`` (a fresh float32 array) and the loss."""
        self._load(w)
        loss = self._loss(x, y)
        grads = torch.autograd.grad(loss, self.params)
        return torch.cat([g.reshape(-1) for g in grads]).cpu().numpy(), float(loss.detach())

    def curvature(self, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The derivative of the sum of the indicator layer's gradient by that layer's weights (float64)."""
        self._load(w)
        layer = self.params[self.which]
        (g,) = torch.autograd.grad(self._loss(x, y), [layer], create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), [layer])
        return h.reshape(-1).cpu().numpy().astype(np.float64)

    def batches(self, t: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Round ``t``'s endless mini-batches, each drawn without replacement."""
        rng = generator(self.seed, Stream.ATTACK, client=self.client, step=t)
        for _ in count():
            idx = np.sort(rng.choice(len(self.shard.y), self.batch_size, replace=False))
            yield self.shard.x[idx], self.shard.y[idx]

    def shard_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The whole shard in mini-batches, in order."""
        for a in range(0, len(self.shard.y), self.batch_size):
            yield self.shard.x[a : a + self.batch_size], self.shard.y[a : a + self.batch_size]

    def at(self, t: int, w: np.ndarray, lr: float) -> ModelAccess:
        """Round ``t``'s access, from the global weights ``w`` (host float32) and the round's ``lr``."""
        w = w.view()
        w.flags.writeable = False
        return ModelAccess(
            w=w,
            lr=float(np.float32(lr)),
            steps=self.steps,
            batches=self.batches(t),
            shard_batches=self.shard_batches,
            gradient=self.gradient,
            curvature=self.curvature,
            indicator_layer=self.indicator,
            decoy_layer=self.decoy,
            output_layer=self.output,
        )
