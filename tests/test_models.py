"""The models the robustness literature trains: sizes, shapes, and the seed's initialisation."""

import numpy as np
import pytest
import torch

from fedring.errors import ConfigError
from fedring.train.models import MODELS, flatten, make_model, n_parameters


@pytest.mark.parametrize(
    "name,shape,d",
    [
        ("mlp", (1, 28, 28), 784 * 100 + 100 + 100 * 10 + 10),
        (
            "lenet5",
            (1, 28, 28),
            (6 * 25 + 6) + (16 * 6 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10),
        ),
        # stem 1,728 + 2 x 128 norm; stages 147,968 / 525,568 / 2,099,712 / 8,393,728 (with their norms); fc 5,130
        ("resnet18_gn", (3, 32, 32), 11_173_962),
        ("resnet18", (3, 32, 32), 11_173_962),  # BatchNorm has GroupNorm's affine parameters
    ],
)
def test_model_sizes_and_outputs(name, shape, d):
    model = make_model(name, 0, shape)
    assert n_parameters(model) == d
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
    np.testing.assert_array_equal(flatten(model), flatten(make_model(name, 0, shape)))
    assert not np.array_equal(flatten(model), flatten(make_model(name, 1, shape)))


def test_resnet18_gn_is_the_cifar_variant_with_groupnorm_only():
    model = make_model("resnet18_gn", 0)
    stem = next(model.children())
    assert (stem.kernel_size, stem.stride, stem.padding) == ((3, 3), (1, 1), (1, 1))
    assert not any(isinstance(m, (torch.nn.MaxPool2d, torch.nn.BatchNorm2d)) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == 32 for m in norms) and not list(model.buffers())


def test_resnet18_has_the_batchnorm_buffers_of_its_20_norms():
    model = make_model("resnet18", 0)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    channels = 64 + 4 * 64 + (4 * 128 + 128) + (4 * 256 + 256) + (4 * 512 + 512)  # stem, stages, shortcuts
    assert len(norms) == 20 and sum(m.num_features for m in norms) == channels == 4800
    assert sum(b.numel() for b in model.buffers()) == 2 * channels + 20  # mean, variance; one counter each


def test_a_model_for_other_images_names_those_that_fit():
    assert {"mlp", "lenet5", "cnn"} <= {n for n, c in MODELS.items() if c.input_shape == (1, 28, 28)}
    with pytest.raises(
        ConfigError,
        match=r"^model: resnet18_gn takes 3x32x32 images, the data set has 1x28x28: "
        r"set model = cnn or cnn_bn or lenet5 or mlp$",
    ):
        make_model("resnet18_gn", 0, (1, 28, 28))
