"""Bit packing of :mod:`fedring.comm.brace`'s Share-Only bytes on torch tensors, on the tensor's device.

torch has no ``packbits``: these are numpy's ``packbits`` and ``unpackbits`` along the last axis
(big-endian bit order, a row's last byte padded with zero bits) written with shifts and sums on
uint8 tensors, so that a chunk packed on either kind is the same bytes. Imported by ``brace`` only
when a tensor arrives (``import fedring.comm`` does not import torch).
"""

from __future__ import annotations

import torch

__all__ = ["packbits", "unpackbits"]


def _shifts(device: torch.device) -> torch.Tensor:
    """Bit ``j`` of a byte (``j = 0`` the most significant) is ``(byte >> (7 - j)) & 1``."""
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """``numpy.packbits(bits, axis=-1)``: bools ``(..., s)`` -> uint8 ``(..., ceil(s / 8))``, MSB first.

    >>> packbits(torch.tensor([[True, False, True], [False] * 2 + [True]])).tolist()
    [[160], [32]]
    """
    *lead, size = bits.shape
    nbytes = -(-size // 8)
    padded = torch.zeros((*lead, 8 * nbytes), dtype=torch.uint8, device=bits.device)
    padded[..., :size] = bits
    # distinct bits: the sum of the eight shifted values is their OR, at most 255
    return (padded.view(*lead, nbytes, 8) << _shifts(bits.device)).sum(-1, dtype=torch.uint8)


def unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``numpy.unpackbits(packed, axis=-1, count=count).view(bool)``: uint8 ``(..., b)`` -> bools
    ``(..., count)``, ``count <= 8 b``, MSB first.

    >>> unpackbits(torch.tensor([160], dtype=torch.uint8), 3).tolist()
    [True, False, True]
    """
    *lead, nbytes = packed.shape
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.view(*lead, 8 * nbytes)[..., :count].bool()
