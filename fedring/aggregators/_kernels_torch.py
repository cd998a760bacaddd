"""The kernels of :mod:`._kernels` on torch tensors, on the tensor's own device.

Imported by ``_kernels`` only when a tensor arrives (the host path never imports torch). The
kernels compute the quantities of their numpy twins, so a rule's small n x n logic is written
once, by one scheme: products in X's dtype on column blocks (pivot-centred for the Gram
matrix), sums across blocks in float64, integer-exact sign products. Where numpy's scheme
differs (its row norms square float64 copies of each block; its scaled mean sums row after
row) the results agree within the tolerances of docs/arrays.md, "Rules on the device". Blocks
are sized from :data:`DEVICE_BYTES`, so the extra device memory is a few blocks, whatever the
size of X. The small results (Gram matrices, row statistics, row quantiles) come back to the
host as the numpy arrays the numpy kernels return.

Float32 products here are full float32: TF32, which would round their inputs to 10 mantissa
bits, is off by default for matmul (``torch.backends.cuda.matmul.allow_tf32``) and fedring
never turns it on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from . import _blocks as host
from ._blocks import Gram, block_width, blocks

DEVICE_BYTES = 256 << 20  # working block of a pass on a device (a few such temporaries live at once):
# large, because each block is a few kernel launches and a launch costs as much as moving megabytes


def _width(X: torch.Tensor, rows: int | None = None) -> int:
    n, d = X.shape
    return min(d, block_width(n if rows is None else rows, X.element_size(), DEVICE_BYTES))


def _on(a, X: torch.Tensor) -> torch.Tensor:
    """``a`` (numpy or a tensor, any dtype) as a tensor on X's device, its dtype kept."""
    return torch.as_tensor(a, device=X.device)


def small(a, X: torch.Tensor) -> torch.Tensor:
    """The host array ``a`` in X's dtype on X's device: numpy's ``a.astype(X.dtype)``, cast on the host
    (half the bytes to move for a float64 ``a`` and float32 rows); a tensor ``a``, cast where it is."""
    if isinstance(a, torch.Tensor):
        return a.to(device=X.device, dtype=X.dtype)
    dtype = torch.empty(0, dtype=X.dtype).numpy().dtype
    return torch.as_tensor(np.asarray(a).astype(dtype, copy=False), device=X.device)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def pivot_row(X: torch.Tensor, chunks: int = 16, width: int = 128) -> int:
    """The numpy pivot of the same column sample, copied to the host (at most n x chunks x width values)."""
    n, d = X.shape
    if n <= 2:
        return 0
    if d <= chunks * width:
        return host.pivot_row(_numpy(X), chunks, width)
    starts = np.linspace(0, d - width, chunks).astype(np.int64)
    sample = torch.cat([X[:, s : s + width] for s in starts], dim=1)
    return host.pivot_row(_numpy(sample), chunks, width)  # d = chunks x width: the whole sample, as the host


#: columns of each product in :func:`products`
SPLIT = 8192


def products(B: torch.Tensor) -> torch.Tensor:
    """``B @ B.T`` in float64, from float32 products of ``SPLIT`` columns at a time summed in float64.

    With a few rows and a great many columns, one matrix product has a small output to spread
    over a GPU's cores; as a batch of products over column slices (a split over the shared
    dimension) it has many, and each partial sum is shorter."""
    m, w = B.shape
    c = w // SPLIT
    out = torch.zeros((m, m), dtype=torch.float64, device=B.device)
    if c:
        P = B[:, : c * SPLIT].unflatten(1, (c, SPLIT)).transpose(0, 1)  # (c, m, SPLIT) views of B
        out += torch.bmm(P, P.transpose(1, 2)).double().sum(dim=0)
    if c * SPLIT < w:
        rest = B[:, c * SPLIT :]
        out += (rest @ rest.T).double()
    return out


def gram_pass(X: torch.Tensor, extra, p: int, wide: bool) -> Gram:
    """One Gram pass of :func:`._kernels.gram` around row ``p`` on X's device, products in X's
    dtype or in float64 if ``wide``; C, h and pp come back in float64 numpy."""
    dtype = torch.float64 if wide else X.dtype
    ext = None if extra is None else _on(extra, X)
    n, d = X.shape
    k = 0 if ext is None else ext.shape[0]
    m = n + k
    width = _width(X, m)
    C = torch.zeros((m, m), dtype=torch.float64, device=X.device)
    h = torch.zeros(m, dtype=torch.float64, device=X.device)
    pp = torch.zeros((), dtype=torch.float64, device=X.device)
    buf = torch.empty((m, width), dtype=dtype, device=X.device)
    for sl in blocks(d, width):
        B = buf[:, : sl.stop - sl.start]
        piv = X[p, sl].to(dtype)
        torch.sub(X[:, sl].to(dtype), piv, out=B[:n])
        if ext is not None:
            B[n:] = ext[:, sl] - piv  # in the promoted dtype, then rounded to X's (numpy's casting="unsafe")
        C += products(B)  # full float32 products: TF32 stays off (module docstring)
        h += (B @ piv).double()
        pp += torch.dot(piv, piv).double()
    Cn = _numpy(C)
    return Gram(0.5 * (Cn + Cn.T), _numpy(h), float(pp))


def sqdist_to(X: torch.Tensor, v=None, idx: int | None = None) -> np.ndarray:
    """:func:`._kernels.sqdist_to` from the differences: per column block, each row's norm of
    ``row - target`` in X's dtype, squared and summed across blocks in float64 (a row whose float32
    squares overflow, taken again in float64 as in :func:`row_stats`). No n x n products: the Gram
    pass would spend n times the arithmetic for one row of its distances."""
    n, d = X.shape
    target = X[idx] if v is None else _on(v, X).to(X.dtype)
    d2 = torch.zeros(n, dtype=torch.float64, device=X.device)
    for sl in blocks(d, _width(X)):  # one (n, block) difference at a time
        d2 += torch.linalg.vector_norm(X[:, sl] - target[sl], dim=1).double() ** 2
    out = _numpy(d2)
    for i in np.flatnonzero(~np.isfinite(out)).tolist():
        diff = X[i].double() - target.double()
        out[i] = float(torch.dot(diff, diff))
    if idx is not None:
        out[idx] = 0.0
    return out


def combine(w, X: torch.Tensor, extra=None) -> torch.Tensor:
    """``w @ [X; extra]`` in X's dtype on X's device (w: (m,) or (k, m) host coefficients)."""
    n = X.shape[0]
    w = np.asarray(w, dtype=np.float64)
    out = small(w[..., :n], X) @ X
    if extra is not None and extra.shape[0]:
        out += small(w[..., n:], X) @ _on(extra, X).to(X.dtype)
    return out


def scaled_mean(X: torch.Tensor, scale: np.ndarray) -> torch.Tensor:
    """The mean of the rows, each multiplied by ``scale``: one product ``(scale / n) @ X`` in X's
    dtype (:func:`combine`), a single pass with no scaled copy."""
    return combine(np.asarray(scale, dtype=np.float64) / X.shape[0], X)


#: whether :func:`nonfinite_flags` reads each row's extremes, by where the rows are (keyed as
#: :data:`fedring.comm.network.PADDED_BYTES`): on a device (one pass, nothing read on the host), not
#: on the host's CPU (where ``aminmax`` takes many times the sum, and nothing runs ahead of the host)
BY_EXTREMES = {"host": False, "device": True}


def nonfinite_flags(X: torch.Tensor, extremes: bool | None = None) -> torch.Tensor:
    """As :func:`nonfinite_rows`, a bool tensor on X's device, with no read on the host by
    ``extremes`` (default :data:`BY_EXTREMES`): from each row's least and greatest values
    (``aminmax``, one pass), as a NaN propagates to both, an infinity is one of them and neither
    can overflow. Without, :func:`nonfinite_rows`, sum first, read on the host."""
    if extremes is None:
        extremes = BY_EXTREMES["host" if X.device.type == "cpu" else "device"]
    if not extremes:
        return torch.from_numpy(nonfinite_rows(X)).to(X.device)
    if X.shape[1] == 0:
        return torch.zeros(X.shape[0], dtype=torch.bool, device=X.device)
    lo, hi = torch.aminmax(X, dim=1)
    return lo * 0 + hi * 0 != 0  # x * 0 is zero for a finite x, NaN for a NaN or an infinity: 4 kernels


def nonfinite_rows(X: torch.Tensor) -> np.ndarray:
    """As numpy's :func:`._kernels.nonfinite_rows`: a row's sum is finite exactly when its values
    are, unless finite values overflow it, so one reduction of the rows (no mask of X) finds the
    suspects, and only those are checked value by value."""
    sums = _numpy(X.sum(dim=1))
    bad = np.zeros(X.shape[0], bool)
    for i in np.flatnonzero(~np.isfinite(sums)).tolist():
        bad[i] = not bool(torch.isfinite(X[i]).all())
    return bad


def row_stats(X: torch.Tensor, R=None) -> tuple[np.ndarray, np.ndarray | None]:
    """The squared row norms and dots of :func:`._kernels.row_stats` by the scheme of :func:`gram`:
    per column block, each row's norm (one reduction, no copy of the block) and its products with R
    in X's dtype, summed across blocks in float64; numpy squares a float64 copy of each block,
    which on a device would move three times the bytes of the pass.

    A row whose float32 squares or products overflow (entries beyond about 1e19, a Byzantine
    upload's) or whose squares underflow (as :func:`._kernels.sq_norms`) is taken again from a
    float64 copy of that row alone, so that it gets numpy's figures; a row holding NaN or an
    infinity stays non-finite either way."""
    n, d = X.shape
    Rt = None if R is None else _on(R, X).to(X.dtype)
    k = 0 if Rt is None else Rt.shape[0]
    sq = torch.zeros(n, dtype=torch.float64, device=X.device)
    dots = torch.zeros((n, k), dtype=torch.float64, device=X.device)
    for sl in blocks(d, _width(X, n + k)):
        B = X[:, sl]
        sq += torch.linalg.vector_norm(B, dim=1).double() ** 2
        if Rt is not None:
            dots += (B @ Rt[:, sl].T).double()
    sq_h, dots_h = _numpy(sq), _numpy(dots)
    info = torch.finfo(X.dtype)
    again = np.flatnonzero(~np.isfinite(sq_h) | ~np.isfinite(dots_h).all(axis=1) | (sq_h < d * info.tiny / info.eps))
    for i in again.tolist():
        row = X[i].double()
        sq_h[i] = float(torch.dot(row, row))
        if Rt is not None:
            dots_h[i] = _numpy(Rt.double() @ row)
    return sq_h, (dots_h if k else None)


def for_sorted_columns(X: torch.Tensor, fn: Callable, scale: np.ndarray | None = None) -> None:
    """``fn(columns, T)`` with T the (width, n) block of sorted columns, a tensor on X's device."""
    sc = None if scale is None else small(scale[:, None], X)
    for sl in blocks(X.shape[1], _width(X)):
        B = X[:, sl] if sc is None else X[:, sl].abs() * sc
        fn(sl, torch.sort(B.T, dim=1).values)


def map_columns(X: torch.Tensor, task: Callable[[list[slice]], object]) -> None:
    """Every column block in one call: the device queues the block's kernels, no worker threads."""
    task(list(blocks(X.shape[1], _width(X))))


def abs_row_quantiles(X: torch.Tensor, q: float) -> np.ndarray:
    """The exact order statistics of ``|X[i]|`` on the device, interpolated on the host as numpy does.

    They come from a sort of each row (a few rows at a time): ``torch.kthvalue`` has no
    deterministic CUDA implementation before torch 2.10, and a run on a GPU turns deterministic
    algorithms on (:func:`fedring.train.device.select`)."""
    n, d = X.shape
    pos = q * (d - 1)
    lo = int(np.floor(pos))
    frac = pos - lo
    hi = lo + 1 if frac > 0 and lo + 1 < d else lo
    out = np.empty(n)
    rows = max(1, DEVICE_BYTES // (d * X.element_size()))
    for r in range(0, n, rows):
        ranked = torch.sort(X[r : r + rows].abs(), dim=1).values
        lo_val = _numpy(ranked[:, lo]).astype(np.float64)
        hi_val = _numpy(ranked[:, hi]).astype(np.float64)
        out[r : r + rows] = [host.lerp_quantile(a, b, frac) for a, b in zip(lo_val, hi_val)]
    return out


def sign_gram(X: torch.Tensor) -> np.ndarray:
    """Exact: float32 products of signs, partial sums integers of at most 2^24 (TF32 would be exact too)."""
    n, d = X.shape
    acc = torch.zeros((n, n), dtype=torch.int64, device=X.device)
    for sl in blocks(d, min(d, block_width(n, 4, DEVICE_BYTES), 1 << 24)):
        S = torch.sign(X[:, sl]).float()
        acc += torch.round(products(S)).long()
    return _numpy(acc)


def column_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=0, dtype=torch.int32)


def column_sign_sum(B: torch.Tensor) -> torch.Tensor:
    return column_count(B > 0) - column_count(B < 0)


def signs(B: torch.Tensor, dtype) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype):
        dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    return torch.sign(B).to(dtype)


def sort_rows(M: torch.Tensor) -> torch.Tensor:
    return torch.sort(M, dim=1).values


def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """The float quotient is correctly rounded in num's dtype, as numpy's float64 quotient rounded to it."""
    return torch.where(den > 0, num / den, torch.zeros((), dtype=num.dtype, device=num.device))
