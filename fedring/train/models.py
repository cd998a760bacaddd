"""Models, and the flat float32 parameter vectors the protocols move."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedring.errors import ConfigError
from fedring.registry import Registry

#: the models, by name (setting ``model``)
MODELS = Registry("model", bases=(nn.Module,), requires=("input_shape",))


def fashion_cnn_layers(norm) -> list[nn.Module]:
    """FashionCNN's layers, with ``norm(channels)`` after each convolution unless ``norm`` is None."""

    def conv(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3), *([] if norm is None else [norm(c_out)]), nn.ReLU(), nn.MaxPool2d(2)]

    return [*conv(1, 30), *conv(30, 50), nn.Flatten(), nn.Linear(1250, 100), nn.ReLU(), nn.Linear(100, 10)]


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
        super().__init__(*fashion_cnn_layers(norm=None))


@MODELS.register
class FashionCNNBatchNorm(nn.Sequential):
    """FashionCNN with BatchNorm after each convolution: d = 140,120 parameters and 162 buffers
    (running mean and variance of 30 + 50 channels, two counters); the small model with buffers
    (``bn_stats``, docs/training.md)."""

    name = "cnn_bn"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(*fashion_cnn_layers(norm=nn.BatchNorm2d))


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
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(4096, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )


@MODELS.register
class MLP(nn.Sequential):
    """ByzFL's MNIST network ``fc_mnist``: Linear(784->100) + ReLU, Linear(100->10); d = 79,510.

    The fully connected MNIST network of the ByzFL library (González et al., "ByzFL: Research
    Framework for Robust Federated Learning", 2025; ``byzfl.fed_framework.models.fc_mnist``).
    ByzFL ends with a log-softmax; fedring's cross-entropy applies its own, and the
    log-softmax of a log-softmax is the same, so the gradients agree.
    """

    name = "mlp"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))


@MODELS.register
class LeNet5(nn.Sequential):
    """LeNet-5 (LeCun et al., "Gradient-based learning applied to document recognition",
    Proc. IEEE 1998, §II.B) for 28x28 grey images: d = 61,706 parameters.

    Conv(1->6, 5x5, pad 2) + ReLU, MaxPool 2, Conv(6->16, 5x5) + ReLU, MaxPool 2,
    Linear(400->120) + ReLU, Linear(120->84) + ReLU, Linear(84->10). The padding makes the
    28x28 images the paper's 32x32 input; ReLU and max-pooling replace the paper's scaled tanh
    and trainable sub-sampling, as in the LeNet-5 of federated-learning code bases.
    """

    name = "lenet5"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(400, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, 10),
        )


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a shortcut (He et al. 2016, Fig. 2); ``norm(channels)``
    makes the normalisation layers."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            norm(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            norm(c_out),
        )
        self.shortcut = (
            nn.Sequential()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet18_layers(norm) -> list[nn.Module]:
    """ResNet-18 for 32x32 images: a 3x3 stem without max-pooling, four stages of two blocks
    (64, 128, 256, 512 channels), global average pooling, Linear(512->10)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), norm(64), nn.ReLU()]
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c_in, c_out, stride, norm), BasicBlock(c_out, c_out, 1, norm)]
        c_in = c_out
    return [*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]


@MODELS.register
class ResNet18GN(nn.Sequential):
    """ResNet-18 (He et al., "Deep residual learning for image recognition", CVPR 2016, Table 1)
    in its CIFAR variant, with GroupNorm: d = 11,173,962 parameters.

    The CIFAR variant (3x3 stem convolution, no max-pooling, so the 32x32 image reaches the
    first stage whole) is ByzFL's ``ResNet18``; the FedSECA paper (its Table C.2: 11.2M
    parameters) and the H+ paper train a ResNet-18 on CIFAR-10. Each BatchNorm is a GroupNorm of 32 groups (Wu & He, "Group
    Normalization", ECCV 2018): it has the same affine parameters, so the same d, and no
    running statistics, so the flat parameter vector is the whole model state; Hsieh et al.
    ("The non-IID data quagmire", ICML 2020) recommend it for federated training on non-IID
    data. ``resnet18`` is the BatchNorm network.
    """

    name = "resnet18_gn"
    input_shape = (3, 32, 32)

    def __init__(self):
        super().__init__(*resnet18_layers(lambda c: nn.GroupNorm(32, c)))


@MODELS.register
class ResNet18(nn.Sequential):
    """ResNet-18 in its CIFAR variant with BatchNorm, as the FedSECA and H+ papers and ByzFL
    train it: d = 11,173,962 parameters and 9,620 buffer entries (the running mean and variance
    of the 4,800 channels of its 20 BatchNorm layers, and their 20 batch counters).

    The running statistics are not parameters: ``bn_stats`` decides whether they are averaged
    over the clients after every round or kept per client (``docs/training.md``).
    """

    name = "resnet18"
    input_shape = (3, 32, 32)

    def __init__(self):
        super().__init__(*resnet18_layers(nn.BatchNorm2d))


def make_model(name: str, seed: int, image_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Build model ``name`` with PyTorch's default initialisation drawn from ``seed``; with
    ``image_shape``, check that the model takes images of that shape."""
    cls = MODELS.get(name, "model")
    if image_shape is not None and tuple(image_shape) != cls.input_shape:
        fits = [m for m, c in MODELS.items() if c.input_shape == tuple(image_shape)]
        raise ConfigError(
            "model",
            f"{name} takes {'x'.join(map(str, cls.input_shape))} images, the data set has "
            f"{'x'.join(map(str, image_shape))}: set model = {' or '.join(fits) or '(none fits)'}",
        )
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
        assert p.grad is not None, "called after backward(), which fills every parameter's gradient"
        out[k : k + m] = p.grad.numpy().reshape(-1)
        k += m
