"""Models, and the flat float32 parameter vectors the protocols move.

Every model takes ``classes``, its number of outputs: :func:`make_model` passes the data set's
(``Dataset.classes``). The ``d`` of each docstring is at the data set it was written for (10
classes unless it says otherwise); the classes change only the last layer, so at 10 classes a
model is the one of earlier releases, initialised alike from the same seed.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from fedring.errors import ConfigError
from fedring.registry import Registry

#: the models, by name (setting ``model``)
MODELS = Registry("model", bases=(nn.Module,), requires=("input_shape",))


def fashion_cnn_layers(norm, classes: int) -> list[nn.Module]:
    """FashionCNN's layers, with ``norm(channels)`` after each convolution unless ``norm`` is None."""

    def conv(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3), *([] if norm is None else [norm(c_out)]), nn.ReLU(), nn.MaxPool2d(2)]

    return [*conv(1, 30), *conv(30, 50), nn.Flatten(), nn.Linear(1250, 100), nn.ReLU(), nn.Linear(100, classes)]


@MODELS.register
class FashionCNN(nn.Sequential):
    """The BRACE paper's Fashion-MNIST CNN (its §5.1): d = 139,960 parameters.

    Conv(1->30, 3x3) + ReLU, MaxPool 2, Conv(30->50, 3x3) + ReLU, MaxPool 2,
    Linear(1250->100) + ReLU, Linear(100->classes). The paper gives only the filter counts; the
    3x3 kernels without padding and a pooling after each convolution are the layer list of the
    Fang/FLTrust-lineage code (``get_cnn``). Other kernels would change d (docs/brace.md).
    """

    name = "cnn"
    input_shape = (1, 28, 28)

    def __init__(self, classes: int = 10):
        super().__init__(*fashion_cnn_layers(None, classes))


@MODELS.register
class FashionCNNBatchNorm(nn.Sequential):
    """FashionCNN with BatchNorm after each convolution: d = 140,120 parameters and 162 buffers
    (running mean and variance of 30 + 50 channels, two counters); the small model with buffers
    (``bn_stats``, docs/training.md)."""

    name = "cnn_bn"
    input_shape = (1, 28, 28)

    def __init__(self, classes: int = 10):
        super().__init__(*fashion_cnn_layers(nn.BatchNorm2d, classes))


@MODELS.register
class CifarCNN(nn.Sequential):
    """A small CNN for 32x32 colour images (CIFAR-10): d = 545,098 parameters.

    Conv(3->32, 3x3, pad 1) + ReLU, MaxPool 2, Conv(32->64, 3x3, pad 1) + ReLU, MaxPool 2,
    Linear(4096->128) + ReLU, Linear(128->classes): the size of FashionCNN's counterpart for
    colour images, small enough for 100 clients on a CPU.
    """

    name = "cnn_cifar"
    input_shape = (3, 32, 32)

    def __init__(self, classes: int = 10):
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
            nn.Linear(128, classes),
        )


@MODELS.register
class MLP(nn.Sequential):
    """ByzFL's MNIST network ``fc_mnist``: Linear(784->100) + ReLU, Linear(100->classes); d = 79,510.

    The fully connected MNIST network of the ByzFL library (González et al., "ByzFL: Research
    Framework for Robust Federated Learning", 2025; ``byzfl.fed_framework.models.fc_mnist``).
    ByzFL ends with a log-softmax; fedring's cross-entropy applies its own, and the
    log-softmax of a log-softmax is the same, so the gradients agree.
    """

    name = "mlp"
    input_shape = (1, 28, 28)

    def __init__(self, classes: int = 10):
        super().__init__(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, classes))


@MODELS.register
class LeNet5(nn.Sequential):
    """LeNet-5 (LeCun et al., "Gradient-based learning applied to document recognition",
    Proc. IEEE 1998, §II.B) for 28x28 grey images: d = 61,706 parameters.

    Conv(1->6, 5x5, pad 2) + ReLU, MaxPool 2, Conv(6->16, 5x5) + ReLU, MaxPool 2,
    Linear(400->120) + ReLU, Linear(120->84) + ReLU, Linear(84->classes). The padding makes the
    28x28 images the paper's 32x32 input; ReLU and max-pooling replace the paper's scaled tanh
    and trainable sub-sampling, as in the LeNet-5 of federated-learning code bases.
    """

    name = "lenet5"
    input_shape = (1, 28, 28)

    def __init__(self, classes: int = 10):
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
            nn.Linear(84, classes),
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


def resnet18_layers(norm, classes: int) -> list[nn.Module]:
    """ResNet-18 in its CIFAR variant: a 3x3 stem without max-pooling, four stages of two blocks
    (64, 128, 256, 512 channels), global average pooling, Linear(512->classes)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), norm(64), nn.ReLU()]
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c_in, c_out, stride, norm), BasicBlock(c_out, c_out, 1, norm)]
        c_in = c_out
    return [*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]


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

    def __init__(self, classes: int = 10):
        super().__init__(*resnet18_layers(lambda c: nn.GroupNorm(32, c), classes))


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

    def __init__(self, classes: int = 10):
        super().__init__(*resnet18_layers(nn.BatchNorm2d, classes))


@MODELS.register
class ResNet18GN64(ResNet18GN):
    """``resnet18_gn`` for 64x64 colour images (Tiny-ImageNet): the same network, d = 11,271,432
    parameters at 200 classes (11,173,962 at 10).

    The CIFAR variant pools globally before its last layer, so it takes 64x64 images as they are:
    the four stages run at 64, 32, 16 and 8 pixels instead of 32 to 4, four times the work of a
    32x32 image. ImageNet's stem (7x7 convolution with stride 2 and max-pooling, He et al.) would
    bring the image down to 16x16 before the first stage, a quarter of the work but a quarter
    of the resolution; FL code bases train Tiny-ImageNet either way. This keeps the variant the
    other ResNet results in fedring come from.
    """

    name = "resnet18_gn_64"
    input_shape = (3, 64, 64)


@MODELS.register
class FemnistCNN(nn.Sequential):
    """LEAF's FEMNIST CNN (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018;
    ``models/femnist/cnn.py``): d = 6,603,710 parameters at LEAF's 62 classes.

    Conv(1->32, 5x5, "same" padding) + ReLU, MaxPool 2, Conv(32->64, 5x5, "same") + ReLU,
    MaxPool 2, Linear(3136->2048) + ReLU, Linear(2048->classes). The parameters are LEAF's
    TensorFlow layers' one for one: 832 + 51,264 + 6,424,576 + 2049 x classes. TensorFlow
    flattens the 7x7x64 maps channel-last and PyTorch channel-first, so the dense layer's inputs
    come in another order: the same network up to a permutation of that layer's weights. The
    initialisation is PyTorch's default, as for every model here (LEAF's is TensorFlow's
    Glorot-uniform kernels and zero biases).
    """

    name = "femnist_cnn"
    input_shape = (1, 28, 28)

    def __init__(self, classes: int = 62):
        super().__init__(
            nn.Conv2d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(7 * 7 * 64, 2048),
            nn.ReLU(),
            nn.Linear(2048, classes),
        )


#: LEAF's 80 characters (``fedring.datasets.leaf.SHAKESPEARE_LETTERS``): the tokens the LSTM embeds
SHAKESPEARE_TOKENS = 80


class LSTMLayer(nn.Module):
    r"""One layer of TensorFlow's ``BasicLSTMCell`` over a sequence, with its single bias.

    TensorFlow's cell computes the four gates from :math:`W [x_t; h_{t-1}] + b` with one bias
    :math:`b` of :math:`4h` entries: :math:`4 (n_{in} + h + 1) h` parameters. ``nn.LSTM`` adds
    two biases, :math:`b_{ih} + b_{hh}`, of which only the sum matters: :math:`4h` parameters
    more, that no client needs to send. So the layer is an ``nn.LSTM`` without biases fed
    :math:`[x_t; 1]`: the last column of its input weights is TensorFlow's :math:`b`, and the
    parameters are TensorFlow's count exactly. That column starts at TensorFlow's zeros, plus
    ``BasicLSTMCell``'s ``forget_bias = 1`` on the forget gate: TensorFlow adds that constant to
    the forget gate at every step, which is the same network as a bias that starts at 1 and the
    same gradient (the constant shifts the parameter, not the function's derivative; only
    ``weight_decay``, which pulls the parameter towards 0, tells them apart).
    """

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(inputs + 1, hidden, bias=False, batch_first=True)
        with torch.no_grad():  # torch's gate order is input, forget, cell, output
            bias = self.lstm.get_parameter("weight_ih_l0")[:, -1]
            bias.zero_()
            bias[hidden : 2 * hidden] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1))
        return out


@MODELS.register
class ShakespeareLSTM(nn.Module):
    """LEAF's Shakespeare character model (Caldas et al. 2018; ``models/shakespeare/stacked_lstm.py``):
    d = 817,872 parameters at LEAF's 80 classes, TensorFlow's count.

    Embedding(80 -> 8) of the 80 int64 tokens of a sample (B, 80), two stacked LSTM layers of
    256 units (:class:`LSTMLayer`: TensorFlow's ``BasicLSTMCell``, one bias per layer),
    Linear(256 -> classes) on the last step's output: 640 + 271,360 + 525,312 + 257 x classes.
    The initialisation is PyTorch's default (LEAF's is TensorFlow's Glorot-uniform), the biases
    TensorFlow's (:class:`LSTMLayer`).
    """

    name = "shakespeare_lstm"
    input_shape = (80,)

    def __init__(self, classes: int = 80):
        super().__init__()
        self.embedding = nn.Embedding(SHAKESPEARE_TOKENS, 8)
        self.lstm1 = LSTMLayer(8, 256)
        self.lstm2 = LSTMLayer(256, 256)
        self.out = nn.Linear(256, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.lstm2(self.lstm1(self.embedding(x)))
        return self.out(h[:, -1])


def samples(shape: tuple[int, ...]) -> str:
    """A sample shape as words: ``1x28x28`` images, or ``sequences of 80 tokens`` (a text data set's ``(80,)``)."""
    return f"sequences of {shape[0]} tokens" if len(shape) == 1 else "x".join(map(str, shape))


def make_model(name: str, seed: int, image_shape: tuple[int, ...] | None = None, classes: int = 10) -> nn.Module:
    """Build model ``name`` with ``classes`` outputs and PyTorch's default initialisation drawn from
    ``seed``; with ``image_shape``, check that the model takes samples of that shape.

    A model whose constructor has no ``classes`` parameter (a plugin written for 10 classes) is
    built as it is, and refused unless its output has ``classes`` columns: one forward pass of
    a zero sample (int64 tokens for a sequence model, whose ``input_shape`` has one entry).
    """
    cls = MODELS.get(name, "model")
    if image_shape is not None and tuple(image_shape) != cls.input_shape:
        fits = [m for m, c in MODELS.items() if c.input_shape == tuple(image_shape)]
        kind = "" if len(cls.input_shape) == 1 else " images"
        raise ConfigError(
            "model",
            f"{name} takes {samples(cls.input_shape)}{kind}, the data set has "
            f"{samples(tuple(image_shape))}: set model = {' or '.join(fits) or '(none fits)'}",
        )
    takes_classes = "classes" in inspect.signature(cls).parameters
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = cls(classes=classes) if takes_classes else cls()
    finally:
        torch.random.set_rng_state(gen_state)
    if not takes_classes:
        shape = cls.input_shape
        probe = torch.zeros((1, *shape), dtype=torch.int64 if len(shape) == 1 else torch.float32)
        model.eval()  # BatchNorm takes a batch of one, and its statistics stay as they are
        with torch.no_grad():
            outputs = model(probe).shape[-1]
        model.train()
        if outputs != classes:
            raise ConfigError(
                "model",
                f"{name} has {outputs} outputs, the data set has {classes} classes: "
                "give its constructor a parameter classes (docs/models.md)",
            )
    return model


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flatten(model: nn.Module) -> np.ndarray:
    """The parameters as one float32 vector, in ``model.parameters()`` order."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().astype(np.float32)


def load_flat(params: Iterable[torch.Tensor], vec: np.ndarray) -> None:
    """Set ``params`` (a model's parameters, in order) from a flat vector (the inverse of :func:`flatten`)."""
    torch.nn.utils.vector_to_parameters(torch.from_numpy(np.ascontiguousarray(vec, np.float32)), params)


def flat_grad_into(params: Iterable[torch.Tensor], out: np.ndarray) -> None:
    """Copy the gradients of ``params`` (a model's parameters, in order) into ``out`` (float32, length d)."""
    k = 0
    for p in params:
        m = p.numel()
        assert p.grad is not None, "called after backward(), which fills every parameter's gradient"
        out[k : k + m] = p.grad.numpy().reshape(-1)
        k += m
