"""A fused op and the spatial mean of its result as one generated kernel, on CUDA.

Every squeeze-and-excitation block of efficientnet_b0 reads its depthwise convolution's SiLU
twice: the mean over height and width (adaptive_avg_pool2d to 1x1), then the multiply by the
excitation. Run apart, the SiLU's kernel writes the map and the mean's kernel reads all of it
back, one launch more per block; torch.compile fuses the two (its `..._mean_silu` reductions).
`pairs.mean_pairs` pairs a fused op with the spatial mean issued right after it on its stream, and
`run` computes both in one kernel (two where the positions are split into parts):

- it takes SPATIAL_MEAN's geometry (`reductions.mean_launches`): one program per image, tile of
  channels and run of positions, with runs of at least FUSED_MEAN_STEPS tiles, not the mean's
  own 8 (the kernel also reads and writes the map; with runs of 8, efficientnet_b0 took 0.494
  ms GPU-bound at batch 1 against 0.466, and 0.871 against 0.859 at batch 8; aiming at 8 or 16
  programs per multiprocessor instead of 2 changed nothing measurable);
- a leading convolution first writes the buffer without its bias, as for any generated body
  (`FusedKernel.lead`); each program then loads its tile of positions by channels, computes the
  body over it, stores it where anything but the mean reads it, and sums the stored values in
  float32;
- each program writes its channels' sum, scaled, into the mean's buffer, or where the positions
  are split into a float32 scratch that SPATIAL_MEAN's second launch sums in a fixed order.

With the `depthwise_mean_pairs` setting off, a depthwise convolution that the depthwise kernel
runs (`depthwise_conv.fits`) is not paired: that kernel computes the convolution with its body
and the mean runs apart. That builds no cuDNN plan at load: cuDNN's plan for each depthwise shape
takes about 53 ms on the H200 the first time in each process, and efficientnet_b0's warm load
falls from 3.6 to 0.8 s. But efficientnet_b0 then ran 11 % slower GPU-bound at batch 1 (0.382
against 0.345 ms on the H200) and the same at batch 8 (0.644 against 0.641 ms), so the pairs
stay on by default.

The mean is that of the values as stored, summed as SPATIAL_MEAN sums them over the same parts:
in a fixed order, so every run gives the same result. Where the whole body runs as one cuDNN
kernel, or the tensors do not fit (see `run`), the two ops run apart.

Index arithmetic is 64-bit where an offset can pass 2**31 - 1, as in `codegen.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import codegen, depthwise_conv, generated, reductions
from ..base import settings
from .fused import FusedKernel


@dataclass
class MeanAfter:
    """The spatial mean that reads a fused op's 4-D result: `out` its planned buffer ((N, C, 1, 1)
    or (N, C), the result's dtype), `store` whether anything else reads the fused result; `done`
    once a kernel wrote the mean."""

    out: torch.Tensor
    store: bool
    done: bool = False


def run(kernel: FusedKernel, body, out: torch.Tensor, mean: MeanAfter) -> torch.Tensor | None:
    """The fused op (`kernel`, its `body` as the runtime passes it) into `out`, with the mean of
    its result into `mean.out` where one kernel can do both (then `mean.done`). Returns the
    tensor that holds the op's result (where `mean.store`); None, with nothing written, where the
    op is to run as it would alone."""
    if not (out.is_cuda and mean.out.is_cuda and out.dim() == 4 and out.dtype in generated.FLOAT_KINDS):
        return None
    operands, conv = kernel.operands(body)
    if conv is not None and not settings.current().depthwise_mean_pairs and depthwise_conv.fits(conv, out):
        return None  # the depthwise kernel computes the convolution with its body; the mean runs apart
    whole = kernel.whole_on_cudnn(body, out)  # nothing runs where it returns None
    if whole is not None:
        return whole
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    launches = reductions.mean_launches(out, mean.out, sms, reductions.FUSED_MEAN_STEPS)
    if not launches:  # a layout no stride walks, or nothing to sum
        return None
    key = ("mean", tuple(out.shape), tuple(out.stride()), out.dtype, tuple(mean.out.shape),
           tuple(mean.out.stride()), mean.store, codegen.layouts(*operands))
    if kernel.declined(key) or not kernel.lead(conv, out):
        return None
    (grid, args, constants), rest = launches[0], launches[1:]
    bias = conv is not None and conv["bias"] is not None
    wide = constants["WIDE"] or codegen.needs_wide(out, operands)

    def build():
        return _launcher(source(body, out, operands, conv is not None, bias, mean.store, wide))

    if not kernel.launch(key, build, (grid, args, operands, {**constants, "WIDE": wide}), " with its mean"):
        return None
    if not reductions.launch_means(rest):  # the parts' sums, summed
        return None
    mean.done = True
    return out


def _launcher(text: str):
    kernel = generated.define(text)

    def launch(grid: tuple, args: tuple, operands: list[torch.Tensor], constants: dict) -> None:
        kernel[grid](*args, *operands, **constants)

    return launch


def source(body: list, out: torch.Tensor, operands: list[torch.Tensor], leads: bool, bias: bool, store: bool,
           wide: bool) -> str:
    """The kernel's text: SPATIAL_MEAN's arguments (`out` read as its x), then the operands; the
    body over each tile, stored in `out` where `store`, its float32 sum over the tile's positions
    kept per channel. With `leads`, `out` already holds the convolution (the bias, where `bias`,
    is the last operand)."""
    width = out.shape[3]
    lines = [*codegen.HEADER,
             "def kernel(x_ptr, out_ptr, C, S, ROWS, sxn, sxc, sxs, son, soc, sop, scale, "
             f"{codegen.pointers(operands)}"
             "WIDE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):",
             "    n = tl.program_id(0)",
             "    tile = tl.program_id(1)",
             "    part = tl.program_id(2)",
             "    if WIDE:",
             "        n = n.to(tl.int64)",
             "        tile = tile.to(tl.int64)",
             "        part = part.to(tl.int64)",
             "    cs = tile * BLOCK_C + tl.arange(0, BLOCK_C)",
             "    cmask = cs < C",
             "    acc = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)",
             "    first = part * ROWS",
             "    for start in range(0, ROWS, BLOCK_S):",
             "        step = start + tl.arange(0, BLOCK_S)",
             "        pos = first + step",
             "        mask = ((step < ROWS) & (pos < S))[:, None] & cmask[None, :]",
             "        o = n * sxn + pos[:, None] * sxs + cs[None, :] * sxc"]
    shape = tuple(out.shape)
    offsets = [tile_offset(shape, t.expand(shape).stride(), width) for t in operands]
    lines += codegen.epilogue_lines(body, operands, offsets, codegen.loaded("x_ptr + o") if leads else None, bias,
                                    " " * 8)
    lines.append(f"        stored = v{len(body) - 1}.to({codegen.TL_KINDS[out.dtype]})")
    if store:
        lines.append("        tl.store(x_ptr + o, stored, mask=mask)")
    lines += ["        acc += tl.where(mask, stored.to(tl.float32), 0.0)",
              "    tl.store(out_ptr + part * sop + n * son + cs * soc, tl.sum(acc, axis=0) * scale, mask=cmask)",
              f"# torch {torch.__version__}, wide {wide}"]
    return "\n".join(lines) + "\n"


def tile_offset(shape: tuple, strides: tuple, width: int) -> str:
    """The element offsets of a tile (`pos` by `cs`) of image `n` in a tensor of these strides,
    broadcast to `shape` (N, C, H, W): positions count along rows of `width`."""
    _, c, h, w = shape
    sn, sc, sh, sw = (s if d > 1 else 0 for d, s in zip(shape, strides))
    terms = [f"n * {sn}"] if sn else []
    terms.append(f"cs[None, :] * {sc}")  # always, with the positions' term: a whole tile of offsets
    if h == 1 or w == 1 or sh == width * sw:
        terms.append(f"pos[:, None] * {sw if w > 1 else sh}")
    else:
        terms.append(f"(pos[:, None] // {width}) * {sh} + (pos[:, None] % {width}) * {sw}")
    return " + ".join(terms)
