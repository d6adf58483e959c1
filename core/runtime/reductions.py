"""Generated kernels that reduce along rows, on CUDA: layer norm.

PyTorch's layer norm has no out= kernel (its out= overload computes, then copies), so a planned
layer norm took two kernels: the norm, then a copy into its arena buffer. `layer_norm(args, out)`
is the runtime's substitute for `aten::layer_norm` (`placement.SUBSTITUTES`): one Triton kernel,
one program per row, that reads the row once, computes its mean and variance in float32 and
writes the normalised, scaled and shifted row straight into the planned buffer.

It runs where the input and the buffer are dense in row-major order, and the weight and bias
(where given) dense over the normalised shape; anything else returns None and the op is computed
and copied as before. Rows longer than MAX_ROW are left to PyTorch too (a row lives in registers).
The source is fixed text compiled through `kernels.define` (cached and counted as every generated
kernel is); if Triton is missing or the kernel cannot be built, `kernels.STATS` records why and
PyTorch computes the op.

Indexing is 64-bit where an element offset can pass 2**31 - 1, as in `kernels.py`.
"""

from __future__ import annotations

import math
import time

import torch

from ..errors import first_line
from . import kernels

MAX_ROW = 2**14  # elements of one normalised row that one program keeps in registers
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

LAYER_NORM = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, w_ptr, b_ptr, out_ptr, eps, N: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
           WIDE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if WIDE:
        row = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    d = tl.where(mask, x - mean, 0.0)
    var = tl.sum(d * d, axis=0) / N
    y = d * tl.rsqrt(var + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, y, mask=mask)
'''

_UNBUILT = object()
_kernel = _UNBUILT  # the compiled LAYER_NORM, None where it could not be built


def layer_norm(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::layer_norm(input, normalized_shape, weight, bias, eps, ...) into `out`, or None where
    this kernel does not apply (see the module docstring)."""
    if len(args) < 5:
        return None
    x, shape, weight, bias, eps = args[:5]
    n = math.prod(shape)
    if not (x.is_cuda and out.is_cuda and x.dtype in FLOATS and out.dtype == x.dtype and 0 < n <= MAX_ROW
            and tuple(x.shape) == tuple(out.shape) and tuple(x.shape[x.dim() - len(shape):]) == tuple(shape)
            and x.is_contiguous() and out.is_contiguous()):
        return None
    for t in (weight, bias):
        if t is not None and not (t.is_cuda and t.dtype in FLOATS and t.numel() == n and t.is_contiguous()):
            return None
    global _kernel
    if _kernel is None:
        return None
    rows = x.numel() // n
    if not rows:
        return out
    first = _kernel is _UNBUILT
    t = time.perf_counter()
    try:  # the first launch builds and compiles: a failure there leaves the op to PyTorch
        if first:
            _kernel = kernels.define(LAYER_NORM)
        block = triton_block(n)
        _kernel[(rows,)](x, x if weight is None else weight, x if bias is None else bias, out, float(eps), N=n,
                         HAS_W=weight is not None, HAS_B=bias is not None,
                         WIDE=x.numel() + block > kernels.INT32_LIMIT, BLOCK=block,
                         num_warps=min(16, max(1, block // 256)))
    except Exception as e:
        if not first:
            raise
        kernels.STATS.fallbacks.append(f"layer norm: {type(e).__name__}: {first_line(e)}")
        _kernel = None
        return None
    finally:
        if first:
            kernels.STATS.seconds += time.perf_counter() - t
    return out


def triton_block(n: int) -> int:
    """The power of two at least `n` (and at least 16) that a row's program spans."""
    return max(16, 1 << (n - 1).bit_length())
