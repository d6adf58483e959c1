"""A depthwise convolution and the body after it, as one generated kernel.

mobilenet_v2's 17 blocks each convolve every channel alone (3x3, stride 1 or 2) and clip the
result (bias, relu6). PyTorch runs the convolution as its own kernel (cuDNN's or its depthwise
one), and nimble's generated epilogue then reads the whole map back and writes it again: two
launches, and the map crosses memory twice. cuDNN offers no fused plan for these bodies that is
as fast (`benchmarks/results/cudnn_graph_b8_sweep.md`). Here each program computes a tile of
output positions by channels of a channels_last result: for each tap of the filter it loads the
input tile (channels are contiguous, so loads coalesce; neighbouring taps hit the cache), adds
its product with the tap's weights in float32, then runs the rest of the body
(`codegen.epilogue_lines`) and stores the tile once.

The result must be channels_last (the layout nimble's tuning picks for mobilenet and
efficientnet), tiled with its channels side by side. An NCHW result (ConvNeXt's 7x7 depthwise
convolutions) stays with cuDNN: a tiling of one image's channel per program, its positions side
by side, made convnext_tiny's inference at batch 8 1.78 x slower on the H200 (4.73 against 2.65
ms, torch 2.11, `tools/setting_ab.py`, 2026-11-30), and was removed. The `depthwise_kernel`
setting off turns the kernel off, for comparisons.

A filter of more than WIDE_TAPS taps (ConvNeXt's 7x7) is run by this kernel or by cuDNN's
convolution (the body's generated epilogue after it, where there is one), whichever was measured
faster on the call's first run outside a capture (`Wide`), and the choice is kept in the cache
folder (`recall`): on the H200 cuDNN's channels_last depthwise kernel took 0.099 ms for
convnext_tiny's 18 at batch 1 against this kernel's 0.187 (2026-12-01). Smaller filters
(mobilenet's, efficientnet's) keep this kernel untimed: it carries their epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codegen import (HEADER, INT32_LIMIT, TL_KINDS, body_signature, epilogue_lines, finish, flat_offsets, layouts,
                      needs_wide, pointers, program_id, span)
from . import recall
from ..base import settings, timing

TILE = 2048  # output elements of one program
WIDE_TAPS = 25  # filters of more taps than this (5x5) get smaller tiles where there are few (`blocks`)
PROGRAMS = 1024  # ... down to this many programs
SMALL_BLOCK = 16


@dataclass(frozen=True)
class Prologue:
    """The epilogue of the fused op whose result a depthwise convolution reads, applied by this
    kernel as it loads that result, which then holds the op's convolution alone, without its bias
    (`pairs.prologue_pairs`): `body` that op's body as the runtime passes it, `operands` the
    tensors its nodes after the convolution read, the convolution's bias last where `bias`."""

    body: list
    operands: tuple
    bias: bool

    def signature(self) -> tuple:
        """What the kernel's text depends on: each node's target and constants (which operand each
        tensor argument is), the operands' shapes, strides and dtypes, and the bias."""
        return body_signature(self.body[1:], self.operands), layouts(*self.operands), self.bias


def fits(p: dict, out: torch.Tensor) -> bool:
    """Whether convolution `p` (`fusion.conv_params`, tensors in place) is one this kernel runs:
    2-D, each channel convolved alone (groups = input channels = output channels), float operands
    of one dtype, a filter of at most `max_depthwise_taps` positions, and `out` its result in
    channels_last."""
    x, w, bias = p["input"], p["weight"], p["bias"]
    if not (settings.current().depthwise_kernel and out.is_cuda and x.dim() == 4 and w.dim() == 4 and out.dim() == 4):
        return False
    channels = x.shape[1]
    if not (p["groups"] == channels == w.shape[0] and w.shape[1] == 1 and out.shape[1] == channels) \
            or w.shape[2] * w.shape[3] > settings.current().max_depthwise_taps or channels == 0:
        return False
    if out.dtype not in TL_KINDS or x.dtype != out.dtype or w.dtype != out.dtype \
            or bias is not None and bias.dtype != out.dtype:
        return False
    n, _, h, width = x.shape
    for d, size in enumerate((h, width)):
        span = (w.shape[2 + d] - 1) * p["dilation"][d] + 1
        if out.shape[2 + d] != (size + 2 * p["padding"][d] - span) // p["stride"][d] + 1:
            return False
    if out.shape[0] != n or out.numel() == 0:
        return False
    return out.is_contiguous(memory_format=torch.channels_last)


class Wide:
    """Per call signature of a filter of more than WIDE_TAPS taps, whether this kernel runs it or
    cuDNN's convolution does: measured on the signature's first call outside a capture (a call
    first seen inside one runs this kernel, as a smaller filter does), kept in the cache folder
    for later loads."""

    def __init__(self):
        self._chosen: dict[tuple, bool] = {}

    @staticmethod
    def applies(w: torch.Tensor) -> bool:
        """Whether a filter of this shape is chosen for, not run by this kernel untimed."""
        return w.shape[2] * w.shape[3] > WIDE_TAPS

    def kernel_runs(self, key: tuple, out: torch.Tensor, kernel, apart) -> bool:
        """Whether this call runs this kernel: `kernel()` runs it into `out` (False where it fails
        to build), `apart()` runs cuDNN's convolution and the rest of the body into `out`. The
        caller then runs the chosen way."""
        if key in self._chosen:
            return self._chosen[key]
        if torch.cuda.is_current_stream_capturing():
            return True
        setting = (key, torch.backends.cudnn.allow_tf32)
        kept = (recall.recalled("depthwise", setting, out.device) or {}).get("kernel")
        if isinstance(kept, bool):
            self._chosen[key] = kept
            return kept
        with timing.on_stream(out.device):
            faster = kernel() and timing.graph_us(kernel, out.device) <= timing.graph_us(apart, out.device)
        self._chosen[key] = faster
        recall.keep("depthwise", setting, out.device, {"kernel": faster})
        return faster


def blocks(channels: int, positions: int = 0, taps: int = 1) -> tuple[int, int]:
    """(positions, channels) of one program's tile of a channels_last result: the widest power of
    two up to 64 that divides the channels (else the next power of two above them, up to 64), and
    positions to fill TILE. A filter of more than WIDE_TAPS taps over few positions gets smaller
    tiles (positions first, then channels, down to SMALL_BLOCK each) until there are PROGRAMS of
    them: ConvNeXt's 7x7 convolutions at batch 1 made 48 to 147 programs of 2048 outputs, each
    walking 49 taps, and took 18 us each against cuDNN's 5.5 (H200, convnext_tiny, 2026-12-01)."""
    block_c = next((b for b in (64, 32, 16, 8) if channels % b == 0), min(64, 1 << (channels - 1).bit_length()))
    block_p = TILE // block_c
    if taps > WIDE_TAPS:
        while -(-positions // block_p) * -(-channels // block_c) < PROGRAMS \
                and max(block_p, block_c) > SMALL_BLOCK:
            if block_p > SMALL_BLOCK:
                block_p //= 2
            else:
                block_c //= 2
    return block_p, block_c


def prologue_fits(before: Prologue, x: torch.Tensor) -> bool:
    """Whether `before`'s epilogue can be applied to `x` (its bare convolution) as this kernel loads
    it: every tensor it reads is a float of x's dtype that varies along the channels alone."""
    for t in before.operands:
        try:
            strides = t.expand(x.shape).stride()
        except RuntimeError:
            return False
        if t.dtype not in TL_KINDS or t.device != x.device \
                or any(strides[d] and x.shape[d] > 1 for d in (0, 2, 3)):
            return False
    return True


def source(body: list, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor],
           bias: bool, p: dict, before: Prologue | None = None) -> str:
    """The kernel's text. `body` is the op's body as the runtime passes it; `operands` the tensors
    its other nodes read, the convolution's bias last where `bias`; `p` the convolution's
    parameters. With `before`, `x` holds the bare convolution of the fused op that made it
    (`prologue_fits`), whose epilogue each tap applies as it loads: a padding tap is zero after
    the epilogue, as it would be in that op's result."""
    n, c, oh, ow = out.shape
    h, width = x.shape[2:]
    extra = list(before.operands) if before is not None else []
    wide = needs_wide(out, operands + extra) or max(span(x), span(w)) > INT32_LIMIT  # the inputs may be views
    first = program_id(wide)
    out_offset, offsets = flat_offsets(out, operands)
    (sh, sw), (ph, pw), (dh, dw) = p["stride"], p["padding"], p["dilation"]
    xs, ws = x.stride(), w.stride()
    prologue: list[str] = []
    if before is not None:
        given = {k: f"cin{k}" for k in range(len(extra))}
        prologue = [*epilogue_lines(before.body, extra, [""] * len(extra), "xv.to(tl.float32)", before.bias,
                                    indent=" " * 12, given=given, prefix="p"),
                    f"            xv = tl.where(inside[:, None] & cmask[None, :], pv{len(before.body) - 1}, 0.0)"]
    channel_loads = [f"    cin{k} = tl.load(pin{k}_ptr + c * {t.expand(x.shape).stride(1)}, mask=cmask, "
                     "other=0.0).to(tl.float32)[None, :]" for k, t in enumerate(extra)]
    index = [f"    p = {first} * BLOCK_P + tl.arange(0, BLOCK_P)",  # positions by channels, channels side by side
             "    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)",
             f"    pmask = p < {n * oh * ow}",
             f"    cmask = c < {c}",
             f"    img = p // {oh * ow}",
             f"    oh = (p // {ow}) % {oh}",
             f"    ow = p % {ow}"]
    flat = f"    i = p[:, None] * {c} + c[None, :]"  # the flat index in out's memory order
    address = f"img * {xs[0]} + ih * {xs[2]} + iw * {xs[3]}"
    lines = [*HEADER,
             f"def kernel(out_ptr, x_ptr, w_ptr, {pointers(operands)}"
             + "".join(f"pin{k}_ptr, " for k in range(len(extra)))
             + "BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):",
             *index,
             "    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)",
             *channel_loads,
             f"    for kh in tl.static_range({w.shape[2]}):",
             f"        ih = oh * {sh} - {ph} + kh * {dh}",
             f"        for kw in tl.static_range({w.shape[3]}):",
             f"            iw = ow * {sw} - {pw} + kw * {dw}",
             f"            inside = pmask & (ih >= 0) & (ih < {h}) & (iw >= 0) & (iw < {width})",
             f"            xv = tl.load(x_ptr + ({address})[:, None] + c[None, :] * {xs[1]},",
             "                         mask=inside[:, None] & cmask[None, :], other=0.0)",
             *prologue,
             f"            wv = tl.load(w_ptr + c * {ws[0]} + kh * {ws[2]} + kw * {ws[3]}, mask=cmask, other=0.0)",
             "            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]",
             flat,
             "    mask = pmask[:, None] & cmask[None, :]",
             f"    o = {out_offset}"]
    return finish(lines, body, out, operands, offsets, "acc", bias)


def grid(out: torch.Tensor, taps: int) -> tuple[tuple[int, int], int, int]:
    """(the grid, BLOCK_P, BLOCK_C) of `source`'s kernel for `out` and a filter of `taps`
    positions: tiles of positions by channels (`blocks`)."""
    n, c, oh, ow = out.shape
    block_p, block_c = blocks(c, n * oh * ow, taps)
    return (-(-(n * oh * ow) // block_p), -(-c // block_c)), block_p, block_c


def launcher(kernel):
    """A launcher for `source`'s kernel (as `generated.define` returns it)."""
    def launch(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor]) -> None:
        shape, block_p, block_c = grid(out, w.shape[2] * w.shape[3])
        kernel[shape](out, x, w, *operands, BLOCK_P=block_p, BLOCK_C=block_c)

    return launch
