"""Generated kernels that reduce, on CUDA: layer norm along rows, and max pooling over windows.

PyTorch's layer norm has no out= kernel (its out= overload computes, then copies), so a planned
layer norm took two kernels: the norm, then a copy into its arena buffer. `layer_norm(args, out)`
is the runtime's substitute for `aten::layer_norm` (`placement.SUBSTITUTES`): one Triton kernel,
one program per row, that reads the row once, computes its mean and variance in float32 and
writes the normalised, scaled and shifted row straight into the planned buffer.

It runs where the input and the buffer are dense in row-major order, and the weight and bias
(where given) dense over the normalised shape; anything else returns None and the op is computed
and copied as before. Rows longer than `kernels.MAX_NORM_ROW` are left to PyTorch too (a row lives in registers).
The source is fixed text compiled through `kernels.define` (cached and counted as every generated
kernel is); if Triton is missing or the kernel cannot be built, `kernels.STATS` records why and
PyTorch computes the op.

`max_pool2d(args, out)` is the substitute for `aten::max_pool2d`. On CUDA, PyTorch computes it
as max_pool2d_with_indices and drops the indices: it allocates the result and an int64 index per
element (three times the result's bytes in float32) and then copies the result into its buffer.
Those temporaries are what gave every stream that pools its own 20 MiB segment in the CUDA graph's
memory pool. The kernel writes the maximum of each window straight into the planned buffer, one
element per lane, in the buffer's own order (NCHW or channels_last), any strides in; a NaN in a
window is the result, as in PyTorch. It covers 4-D floating inputs; anything else is left to
PyTorch.

Indexing is 64-bit where an element offset can pass 2**31 - 1, as in `kernels.py`.
"""

from __future__ import annotations

import time

import torch

from ..errors import first_line
from . import kernels


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

MAX_POOL = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, out_ptr, numel, C, H, W, OH, OW, sxn, sxc, sxh, sxw, son, soc, soh, sow, KH: tl.constexpr,
           KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
           DH: tl.constexpr, DW: tl.constexpr, CHANNELS_LAST: tl.constexpr, WIDE: tl.constexpr,
           BLOCK: tl.constexpr):
    start = tl.program_id(0)
    if WIDE:
        start = start.to(tl.int64)
    idx = start * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    if CHANNELS_LAST:
        c = idx % C
        rest = idx // C
        ow = rest % OW
        rest = rest // OW
        oh = rest % OH
        n = rest // OH
    else:
        ow = idx % OW
        rest = idx // OW
        oh = rest % OH
        rest = rest // OH
        c = rest % C
        n = rest // C
    base = x_ptr + n * sxn + c * sxc
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PH + kh * DH
        for kw in tl.static_range(KW):
            iw = ow * SW - PW + kw * DW
            inside = mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(base + ih * sxh + iw * sxw, mask=inside, other=float("-inf")).to(tl.float32)
            acc = tl.where((v > acc) | (v != v), v, acc)
    tl.store(out_ptr + n * son + c * soc + oh * soh + ow * sow, acc, mask=mask)
'''
POOL_BLOCK = 512

class FixedKernel:
    """A kernel of fixed source, built on its first launch through `kernels.define` (cached and
    counted as every generated kernel is). Where that first launch fails, `kernels.STATS` records
    why and every launch declines from then on, so PyTorch computes the op."""

    def __init__(self, source: str, what: str):
        self.source, self.what, self.kernel, self.failed = source, what, None, False

    def launch(self, grid: tuple, *args, **constants) -> bool:
        """Run it over `grid`; False where it cannot be built."""
        if self.failed:
            return False
        first = self.kernel is None
        t = time.perf_counter()
        try:
            if first:
                self.kernel = kernels.define(self.source)
            self.kernel[grid](*args, **constants)
        except Exception as e:
            if not first:
                raise
            kernels.STATS.fallbacks.append(f"{self.what}: {type(e).__name__}: {first_line(e)}")
            self.failed = True
            return False
        finally:
            if first:
                kernels.STATS.seconds += time.perf_counter() - t
        return True


_layer_norm = FixedKernel(LAYER_NORM, "layer norm")
_max_pool = FixedKernel(MAX_POOL, "max pooling")


def layer_norm(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::layer_norm(input, normalized_shape, weight, bias, eps, ...) into `out`, or None where
    this kernel does not apply (see the module docstring)."""
    if len(args) < 5:
        return None
    x, shape, weight, bias, eps = args[:5]
    norm = kernels.NormAfter(tuple(shape), weight, bias, eps, out, store=False)
    if not norm.fits(x) or _layer_norm.failed:
        return None
    rows = x.numel() // norm.n
    if not rows:
        return out
    block = kernels.triton_block(norm.n)
    done = _layer_norm.launch((rows,), x, x if weight is None else weight, x if bias is None else bias, out,
                              float(eps), N=norm.n, HAS_W=weight is not None, HAS_B=bias is not None,
                              WIDE=x.numel() + block > kernels.INT32_LIMIT, BLOCK=block,
                              num_warps=kernels.row_warps(block))
    return out if done else None


def pool_params(args: list) -> tuple[list[int], ...] | None:
    """aten::max_pool2d's (kernel, stride, padding, dilation), each as two ints, as PyTorch reads
    them (an empty stride means the kernel's), or None where they are not that."""
    kernel, stride, padding, dilation = (list(args[k]) if k < len(args) and isinstance(args[k], (list, tuple))
                                         else d for k, d in ((1, None), (2, []), (3, [0]), (4, [1])))
    if kernel is None:
        return None
    params = [kernel, stride or kernel, padding, dilation]
    params = [p * 2 if len(p) == 1 else p for p in params]
    if not all(len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p) for p in params):
        return None
    return tuple(params)


def pool_launch(x: torch.Tensor, out: torch.Tensor, params) -> tuple[tuple, dict]:
    """The arguments and constants of MAX_POOL for `x` pooled into `out`."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = params
    _, c, h, w = x.shape
    oh, ow = out.shape[2:]
    channels_last = out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    reach = max(sum((d - 1) * s for d, s in zip(t.shape, t.stride())) for t in (x, out))
    return ((x, out, out.numel(), c, h, w, oh, ow, *x.stride(), *out.stride()),
            dict(KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, CHANNELS_LAST=channels_last,
                 WIDE=max(reach, out.numel()) + POOL_BLOCK > kernels.INT32_LIMIT, BLOCK=POOL_BLOCK))


def max_pool2d(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode) into `out` (whose
    shape already holds the ceil_mode rule), or None where this kernel does not apply."""
    x = args[0] if args else None
    params = pool_params(args) if isinstance(x, torch.Tensor) else None
    if params is None or not (x.is_cuda and out.is_cuda and x.dim() == 4 and out.dim() == 4
                              and x.dtype in kernels.FLOAT_KINDS and out.dtype == x.dtype and x.shape[:2] == out.shape[:2]):
        return None
    if _max_pool.failed:
        return None
    if not out.numel():
        return out
    args, constants = pool_launch(x, out, params)
    return out if _max_pool.launch((-(-out.numel() // POOL_BLOCK),), *args, **constants, num_warps=4) else None
