"""Generated layer-norm kernels, on CUDA, that write their planned buffers.

PyTorch's layer norm has no out= kernel (its out= overload computes, then copies), so a planned
layer norm took two kernels: the norm, then a copy into its arena buffer. `layer_norm(args, out)`
is the runtime's substitute for `aten::layer_norm` (`placed/substitutes.SUBSTITUTES`), one Triton
kernel of two:

- LAYER_NORM, where the input is dense in row-major order: one program per row, that reads the row
  once, computes its mean and variance in float32 and writes the normalised, scaled and shifted
  row straight into the planned buffer.
- LAYER_NORM_CHANNELS, where the input is a channels-first map seen with its channels last (x of
  shape (N, ..., C) normalised over C, with `x.movedim(-1, 1)` dense): ConvNeXt's
  `permute(0, 2, 3, 1)` then layer norm, in every block and before every downsampling, when the
  model runs in NCHW. PyTorch copies the permuted map to make it dense, normalises it, then copies
  the result into its buffer: three kernels. This one reads the map where it lies, a tile of
  channels by a run of positions at a time (the positions are the dense dimension, so the loads
  coalesce), reduces over the channels in float32 and writes the rows, channels last, into the
  planned buffer. The `channels_norm_kernel` setting off leaves it to PyTorch, for comparisons.

Weight and bias (where given) must be dense over the normalised shape, the buffer dense and of
the input's shape and dtype; anything else returns None and the op is computed and copied as
before. A row longer than `generated.MAX_NORM_ROW` elements (one program keeps it in registers),
or a channel count over CHANNELS_MAX, is left to PyTorch too. Indexing is 64-bit where an element
offset can pass 2**31 - 1.
"""

from __future__ import annotations

import math

import torch

from ..base import settings
from . import codegen
from . import generated

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

LAYER_NORM_CHANNELS = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, w_ptr, b_ptr, out_ptr, eps, P, TILES, C: tl.constexpr, HAS_W: tl.constexpr,
           HAS_B: tl.constexpr, WIDE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    image = pid // TILES
    p = (pid % TILES) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    mask = cm[:, None] & (p < P)[None, :]
    x = tl.load(x_ptr + image * C * P + c[:, None] * P + p[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / C
    d = tl.where(mask, x - mean[None, :], 0.0)
    var = tl.sum(d * d, axis=0) / C
    y = d * tl.rsqrt(var + eps)[None, :]
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        y = y + tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + (image * P + p[None, :]) * C + c[:, None], y, mask=mask)
'''

CHANNELS_MAX = 4096  # channels of one LAYER_NORM_CHANNELS tile (a program holds them for each of its positions)
CHANNELS_TILE = 8192  # elements of one LAYER_NORM_CHANNELS program's tile: channels times positions

_layer_norm = generated.FixedKernel(LAYER_NORM, "layer norm")
_channels = generated.FixedKernel(LAYER_NORM_CHANNELS, "layer norm over channels")


def channels_first(x: torch.Tensor, n: int) -> bool:
    """Whether `x` (N, ..., C), normalised over its last dimension of `n`, is a dense channels-first
    map seen with its channels last."""
    return x.dim() >= 3 and x.shape[-1] == n and not x.is_contiguous() and x.movedim(-1, 1).is_contiguous()


def channels_fit(norm: generated.NormAfter, x: torch.Tensor) -> bool:
    """Whether LAYER_NORM_CHANNELS computes `norm` of `x` into `norm.out`: `x` a channels-first map
    seen channels last, of the buffer's shape and dtype, at most CHANNELS_MAX channels; the buffer,
    weight and bias as the row kernel needs them (`NormAfter.fits` of the buffer itself)."""
    return (len(norm.shape) == 1 and norm.n <= CHANNELS_MAX and x.is_cuda and x.dtype == norm.out.dtype
            and tuple(x.shape) == tuple(norm.out.shape) and channels_first(x, norm.n) and norm.fits(norm.out))


def channels_launch(x: torch.Tensor, out: torch.Tensor, weight, bias, eps: float) -> tuple[tuple, tuple, dict]:
    """LAYER_NORM_CHANNELS's (grid, arguments, constants) for `x` (see `channels_first`) into `out`."""
    c = x.shape[-1]
    positions = math.prod(x.shape[1:-1])
    block_c = generated.triton_block(c)
    block_p = max(1, min(128, CHANNELS_TILE // block_c, generated.triton_block(positions)))
    tiles = -(-positions // block_p)
    grid = (x.shape[0] * tiles,)
    args = (x, x if weight is None else weight, x if bias is None else bias, out, float(eps), positions, tiles)
    constants = dict(C=c, HAS_W=weight is not None, HAS_B=bias is not None,
                     WIDE=x.numel() + block_c * block_p > codegen.INT32_LIMIT, BLOCK_C=block_c, BLOCK_P=block_p,
                     num_warps=8 if block_c * block_p >= 4096 else 4)
    return grid, args, constants


def layer_norm(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::layer_norm(input, normalized_shape, weight, bias, eps, ...) into `out`, or None where
    neither kernel applies (see the module docstring)."""
    if len(args) < 5:
        return None
    x, shape, weight, bias, eps = args[:5]
    norm = generated.NormAfter(tuple(shape), weight, bias, eps, out, store=False)
    if norm.fits(x):
        kernel = _layer_norm
        rows = x.numel() // norm.n
        block = generated.triton_block(norm.n)
        launch = ((rows,), (x, x if weight is None else weight, x if bias is None else bias, out, float(eps)),
                  dict(N=norm.n, HAS_W=weight is not None, HAS_B=bias is not None,
                       WIDE=x.numel() + block > codegen.INT32_LIMIT, BLOCK=block, num_warps=generated.row_warps(block)))
    elif channels_fit(norm, x) and settings.current().channels_norm_kernel:
        kernel = _channels
        launch = channels_launch(x, out, weight, bias, eps)
    else:
        return None
    if kernel.failed:
        return None
    if not x.numel():
        return out
    grid, launch_args, constants = launch
    return out if kernel.launch(grid, *launch_args, **constants) else None
