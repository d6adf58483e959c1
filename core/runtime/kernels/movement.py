"""Generated kernels that move elements into a planned buffer, on CUDA: roll.

`roll(args, out)` is the runtime's substitute for `aten::roll` over up to four dims of a tensor of
up to four (`placed/substitutes.SUBSTITUTES`). PyTorch rolls one dim at a time (a kernel and a temporary
per dim), and its out= overload then copies the result in: torchvision's Swin rolls each shifted
block's map over height and width twice, three kernels and two temporaries a roll. The kernel
reads each output element from its rolled place, `(i - shift) mod size` along every rolled dim,
any strides in, and writes it straight into the buffer: one kernel, no temporary. Other cases
(a roll of the flattened tensor, more than four dims, dtypes other than the floating ones) are
left to PyTorch. Indexing is 64-bit where an element offset can pass 2**31 - 1.
"""

from __future__ import annotations

import torch

from . import codegen
from . import generated

ROLL = '''import triton
import triton.language as tl


@triton.jit
def kernel(x_ptr, out_ptr, numel, S1, S2, S3, sx0, sx1, sx2, sx3, so0, so1, so2, so3, r0, r1, r2, r3, S0,
           WIDE: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0)
    if WIDE:
        start = start.to(tl.int64)
    idx = start * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    i3 = idx % S3
    rest = idx // S3
    i2 = rest % S2
    rest = rest // S2
    i1 = rest % S1
    i0 = rest // S1
    j0 = i0 - r0
    j0 = tl.where(j0 < 0, j0 + S0, j0)
    j1 = i1 - r1
    j1 = tl.where(j1 < 0, j1 + S1, j1)
    j2 = i2 - r2
    j2 = tl.where(j2 < 0, j2 + S2, j2)
    j3 = i3 - r3
    j3 = tl.where(j3 < 0, j3 + S3, j3)
    v = tl.load(x_ptr + j0 * sx0 + j1 * sx1 + j2 * sx2 + j3 * sx3, mask=mask)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, v, mask=mask)
'''
ROLL_BLOCK = 1024

_roll = generated.FixedKernel(ROLL, "roll")


def roll_launch(x: torch.Tensor, out: torch.Tensor, shifts, dims) -> tuple[tuple, dict] | None:
    """The arguments and constants of ROLL for `x` rolled into `out`, or None where `shifts` and
    `dims` are not one shift per named dim of a tensor of at most four dims."""
    if not isinstance(shifts, (list, tuple)) or not isinstance(dims, (list, tuple)) or not dims \
            or len(shifts) != len(dims) or not 1 <= x.dim() <= 4 \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shifts, *dims)):
        return None
    pad = 4 - x.dim()
    sizes = [1] * pad + list(x.shape)
    rolls = [0] * 4
    for shift, dim in zip(shifts, dims):
        if not -x.dim() <= dim < x.dim():
            return None
        d = pad + dim % x.dim()
        rolls[d] = (rolls[d] + shift) % sizes[d] if sizes[d] else 0
    sx = [0] * pad + list(x.stride())
    so = [0] * pad + list(out.stride())
    reach = max(sum((n - 1) * s for n, s in zip(t.shape, t.stride())) for t in (x, out))
    return ((x, out, out.numel(), *sizes[1:], *sx, *so, *rolls, sizes[0]),
            dict(WIDE=max(reach, out.numel()) + ROLL_BLOCK > codegen.INT32_LIMIT, BLOCK=ROLL_BLOCK))


def roll(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::roll(input, shifts, dims) into `out`, or None where this kernel does not apply."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not (x.is_cuda and out.is_cuda and x.dtype in generated.FLOAT_KINDS
                                               and out.dtype == x.dtype and tuple(x.shape) == tuple(out.shape)):
        return None
    launch = roll_launch(x, out, args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else ())
    if launch is None or _roll.failed:
        return None
    if not out.numel():
        return out
    arguments, constants = launch
    return out if _roll.launch((-(-out.numel() // ROLL_BLOCK),), *arguments, **constants, num_warps=4) else None
