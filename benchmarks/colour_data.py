"""A plugin for benchmarks/peak_memory.sh: 32x32 colour images without files (``--dataset colour_data:Colour``).

``Synthetic``'s recipe (a fixed random pattern per class plus noise) at CIFAR-10's shape, so the
CIFAR models (``resnet18_gn``) run where CIFAR-10 is not installed; 2,000 training and 200 test images.
"""

from __future__ import annotations

from fedring.datasets.synthetic import Synthetic


class Colour(Synthetic):
    name = "colour"
    shape = (3, 32, 32)
    model = "resnet18_gn"

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir, n_train=2000, n_test=200)
