"""The array convention (docs/arrays.md): host arrays are numpy arrays, device arrays are torch
tensors, and the code that handles both (the communication layer, the rules' kernels, the
attacks) reaches them through the array API standard, by array-api-compat's namespace of the
array it is given, never by importing torch. A numpy array takes numpy's own functions, so the
host path keeps its bits.

Five things the standard leaves out are here: whether an array is in host memory
(:func:`on_host`), copies between a device array and a host buffer (:func:`host`,
:func:`host_into`, :func:`like`), an array made where another is, with no copy from host memory
(:func:`full`), and a strided view of a buffer (:func:`strided`), each written with the methods
both kinds of array have.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import array_namespace, device, is_torch_array, to_device

__all__ = ["array_namespace", "device", "full", "host", "host_into", "is_torch_array", "like", "on_host", "strided"]

#: an (n, d) or (d,) array of either kind
Array = Any


def on_host(x: Array) -> bool:
    """Whether ``x`` is a numpy array (the host path), not a tensor (on any device, the CPU included).

    >>> on_host(np.zeros(2))
    True
    """
    return isinstance(x, np.ndarray)


def host(x: Array) -> np.ndarray:
    """``x`` as a numpy array: itself on the host; a tensor's host copy (a CPU tensor's memory, shared).

    >>> host(np.arange(3)).tolist()
    [0, 1, 2]
    """
    if on_host(x):
        return x
    return np.asarray(to_device(x.detach(), "cpu"))


def host_into(x: Array, out: np.ndarray) -> None:
    """Copy ``x`` (either kind) into the host buffer ``out`` of the same shape: one copy (a tensor
    copies itself into a tensor that shares ``out``'s memory)."""
    if on_host(x):
        out[...] = x
        return
    array_namespace(x).asarray(out, copy=False).copy_(x.detach())


def like(a: np.ndarray, ref: Array) -> Array:
    """The host array ``a`` as an array of ``ref``'s kind, on ``ref``'s device: ``a`` itself when
    ``ref`` is a numpy array, else a copy (a CPU tensor shares ``a``'s memory)."""
    if on_host(ref):
        return a
    return array_namespace(ref).asarray(a, device=device(ref))


def full(shape: int | tuple[int, ...], value: float, ref: Array, dtype: Any = None) -> Array:
    """An array of ``ref``'s kind on ``ref``'s device, of ``shape`` and ``dtype`` (a numpy dtype;
    ``ref``'s by default), every element ``value``: made there by a fill, where :func:`like` of a
    host array would copy it from host memory (on a GPU such a copy waits for the device's queued
    work; a fill does not).

    >>> full((), 3, np.zeros(2, np.int64), np.float32)
    array(3., dtype=float32)
    """
    xp = array_namespace(ref)
    kind = ref.dtype if dtype is None else getattr(xp, np.dtype(dtype).name)  # the namespace's own dtype
    return xp.full(shape, value, dtype=kind, device=device(ref))


def strided(x: Array, shape: tuple[int, ...], offset: int, strides: tuple[int, ...]) -> Array:
    """A view of the contiguous buffer of ``x`` with ``shape``, starting ``offset`` elements in, with
    ``strides`` in elements: numpy's ``ndarray(buffer=...)`` on the host, the tensor's own
    ``as_strided`` on a device.

    >>> strided(np.arange(6), (2, 2), 1, (3, 1)).tolist()
    [[1, 2], [4, 5]]
    """
    if on_host(x):
        item = x.itemsize
        return np.ndarray(shape, x.dtype, x, offset * item, tuple(s * item for s in strides))
    return x.as_strided(shape, strides, x.storage_offset() + offset)
