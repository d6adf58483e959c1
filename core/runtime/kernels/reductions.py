"""Generated kernels that reduce, on CUDA: max and average pooling over windows, and the mean over
a feature map's height and width (the layer norms are `norms.py`'s).

`max_pool2d(args, out)` is the substitute for `aten::max_pool2d`. On CUDA, PyTorch computes it
as max_pool2d_with_indices and drops the indices: it allocates the result and an int64 index per
element (three times the result's bytes in float32) and then copies the result into its buffer.
Those temporaries are what gave every stream that pools its own 20 MiB segment in the CUDA graph's
memory pool. The kernel writes the maximum of each window straight into the planned buffer, one
element per lane, in the buffer's own order (NCHW or channels_last), any strides in; a NaN in a
window is the result, as in PyTorch. It covers 4-D floating inputs and windows of at most
`max_pool_window` taps; anything else is left to PyTorch.

`avg_pool2d(args, out)`, the substitute for `aten::avg_pool2d`, is the same kernel summing each
window in float32 and dividing as PyTorch does (by the window's size clipped to the padded map,
by the taps inside the map without count_include_pad, or by divisor_override). PyTorch's own
kernel is slow in channels_last, the layout every conv net runs fastest in otherwise: on
inception_v3 at batch 8 on the H200, eight of its 3x3 average pools took 0.36 ms of kernel time
per inference in channels_last and 0.24 in NCHW, of the model's 1.55 ms in channels_last
(`benchmarks/results/layout_bound_2026-11-28.md`); both are far from what moving the map once
through memory costs. The `average_pool_kernel` setting off leaves average pooling to PyTorch, for comparisons.

`spatial_mean(x, out)` is the mean of each image's channel over its height and width: global
average pooling (`aten::adaptive_avg_pool2d` to 1x1, the squeeze of every squeeze-and-excitation
block) and `aten::mean.dim` over the last two dimensions of a 4-D tensor. PyTorch's reduction
kernel takes 9 to 21 us for each of efficientnet_b0's at batch 8 in channels_last, where the
channels are the dense dimension. Each program of SPATIAL_MEAN sums a tile of channels over a
run of positions in float32, reading whole rows of the dense dimension (channels in
channels_last, positions in NCHW). Where the images times channel tiles make too few programs to
fill the GPU (a large map with few channels), the positions are split into parts of at least
MEAN_STEPS tiles each: the same kernel writes each part's scaled sum to a float32 scratch
tensor, then sums the parts into the result, so the sum's order is fixed (no atomics) and the
result the same on every run. On efficientnet_b0 at batch 8 the 17 means took 0.153 ms of kernel
time per inference, and take 0.087 (`benchmarks/results/kernel_diff_mean.md`).

Indexing is 64-bit where an element offset can pass 2**31 - 1, as in `kernels.py`.
"""

from __future__ import annotations

import torch

from . import codegen
from . import generated
from ..base import settings


POOL = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, out_ptr, numel, C, H, W, OH, OW, sxn, sxc, sxh, sxw, son, soc, soh, sow, KH: tl.constexpr,
           KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
           DH: tl.constexpr, DW: tl.constexpr, AVG: tl.constexpr, COUNT_PAD: tl.constexpr, DIVISOR: tl.constexpr,
           CHANNELS_LAST: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
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
    if AVG:
        acc = tl.zeros([BLOCK], tl.float32)
    else:
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PH + kh * DH
        for kw in tl.static_range(KW):
            iw = ow * SW - PW + kw * DW
            inside = mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            if AVG:
                acc += tl.load(base + ih * sxh + iw * sxw, mask=inside, other=0.0).to(tl.float32)
            else:
                v = tl.load(base + ih * sxh + iw * sxw, mask=inside, other=float("-inf")).to(tl.float32)
                acc = tl.where((v > acc) | (v != v), v, acc)
    if AVG:
        if DIVISOR > 0:
            acc = acc / DIVISOR
        else:
            hs = oh * SH - PH
            ws = ow * SW - PW
            he = tl.where(hs + KH < H + PH, hs + KH, H + PH)
            we = tl.where(ws + KW < W + PW, ws + KW, W + PW)
            if not COUNT_PAD:
                hs = tl.where(hs > 0, hs, 0)
                ws = tl.where(ws > 0, ws, 0)
                he = tl.where(he < H, he, H)
                we = tl.where(we < W, we, W)
            acc = acc / ((he - hs) * (we - ws)).to(tl.float32)
    tl.store(out_ptr + n * son + c * soc + oh * soh + ow * sow, acc, mask=mask)
'''
POOL_BLOCK = 512

SPATIAL_MEAN = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, out_ptr, C, S, ROWS, sxn, sxc, sxs, son, soc, sop, scale, WIDE: tl.constexpr,
           BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    n = tl.program_id(0)
    tile = tl.program_id(1)
    part = tl.program_id(2)
    if WIDE:
        n = n.to(tl.int64)
        tile = tile.to(tl.int64)
        part = part.to(tl.int64)
    cs = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cs < C
    acc = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    first = part * ROWS
    for start in range(0, ROWS, BLOCK_S):
        step = start + tl.arange(0, BLOCK_S)
        pos = first + step
        m = ((step < ROWS) & (pos < S))[:, None] & cmask[None, :]
        acc += tl.load(x_ptr + n * sxn + pos[:, None] * sxs + cs[None, :] * sxc, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + part * sop + n * son + cs * soc, tl.sum(acc, axis=0) * scale, mask=cmask)
'''
MEAN_TILE = 2048  # elements each program sums per step (BLOCK_S x BLOCK_C)
MEAN_STEPS = 8  # the fewest steps of a part, where the positions are split
# the same where each part also computes and stores the fused op the mean reads (`fused_mean.py`):
# it reads and writes the map, so a shorter part pays for its launch
FUSED_MEAN_STEPS = 2


_pool = generated.FixedKernel(POOL, "pooling")
_spatial_mean = generated.FixedKernel(SPATIAL_MEAN, "spatial mean")


def pool_params(args: list, dilated: bool = True) -> tuple[list[int], ...] | None:
    """The (kernel, stride, padding, dilation) of aten::max_pool2d (or, not `dilated`, of
    aten::avg_pool2d, whose dilation is 1), each as two ints, as PyTorch reads them (an empty
    stride means the kernel's), or None where they are not that, not what PyTorch accepts (a
    positive kernel, stride and dilation, padding from 0 to half the kernel), or a window of more
    than `max_pool_window` taps. PyTorch then runs the op, and refuses what it refuses."""
    kernel, stride, padding = (list(args[k]) if k < len(args) and isinstance(args[k], (list, tuple))
                               else d for k, d in ((1, None), (2, []), (3, [0])))
    dilation = list(args[4]) if dilated and len(args) > 4 and isinstance(args[4], (list, tuple)) else [1]
    if kernel is None:
        return None
    params = [kernel, stride or kernel, padding, dilation]
    params = [p * 2 if len(p) == 1 else p for p in params]
    if not all(len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p) for p in params):
        return None
    (kh, kw), stride, (ph, pw), dilation = params
    if min(kh, kw, *stride, *dilation) < 1 or min(ph, pw) < 0 or 2 * ph > kh or 2 * pw > kw \
            or kh * kw > settings.current().max_pool_window:
        return None
    return tuple(params)


def pool_launch(x: torch.Tensor, out: torch.Tensor, params, average: tuple[bool, int] | None = None) \
        -> tuple[tuple, dict]:
    """The arguments and constants of POOL for `x` pooled into `out`: the maximum of each window,
    or with `average` (count_include_pad, divisor: 0 for none) the mean, as aten::avg_pool2d
    divides it."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = params
    _, c, h, w = x.shape
    oh, ow = out.shape[2:]
    channels_last = out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    reach = max(sum((d - 1) * s for d, s in zip(t.shape, t.stride())) for t in (x, out))
    count_pad, divisor = average or (True, 0)
    return ((x, out, out.numel(), c, h, w, oh, ow, *x.stride(), *out.stride()),
            dict(KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, AVG=average is not None,
                 COUNT_PAD=count_pad, DIVISOR=divisor, CHANNELS_LAST=channels_last,
                 WIDE=max(reach, out.numel()) + POOL_BLOCK > codegen.INT32_LIMIT, BLOCK=POOL_BLOCK))


def _pooled(x, out: torch.Tensor, params, average: tuple[bool, int] | None = None) -> torch.Tensor | None:
    """`x` pooled into `out` by POOL, or None where it does not apply: not 4-D floating CUDA tensors
    of one dtype with the same images and channels, or the kernel cannot be built."""
    if params is None or _pool.failed or not (isinstance(x, torch.Tensor) and x.is_cuda and out.is_cuda
                                              and x.dim() == 4 and out.dim() == 4 and x.dtype in generated.FLOAT_KINDS
                                              and out.dtype == x.dtype and x.shape[:2] == out.shape[:2]):
        return None
    if not out.numel():
        return out
    args, constants = pool_launch(x, out, params, average)
    return out if _pool.launch((-(-out.numel() // POOL_BLOCK),), *args, **constants, num_warps=4) else None


def max_pool2d(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode) into `out` (whose
    shape already holds the ceil_mode rule), or None where this kernel does not apply."""
    return _pooled(args[0] if args else None, out, pool_params(args))


def avg_pool2d(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
    divisor_override) into `out` (whose shape already holds the ceil_mode rule), or None where
    this kernel does not apply (a divisor that is not a positive int among them)."""
    count_pad = args[5] if len(args) > 5 else True
    divisor = args[6] if len(args) > 6 else None
    if not settings.current().average_pool_kernel or not isinstance(count_pad, bool) \
            or divisor is not None and not (type(divisor) is int and 0 < divisor < 2**31):
        return None
    return _pooled(args[0] if args else None, out, pool_params(args, dilated=False), (count_pad, divisor or 0))


def spatial_mean(x, out: torch.Tensor) -> torch.Tensor | None:
    """The mean of 4-D `x` over its last two dimensions into `out` (shape (N, C, 1, 1) or (N, C),
    x's dtype), or None where this kernel does not apply: not CUDA, not floating, or a height and
    width that no single stride walks (a view neither NCHW- nor channels_last-dense)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and out.is_cuda) or _spatial_mean.failed:
        return None
    launches = mean_launches(x, out, torch.cuda.get_device_properties(x.device).multi_processor_count)
    return out if launches is not None and launch_means(launches) else None


def leading_sum(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::sum.dim_IntList(x, dims, keepdim) into `out` where `dims` are x's leading dimensions:
    a bias's gradient, the sum of (rows, C) over its rows, which PyTorch's reduction kernel takes
    40 us for at vit_b_16's 6304 x 768 in bf16 on an H200 (49 of them a step). Its step took 0.35 ms
    less on one stream, 0.08 on its 4, where the sums overlap the weights' GEMMs (2026-11-30). None
    where it does not apply (`sum_launches`; not CUDA)."""
    x = args[0] if args else None
    if not (isinstance(x, torch.Tensor) and x.is_cuda and out.is_cuda) or _spatial_mean.failed:
        return None
    launches = sum_launches(x, args[1] if len(args) > 1 else None, out,
                            torch.cuda.get_device_properties(x.device).multi_processor_count)
    return out if launches is not None and launch_means(launches) else None


def sum_launches(x: torch.Tensor, dims, out: torch.Tensor, sms: int) -> list[tuple[tuple, tuple, dict]] | None:
    """The launches of SPATIAL_MEAN that write the sum of contiguous `x` over its leading
    dimensions `dims` into contiguous `out`: one image of C channels (the trailing dimensions'
    elements) at `rows` positions (the leading ones'), channels dense, with no scale. None where
    that is not the op (other dimensions; a dtype of the op's own, so that `out`'s differs)."""
    if not (x.is_contiguous() and out.is_contiguous() and x.dim() >= 2 and isinstance(dims, (list, tuple)) and dims):
        return None
    lead = sorted(d % x.dim() if type(d) is int and -x.dim() <= d < x.dim() else -1 for d in dims)
    if lead != list(range(len(lead))) or len(lead) >= x.dim():
        return None
    rows, cols = x.shape[:len(lead)].numel(), x.shape[len(lead):].numel()
    if out.numel() != cols or out.dtype != x.dtype:
        return None
    flat = x.as_strided((1, cols, rows, 1), (rows * cols, 1, cols, 1))
    return mean_launches(flat, out.view(1, cols), sms, scale=1.0)


def launch_means(launches: list[tuple[tuple, tuple, dict]]) -> bool:
    """Run SPATIAL_MEAN's `launches` (`mean_launches`) in order; False where it cannot be built."""
    return all(_spatial_mean.launch(grid, *args, **constants) for grid, args, constants in launches)


def mean_launches(x: torch.Tensor, out: torch.Tensor, sms: int, steps: int = MEAN_STEPS,
                  scale: float | None = None) -> list[tuple[tuple, tuple, dict]] | None:
    """The launches of SPATIAL_MEAN (grid, arguments, constants) that write the mean of `x` over
    its last two dimensions into `out` (the sum times `scale`, where given), on a GPU of `sms`
    multiprocessors; None where the kernel does not apply. Two launches where the positions are
    split into parts (see the module docstring), none shorter than `steps` tiles: the first into a
    float32 scratch tensor that the second reads."""
    if not (x.dim() == 4 and x.dtype in generated.FLOAT_KINDS and out.dtype == x.dtype
            and tuple(out.shape) in ((*x.shape[:2], 1, 1), tuple(x.shape[:2]))):
        return None
    n, c, h, w = x.shape
    if w == 1:
        sxs = x.stride(2)
    elif h == 1 or x.stride(2) == w * x.stride(3):
        sxs = x.stride(3)
    else:
        return None
    positions = h * w
    scale = 1.0 / max(positions, 1) if scale is None else scale
    if not out.numel() or not positions:
        return None if out.numel() else []  # the mean of nothing is NaN: PyTorch's to give
    son, soc = out.stride(0), out.stride(1)
    block_c = min(64, generated.triton_block(c)) if x.stride(1) == 1 and c > 1 else min(16, generated.triton_block(c))
    block_s = max(1, min(MEAN_TILE // block_c, generated.triton_block(positions)))
    tiles = -(-c // block_c)
    # two programs per multiprocessor, but no part shorter than `steps` steps: a second launch
    # costs more than a short sum
    parts = max(1, min(-(-positions // (block_s * steps)), -(-2 * sms // (n * tiles))))
    rows = -(-(-(-positions // parts)) // block_s) * block_s  # each part's positions, whole steps
    parts = -(-positions // rows)
    reach = sum((d - 1) * st for d, st in zip(x.shape, x.stride())) + rows + MEAN_TILE
    wide = max(reach, parts * n * c + MEAN_TILE) > codegen.INT32_LIMIT
    warps = 8 if block_s * block_c >= MEAN_TILE else 4
    first = dict(WIDE=wide, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=warps)
    if parts == 1:
        return [((n, tiles, 1), (x, out, c, positions, rows, x.stride(0), x.stride(1), sxs, son, soc, 0,
                                 scale), first)]
    partial = torch.empty((parts, n, c), dtype=torch.float32, device=x.device)
    block_c = min(64, generated.triton_block(c))  # the parts' sums: channels dense, parts n * c apart
    second = dict(WIDE=wide, BLOCK_C=block_c, BLOCK_S=max(1, min(MEAN_TILE // block_c, generated.triton_block(parts))),
                  num_warps=4)
    return [((n, tiles, parts), (x, partial, c, positions, rows, x.stride(0), x.stride(1), sxs, c, 1, n * c,
                                 scale), first),
            ((n, -(-c // block_c), 1), (partial, out, c, parts, parts, c, 1, n * c, son, soc, 0, 1.0), second)]
