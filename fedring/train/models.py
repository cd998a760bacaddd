"""Models, and the flat float32 parameter vectors the protocols move."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedring.errors import ConfigError


class FashionCNN(nn.Sequential):
    """The BRACE paper's Fashion-MNIST CNN (its §5.1): d = 139,960 parameters.

    Conv(1->30, 3x3) + ReLU, MaxPool 2, Conv(30->50, 3x3) + ReLU, MaxPool 2,
    Linear(1250->100) + ReLU, Linear(100->10). The paper gives only the filter counts; the
    3x3 kernels without padding and a pooling after each convolution are the layer list of the
    Fang/FLTrust-lineage code (``get_cnn``). Other kernels would change d (docs/brace.md).
    """

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 30, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(30, 50, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(1250, 100), nn.ReLU(), nn.Linear(100, 10),
        )


MODELS = {"cnn": FashionCNN}


def make_model(name: str, seed: int) -> nn.Module:
    """Build a model with PyTorch's default initialisation drawn from ``seed``."""
    if name not in MODELS:
        raise ConfigError("model", f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return MODELS[name]()
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
