"""What a server rule that inspects the model sees of it: the :class:`Probe` (DeepSight's DDifs).

A server rule receives flat update vectors. A rule whose class sets ``needs_probe = True`` also
gets a probe of the round's model: where the output layer sits in a row
(:class:`OutputLayer`), the shape of one input sample, and the softmax outputs of each client's
model and of the global model on a batch of inputs. The training loop builds one on rank 0 each
round from the replica's weights w and the round's learning rate lr (``fedring.train.probe``,
torch); client i's model is ``w - lr * rows[i]``, the model the server's step would give from
that upload alone, which is the client's local model in FedSGD and after ``local_steps`` steps
(an upload is ``(w - w_local) / lr``, ``fedring.train.clients``). :class:`LinearProbe` is the
same contract over a softmax-regression model in numpy, for examples and tests. Nothing here
imports torch.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np


class OutputLayer(NamedTuple):
    """The output layer's place in a row: a ``(classes, fan_in)`` weight, row-major, from ``start``,
    then its ``(classes,)`` bias (PyTorch's ``nn.Linear`` in ``parameters()`` order).

    >>> layer = OutputLayer(start=1, classes=2, fan_in=3)
    >>> rows = np.arange(18.0).reshape(2, 9)
    >>> layer.weight(rows)[1].tolist(), layer.bias(rows)[1].tolist()
    ([[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]], [16.0, 17.0])
    """

    start: int
    classes: int
    fan_in: int

    @property
    def stop(self) -> int:
        return self.start + self.classes * (self.fan_in + 1)

    def weight(self, rows: np.ndarray) -> np.ndarray:
        """The ``(n, classes, fan_in)`` weights of the ``(n, d)`` rows (a view)."""
        return rows[:, self.start : self.start + self.classes * self.fan_in].reshape(-1, self.classes, self.fan_in)

    def bias(self, rows: np.ndarray) -> np.ndarray:
        """The ``(n, classes)`` biases of the ``(n, d)`` rows (a view)."""
        return rows[:, self.start + self.classes * self.fan_in : self.stop]


class Probe(Protocol):
    """The round's model as a rule that inspects it sees it (module docstring)."""

    #: where the output layer's weight and bias sit in a row
    output_layer: OutputLayer
    #: one input sample's shape (an image's ``(channels, height, width)``)
    input_shape: tuple[int, ...]

    def softmax(self, rows: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``(n, m, classes)`` softmax outputs of client i's model ``w - lr * rows[i]`` on the ``m``
        inputs ``x`` (float32, ``(m, *input_shape)``), and the ``(m, classes)`` of the global model w."""
        ...


def softmax(z: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, shifted by the maximum (no overflow)."""
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class LinearProbe:
    """The probe of a softmax-regression model ``softmax(W x + b)`` held as the flat vector
    ``w = (W row-major, b)``, in float64 (the inputs flattened).

    >>> probe = LinearProbe(np.zeros(6), lr=0.5, input_shape=(2,))
    >>> clients, server = probe.softmax(np.array([[-2.0, 0, 0, 0, 0, 0]]), np.array([[1.0, 0.0]], np.float32))
    >>> clients.round(4).tolist(), server.tolist()
    ([[[0.7311, 0.2689]]], [[0.5, 0.5]])
    """

    def __init__(self, w: np.ndarray, lr: float, input_shape: tuple[int, ...]):
        fan_in = int(np.prod(input_shape))
        classes, left = divmod(len(w), fan_in + 1)
        if left or classes < 1:
            raise ValueError(
                f"a linear model of {fan_in} inputs has a multiple of {fan_in + 1} parameters, got {len(w)}"
            )
        self.w, self.lr, self.input_shape = np.asarray(w, np.float64), float(lr), tuple(input_shape)
        self.output_layer = OutputLayer(0, classes, fan_in)

    def outputs(self, models: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``(k, m, classes)`` softmax outputs of the ``(k, d)`` flat models on the inputs ``x``."""
        flat = np.asarray(x, np.float64).reshape(len(x), -1)
        logits = np.einsum("kcf,mf->kmc", self.output_layer.weight(models), flat)
        return softmax(logits + self.output_layer.bias(models)[:, None, :])

    def softmax(self, rows: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        clients = self.outputs(self.w - self.lr * np.asarray(rows, np.float64), x)
        return clients, self.outputs(self.w[None, :], x)[0]
