"""The round's model for a server rule that inspects it (:class:`fedring.aggregators.probe.Probe`):
DeepSight runs every client's model and the global model on random inputs.

Client i's model is ``w - lr * rows[i]`` in float32 (``lr`` the round's learning rate, the
clients' own: an upload is the gradient, or ``(w - w_local) / lr`` after several local steps), on
:class:`ModelProbe`'s own copy of the run's model: the run's model holds the replica's weights
between rounds and a client's BatchNorm statistics during one. The copy runs in eval mode with
the shared statistics (``ModelBuffers.shared``), on the model's device; its outputs come back to
the host.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fedring.aggregators.probe import OutputLayer
from fedring.errors import ConfigError

from .state import ModelBuffers

#: inputs per forward pass (a CNN's activations for 500 Fashion-MNIST images are about 100 MB)
BATCH = 500


def output_layer(
    model: nn.Module, classes: int, input_shape: tuple[int, ...], key: str = "aggregator", who: str = "deepsight"
) -> OutputLayer:
    """Where ``model``'s output layer sits in the flat parameter vector: its last two parameters, a
    ``(classes, fan_in)`` weight and a ``(classes,)`` bias. A ConfigError (naming ``key``, the
    setting that chose ``who`` reads it) when they are not, or when the model reads token sequences
    (``input_shape`` of one entry), which random images cannot stand for; every rank finds it alike.

    >>> output_layer(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), 2, (1, 2, 2))
    OutputLayer(start=15, classes=2, fan_in=3)
    """
    if len(input_shape) == 1:
        raise ConfigError(key, f"{who} runs the model on images; this model reads token sequences")
    params = list(model.parameters())
    weight, bias = params[-2:] if len(params) > 1 else (None, None)
    if weight is None or bias is None or weight.ndim != 2 or tuple(bias.shape) != (classes,) or len(weight) != classes:
        raise ConfigError(
            key,
            f"{who} reads the output layer from the model's last two parameters, a ({classes}, k) weight "
            f"and a ({classes},) bias; this model's end in shapes "
            f"{[tuple(p.shape) for p in params[-2:]]}",
        )
    d = sum(p.numel() for p in params)
    return OutputLayer(d - weight.numel() - bias.numel(), classes, int(weight.shape[1]))


class ModelProbe:
    """:class:`fedring.aggregators.probe.Probe` over a copy of the run's ``model`` (module docstring);
    :meth:`at` binds it to a round's weights and learning rate."""

    def __init__(self, model: nn.Module, layer: OutputLayer, input_shape: tuple[int, ...], buffers: ModelBuffers):
        self.model = copy.deepcopy(model).eval()
        self.output_layer, self.input_shape, self.buffers = layer, tuple(input_shape), buffers
        self.device = next(self.model.parameters()).device
        self.w, self.lr = np.zeros(0, np.float32), np.float32(0)

    def at(self, w: np.ndarray, lr: float) -> ModelProbe:
        """This probe bound to the global weights ``w`` (host float32) and the round's ``lr``, with the
        model's shared BatchNorm statistics."""
        self.w, self.lr = w, np.float32(lr)
        k = 0
        with torch.no_grad():
            for b in self.model.buffers():
                part = self.buffers.shared[k : k + b.numel()].reshape(b.shape)
                b.copy_(torch.from_numpy(part if b.is_floating_point() else np.rint(part)))
                k += b.numel()
        return self

    def outputs(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The ``(m, classes)`` float32 softmax outputs of the model with the flat weights ``w`` on ``x``."""
        with torch.no_grad():
            flat = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(self.device)
            nn.utils.vector_to_parameters(flat, self.model.parameters())
            out = [
                torch.softmax(self.model(torch.from_numpy(x[lo : lo + BATCH]).to(self.device)), dim=-1).cpu()
                for lo in range(0, len(x), BATCH)
            ]
        return torch.cat(out).numpy()

    def softmax(self, rows: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, np.float32)
        rows = np.asarray(rows, np.float32)
        clients = np.stack([self.outputs(self.w - self.lr * row, x) for row in rows])
        return clients, self.outputs(self.w, x)
