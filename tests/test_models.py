"""The models the robustness literature trains: sizes, shapes, and the seed's initialisation; LEAF's
FEMNIST CNN and Shakespeare LSTM against the parameter counts of LEAF's TensorFlow layers."""

import numpy as np
import pytest
import torch

from fedring.errors import ConfigError
from fedring.train.models import MODELS, LSTMLayer, flatten, make_model, n_parameters


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
        r"set model = cnn or cnn_bn or femnist_cnn or lenet5 or mlp$",
    ):
        make_model("resnet18_gn", 0, (1, 28, 28))
    with pytest.raises(
        ConfigError,
        match=r"^model: mlp takes 1x28x28 images, the data set has sequences of 80 tokens: "
        r"set model = shakespeare_lstm$",
    ):
        make_model("mlp", 0, (80,))
    with pytest.raises(
        ConfigError, match=r"^model: shakespeare_lstm takes sequences of 80 tokens, the data set has 3x64x64"
    ):
        make_model("shakespeare_lstm", 0, (3, 64, 64))


# ---------------------------------------------------------------------------------------------
# the number of outputs


@pytest.mark.parametrize(
    "name,shape,last",
    [
        ("cnn", (1, 28, 28), 100),
        ("cnn_bn", (1, 28, 28), 100),
        ("mlp", (1, 28, 28), 100),
        ("lenet5", (1, 28, 28), 84),
        ("cnn_cifar", (3, 32, 32), 128),
        ("resnet18_gn", (3, 32, 32), 512),
        ("resnet18", (3, 32, 32), 512),
    ],
)
def test_the_outputs_are_the_classes_and_only_the_last_layer_changes(name, shape, last):
    """With 62 classes d grows by (last + 1) x 52, the last layer's new rows; every parameter before
    the last layer is drawn as at 10 classes (the layers are built in order from one seed), so the
    10-class model is the one of earlier releases (benchmarks/same_results.py checks its files)."""
    ten, more = make_model(name, 0, shape), make_model(name, 0, shape, classes=62)
    assert more(torch.zeros(2, *shape)).shape == (2, 62) and ten(torch.zeros(2, *shape)).shape == (2, 10)
    assert n_parameters(more) - n_parameters(ten) == (last + 1) * 52
    head = n_parameters(ten) - (last + 1) * 10
    np.testing.assert_array_equal(flatten(ten)[:head], flatten(more)[:head])


def test_a_model_without_a_classes_parameter_is_built_as_is_and_checked(monkeypatch):
    """A plugin's model written for 10 classes (tests/bn_mlp.py, with BatchNorm: probed in eval mode)."""
    from bn_mlp import BatchNormMLP

    monkeypatch.setitem(MODELS._classes, "bn_mlp", BatchNormMLP)
    model = make_model("bn_mlp", 0, (1, 28, 28), classes=10)
    assert model.training and int(model[2].num_batches_tracked) == 0  # the probe left it as built
    with pytest.raises(
        ConfigError,
        match=r"^model: bn_mlp has 10 outputs, the data set has 62 classes: give its constructor a parameter classes",
    ):
        make_model("bn_mlp", 0, (1, 28, 28), classes=62)


# ---------------------------------------------------------------------------------------------
# LEAF's models: the parameters of its TensorFlow layers, counted from models/femnist/cnn.py and
# models/shakespeare/stacked_lstm.py (TalwalkarLab/leaf at 09ec454)


def tf_conv2d(k: int, c_in: int, c_out: int) -> int:
    """``tf.layers.conv2d``: a k x k x c_in x c_out kernel and c_out biases."""
    return k * k * c_in * c_out + c_out


def tf_dense(n_in: int, n_out: int) -> int:
    """``tf.layers.dense``: an n_in x n_out kernel and n_out biases."""
    return n_in * n_out + n_out


def tf_basic_lstm(n_in: int, hidden: int) -> int:
    """``rnn.BasicLSTMCell(hidden)``: a kernel [n_in + hidden, 4 hidden] and one bias [4 hidden]."""
    return 4 * (n_in + hidden + 1) * hidden


def test_femnist_cnn_has_leaf_tensorflow_parameter_count():
    # conv 5x5 32 ("same"), pool, conv 5x5 64, pool, dense 2048, dense num_classes = 62
    leaf = tf_conv2d(5, 1, 32) + tf_conv2d(5, 32, 64) + tf_dense(7 * 7 * 64, 2048) + tf_dense(2048, 62)
    assert leaf == 832 + 51_264 + 6_424_576 + 127_038 == 6_603_710
    model = make_model("femnist_cnn", 0, (1, 28, 28), classes=62)
    assert n_parameters(model) == leaf
    assert [tuple(p.shape) for p in model.parameters()] == [
        (32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (2048, 3136), (2048,), (62, 2048), (62,)
    ]  # fmt: skip
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 62)


def test_shakespeare_lstm_has_leaf_tensorflow_parameter_count():
    # embedding [num_classes = 80, 8], two BasicLSTMCell(256), dense(256 -> 80); seq_len 80
    leaf = 80 * 8 + tf_basic_lstm(8, 256) + tf_basic_lstm(256, 256) + tf_dense(256, 80)
    assert leaf == 640 + 271_360 + 525_312 + 20_560 == 817_872
    model = make_model("shakespeare_lstm", 0, (80,), classes=80)
    assert n_parameters(model) == leaf
    # torch's own nn.LSTM keeps two bias vectors per layer: 2 x 4 x 256 parameters more than TensorFlow's
    torch_lstm = n_parameters(torch.nn.LSTM(8, 256, num_layers=2))
    assert torch_lstm - (tf_basic_lstm(8, 256) + tf_basic_lstm(256, 256)) == 2 * 4 * 256
    tokens = torch.randint(0, 80, (4, 80), generator=torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and model(tokens).shape == (4, 80)


def test_lstm_layer_is_tensorflow_basic_lstm_cell():
    """The layer against TensorFlow's ``BasicLSTMCell`` written out (tensorflow/python/ops/rnn_cell_impl.py:
    ``i, j, f, o = split(concat([x, h]) @ kernel + bias, 4)``, ``c' = c sigmoid(f + forget_bias) +
    sigmoid(i) tanh(j)``, ``h' = tanh(c') sigmoid(o)``, forget_bias 1), its kernel and bias read
    from the layer's weights (torch's gates are i, f, g = j, o; the bias is W_ih's last column,
    TensorFlow's bias plus forget_bias on the f rows). Agreement to float32 rounding (1e-5 over 6
    steps of values below 1 in magnitude)."""
    torch.manual_seed(3)
    h_dim, n_in = 5, 3
    layer = LSTMLayer(n_in, h_dim)
    with torch.no_grad():  # a bias that is not the initial one, so that every column is exercised
        layer.lstm.weight_ih_l0[:, -1] += torch.linspace(-0.5, 0.5, 4 * h_dim)
    w_ih = layer.lstm.weight_ih_l0.detach().double().numpy()
    w_hh = layer.lstm.weight_hh_l0.detach().double().numpy()
    gates = dict(zip("ifjo", np.split(np.arange(4 * h_dim), 4)))  # torch's row blocks: i, f, g (= j), o
    tf_order = np.concatenate([gates[g] for g in "ijfo"])
    kernel = np.concatenate([w_ih[:, :n_in], w_hh], axis=1)[tf_order].T  # [n_in + h, 4h], TensorFlow's layout
    bias = w_ih[tf_order, -1].copy()
    bias[2 * h_dim : 3 * h_dim] -= 1.0  # TensorFlow adds forget_bias = 1 to f at run time

    x = torch.randn(2, 6, n_in)
    got = layer(x).detach().double().numpy()
    h, c = np.zeros((2, h_dim)), np.zeros((2, h_dim))
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for t in range(6):
        i, j, f, o = np.split(np.concatenate([x[:, t].double().numpy(), h], axis=1) @ kernel + bias, 4, axis=1)
        c = c * sigmoid(f + 1.0) + sigmoid(i) * np.tanh(j)
        h = np.tanh(c) * sigmoid(o)
        np.testing.assert_allclose(got[:, t], h, atol=1e-5)


def test_lstm_bias_starts_as_tensorflow_with_forget_bias_one():
    model = make_model("shakespeare_lstm", 0, (80,))
    for layer in (model.lstm1, model.lstm2):
        assert layer.lstm.weight_ih_l0[:, -1].tolist() == [0.0] * 256 + [1.0] * 256 + [0.0] * 512
        assert not any("bias" in name for name, _ in layer.named_parameters())


def test_resnet18_gn_64_takes_tiny_imagenet():
    model = make_model("resnet18_gn_64", 0, (3, 64, 64), classes=200)
    assert n_parameters(model) == 11_173_962 - (512 + 1) * 10 + (512 + 1) * 200 == 11_271_432
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 200)
