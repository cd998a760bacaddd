"""What a round asks of a device, counted on CPU tensors (``benchmarks/device_ops.py``, and the
tests that a device round waits for its device only where it must).

Every operation that reaches PyTorch's dispatcher is counted (``TorchDispatchMode``), as a
*kernel* (a launch on a GPU), a *view*, or a *host read* (``aten._local_scalar_dense``:
``float()``, ``bool()`` or ``.item()`` of a tensor). *Copies* between host memory and the device
never reach the dispatcher on CPU tensors, so :func:`copies` counts them where they are made. On
a GPU a read, and a copy from pageable memory, waits for the device's queued work: a *wait*.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = "aten._local_scalar_dense"


class Counted(TorchDispatchMode):
    """Counts each operation that reaches the dispatcher, by name and kind, and the copies between
    host memory and tensors (:func:`copies`); ``waits`` lists the reads and copies of the round begun
    last (:meth:`new_round`), each as the number of the round's kernels queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()
        self.waits: list[int] = []
        self.start = 0

    def new_round(self) -> None:
        self.waits, self.start = [], self.kinds["kernels"]

    def wait(self, kind: str) -> None:
        self.kinds[kind] += 1
        self.waits.append(self.kinds["kernels"] - self.start)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.names[name] += 1
        if name == HOST_READ:
            self.wait("host reads")
        elif not crosses(name, args, kwargs or {}):  # a copy between devices is its host end's copy
            self.kinds["views" if func.is_view else "kernels"] += 1
        return func(*args, **(kwargs or {}))


def crosses(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the operation ``name`` copies between devices (host memory and a GPU's): on a GPU the
    copy of a tensor to or from host memory, which :func:`copies` counts where the host array is."""
    if name == "aten._to_copy":
        return kwargs.get("device") is not None and torch.device(kwargs["device"]).type != args[0].device.type
    if name == "aten.copy_":
        return args[0].device.type != args[1].device.type
    return False


@contextlib.contextmanager
def copies(counted: Counted):
    """While open, each tensor made from host data and each tensor's values taken into a numpy array
    (a view of at least one value: a CPU tensor's ``numpy()`` shares its memory, a GPU's copies it)
    is a wait of ``counted``'s, of kind "copies"."""
    makers = {name: getattr(torch, name) for name in ("from_numpy", "asarray", "as_tensor", "tensor")}
    to_numpy = torch.Tensor.numpy

    def made(make):
        def counted_make(data, *args, **kwargs):
            if not isinstance(data, torch.Tensor):
                counted.wait("copies")
            return make(data, *args, **kwargs)

        return counted_make

    def numpy(self, *args, **kwargs):
        if self.numel():
            counted.wait("copies")
        return to_numpy(self, *args, **kwargs)

    try:
        for name, make in makers.items():
            setattr(torch, name, made(make))
        torch.Tensor.numpy = numpy  # type: ignore[method-assign]
        yield
    finally:
        for name, make in makers.items():
            setattr(torch, name, make)
        torch.Tensor.numpy = to_numpy  # type: ignore[method-assign]


@contextlib.contextmanager
def counting():
    """A :class:`Counted` of the operations and copies made while open."""
    counted = Counted()
    with counted, copies(counted):
        yield counted


#: the kinds of what :class:`Counted` counts
KINDS = ("kernels", "views", "host reads", "copies")
