"""A model with BatchNorm statistics that costs next to nothing to train, for the tests of buffers
(checkpointed, kept per client, resumed) that need not train the CNN: ``--model bn_mlp:BatchNormMLP``
(``conftest.mpi_env`` puts tests/ on the ranks' path). Flatten, Linear(784->16), BatchNorm1d(16),
ReLU, Linear(16->10): d = 12,762 parameters and 33 buffer entries (the running mean and variance
of 16 features, and the batch counter)."""

from torch import nn


class BatchNormMLP(nn.Sequential):
    name = "bn_mlp"
    input_shape = (1, 28, 28)

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
