"""Models, and the flat float32 parameter vectors the protocols move."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedring.errors import ConfigError
from fedring.registry import Registry

#: the models, by name (setting ``model``)
MODELS = Registry("model")


@MODELS.register
class FashionCNN(nn.Sequential):
    """The BRACE paper's Fashion-MNIST CNN (its §5.1): d = 139,960 parameters.

    Conv(1->30, 3x3) + ReLU, MaxPool 2, Conv(30->50, 3x3) + ReLU, MaxPool 2,
    Linear(1250->100) + ReLU, Linear(100->10). The paper gives only the filter counts; the
    3x3 kernels without padding and a pooling after each convolution are the layer list of the
    Fang/FLTrust-lineage code (``get_cnn``). Other kernels would change d (docs/brace.md).
    """

    name = "cnn"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 30, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(30, 50, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(1250, 100), nn.ReLU(), nn.Linear(100, 10),
        )


@MODELS.register
class FashionCNNBatchNorm(nn.Sequential):
    """FashionCNN with BatchNorm after each convolution: d = 140,120 parameters and 162 buffers
    (running mean and variance of 30 + 50 channels, two counters); the small model with buffers
    (``bn_stats``, docs/training.md)."""

    name = "cnn_bn"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 30, 3), nn.BatchNorm2d(30), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(30, 50, 3), nn.BatchNorm2d(50), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(1250, 100), nn.ReLU(), nn.Linear(100, 10),
        )


@MODELS.register
class CifarCNN(nn.Sequential):
    """A small CNN for 32x32 colour images (CIFAR-10): d = 545,098 parameters.

    Conv(3->32, 3x3, pad 1) + ReLU, MaxPool 2, Conv(32->64, 3x3, pad 1) + ReLU, MaxPool 2,
    Linear(4096->128) + ReLU, Linear(128->10): the size of FashionCNN's counterpart for
    colour images, small enough for 100 clients on a CPU.
    """

    name = "cnn_cifar"
    input_shape = (3, 32, 32)

    def __init__(self):
        super().__init__(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(4096, 128), nn.ReLU(), nn.Linear(128, 10),
        )


def make_model(name: str, seed: int, image_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Build model ``name`` with PyTorch's default initialisation drawn from ``seed``; with
    ``image_shape``, check that the model takes images of that shape."""
    cls = MODELS.get(name, "model")
    if image_shape is not None and tuple(image_shape) != cls.input_shape:
        fits = [m for m, c in MODELS.items() if c.input_shape == tuple(image_shape)]
        raise ConfigError("model", f"{name} takes {'x'.join(map(str, cls.input_shape))} images, the data set has "
                                   f"{'x'.join(map(str, image_shape))}: set model = {' or '.join(fits) or '(none fits)'}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return cls()
    finally:
        torch.random.set_rng_state(gen_state)


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flatten(model: nn.Module) -> np.ndarray:
    """The parameters as one float32 vector, in ``model.parameters()`` order."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().astype(np.float32)


def load_flat(model: nn.Module, vec: np.ndarray) -> None:
    """Set the parameters from a flat vector (the inverse of :func:`flatten`)."""
    torch.nn.utils.vector_to_parameters(torch.from_numpy(np.ascontiguousarray(vec, np.float32)), model.parameters())


def flat_grad_into(model: nn.Module, out: np.ndarray) -> None:
    """Copy the gradients into ``out`` (float32, length d), in parameter order."""
    k = 0
    for p in model.parameters():
        m = p.numel()
        out[k : k + m] = p.grad.numpy().reshape(-1)
        k += m
