"""A 1x1 convolution that computes its input as it loads it: the elementwise op before it, the
convolution and the body after it, as one generated kernel.

densenet121's 58 dense layers and 3 transitions each apply batch norm and ReLU to the
concatenation of every feature map before them, and a 1x1 convolution alone reads the result.
efficientnet_b0's 16 blocks scale each channel of their map by its squeeze-and-excitation weight
(add, sigmoid, mul), and a 1x1 convolution alone reads that. nimble ran the elementwise op as a
kernel of its own that writes the whole map, which the convolution then read back: two launches,
and the map crossed memory twice. Here the convolution runs as a matrix product over the
channels_last map (rows: the positions; columns: the output channels; summed: the input
channels). For each block of input channels a program loads the elementwise op's inputs where
they lie (each part of a leading cat in a loop of its own), applies its body
(`codegen.epilogue_lines`), multiplies the block with the filter's and accumulates in float32;
then it applies the convolution's body and stores its tile once. The elementwise op's own buffer
is never written. The same kernel also runs a 1x1 convolution with nothing before it, reading
its input as it lies (`Before.alone`), where cuDNN does not take its body whole (efficientnet's
expansions with SiLU, mobilenet's with ReLU6, projections with a residual add: the convolution
and a generated epilogue before), chosen the same way (`FusedKernel._pointwise`).

`memory.read_later` names the pairs at compile time, and the memory plan holds the elementwise
op's inputs until the convolution (`memory.held_inputs`). `pairs.input_pairs` takes a pair at
load where the convolution is the next op on the elementwise op's stream, waits for no other, and
the plan proves that it holds those inputs. On a call signature's first call outside a capture,
`Choices.tile` builds the kernel with each of its `tiles`, checks it against the two ops run apart
(the `pointwise_tolerance` setting) and times it beside them in a CUDA graph: the fastest runs where it takes at most
`pointwise_slower` of their time, else the two run apart. The choice is kept in the cache folder (`recall`):
a later load checks the tile kept and times nothing. Products are TF32 where cuDNN's convolutions are
(`torch.backends.cudnn.allow_tf32`, PyTorch's default), else three TF32 products each
(float32's accuracy, as `gemm.py`). Only channels_last results qualify (`fits`).

Triton's TF32 products drop the 13 low bits of each float32 operand: every operand moves toward
zero, so the errors lean one way and add up over the sum. cuDNN rounds to the nearest TF32 value.
With `ROUND_TF32` each operand is rounded so first (`cvt.rna.tf32.f32`, one instruction per value
loaded): resnet50 at batch 1, whose 14x14 residual convolutions run here, differed from eager by
2.4e-3 of its largest output with truncation, against 1.9e-4 with cuDNN's convolutions (H200,
`benchmarks/results/tf32_rounding_2026-11-27.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import recall
from ..base import timing
from .codegen import (HEADER, INT32_LIMIT, TL_KINDS, body_signature, epilogue_lines, finish, flat_offsets, layouts,
                      overlaps, program_id, span)
from ..base import settings

ROUND_TF32 = True  # float32 operands rounded to the nearest TF32 value before TF32 products, as cuDNN's
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the tiles a call may time; `tiles` picks two (each
# costs a build at load: densenet121 has 61 pairs)
TILES = ((64, 128, 32, 4, 3), (64, 64, 32, 4, 3), (64, 32, 32, 4, 3), (32, 64, 32, 4, 3), (32, 32, 32, 4, 3))


def tiles(rows: int, cols: int) -> tuple[tuple, ...]:
    """The tiles a call of `rows` positions and `cols` output channels times: the widest that
    spans the output channels (up to 128) with 64 rows, and one of 32 rows and at most 64
    channels, which makes more programs where positions are few (densenet's last block)."""
    width = min(128, max(32, 1 << (cols - 1).bit_length()))
    return (next(t for t in TILES if t[:2] == (64, width)), next(t for t in TILES if t[:2] == (32, min(64, width))))


@dataclass(frozen=True)
class Before:
    """The elementwise op whose result the convolution reads, as the runtime passed it: `body`
    its nodes with tensors in place of Refs, `out` its planned buffer (the convolution's input;
    not written where the kernel runs), `pieces` the parts of a cat that leads it (else none), and
    `operands` the distinct tensors its other nodes read. `alone` makes one without a body: the
    convolution reads its input as it lies."""

    body: tuple
    out: torch.Tensor
    pieces: tuple
    operands: tuple

    @staticmethod
    def alone(x: torch.Tensor) -> Before:
        """No elementwise op: the input `x` read as it lies, as the one part of a cat."""
        return Before((), x, (x,), ())

    def signature(self) -> tuple:
        """What the kernel's text depends on in this op: each node's target and constants (which
        operand each tensor argument is), and the pieces' and operands' shapes, strides and dtypes."""
        return body_signature(self.body, self.operands), layouts(self.out, *self.pieces, *self.operands)


def fits(p: dict, out: torch.Tensor, before: Before) -> bool:
    """Whether convolution `p` (`fusion.conv_params`, tensors in place) over `before`'s result is
    one this kernel runs: 1x1, stride 1, no padding, one group; input, filter, result and every
    part of a leading cat of one float dtype, the result dense in channels_last; the parts laid
    side by side along the channels; every operand of `before` broadcast to its result; and the
    result clear of everything the kernel reads (the memory plan holds those until the
    convolution; a plan from before that rule may not)."""
    x, w = p["input"], p["weight"]
    if not (settings.current().pointwise_kernel
            and out.is_cuda and isinstance(x, torch.Tensor) and layouts(x) == layouts(before.out)
            and x.data_ptr() == before.out.data_ptr() and w.dim() == 4 and out.dim() == 4 and x.dim() == 4):
        return False
    n, channels, h, width = x.shape
    if tuple(w.shape[1:]) != (channels, 1, 1) or p["groups"] != 1 or tuple(p["stride"]) != (1, 1) \
            or tuple(p["padding"]) != (0, 0) or tuple(out.shape) != (n, w.shape[0], h, width) or out.numel() == 0:
        return False
    if out.dtype not in TL_KINDS or w.dtype != out.dtype or x.dtype != out.dtype \
            or p["bias"] is not None and p["bias"].dtype != out.dtype \
            or not out.is_contiguous(memory_format=torch.channels_last):
        return False
    if before.pieces and (sum(t.shape[1] for t in before.pieces) != channels or any(
            t.dim() != 4 or t.dtype != out.dtype or t.device != out.device
            or (t.shape[0], t.shape[2], t.shape[3]) != (n, h, width) for t in before.pieces)):
        return False
    for t in before.operands:
        try:
            t.expand(x.shape)
        except RuntimeError:
            return False
        if t.dtype not in TL_KINDS or t.device != out.device:
            return False
    return not overlaps(out, [w, *before.pieces, *before.operands])


def _row_offset(t: torch.Tensor, shape) -> str:
    """The offset, in `t` broadcast to `shape` (the convolution's input), of each row's position:
    its image and its place in the map (`img`, `hw`, `hh`, `ww` in the kernel)."""
    s = t.expand(shape).stride()
    terms = [f"img * {s[0]}"] if s[0] and shape[0] > 1 else []
    if s[2] == shape[3] * s[3]:  # height and width dense together
        terms += [f"hw * {s[3]}"] if s[3] and shape[2] * shape[3] > 1 else []
    else:
        terms += [f"hh * {s[2]}"] if s[2] and shape[2] > 1 else []
        terms += [f"ww * {s[3]}"] if s[3] and shape[3] > 1 else []
    return " + ".join(terms) or "img * 0"


def source(body: list, out: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor], bias: bool,
           before: Before, tile: tuple = TILES[0]) -> str:
    """The kernel's text (`fits` must hold). `body` is the convolution's op body as the runtime
    passes it; `operands` the tensors its other nodes read, the convolution's bias last where
    `bias`; `before` the elementwise op whose body each block of the input goes through."""
    x = before.out
    shape = tuple(x.shape)
    n, channels, h, width = shape
    rows, cols = n * h * width, out.shape[1]
    block_m, block_n = tile[:2]
    tiles_n = -(-cols // block_n)
    wide = any(span(t) > INT32_LIMIT for t in (out, w, *before.pieces)) \
        or any(span(t.expand(shape)) > INT32_LIMIT for t in before.operands) \
        or any(span(t.expand(out.shape)) > INT32_LIMIT for t in operands) \
        or (-(-rows // block_m) * block_m + 1) * cols > INT32_LIMIT
    kind = TL_KINDS[out.dtype]
    precision = "tf32" if torch.backends.cudnn.allow_tf32 else "tf32x3"
    parts = [f"x{j}_ptr" for j in range(len(before.pieces))]
    extra = list(before.operands)
    lines = [*HEADER,
             f"def kernel(out_ptr, w_ptr, {''.join(f'in{k}_ptr, ' for k in range(len(operands)))}"
             + "".join(f"{q}, " for q in parts) + "".join(f"pin{k}_ptr, " for k in range(len(extra)))
             + "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):",
             f"    tile = {program_id(wide)}",
             f"    rows = tile // {tiles_n} * BLOCK_M + tl.arange(0, BLOCK_M)",
             f"    cols = tile % {tiles_n} * BLOCK_N + tl.arange(0, BLOCK_N)",
             "    inner = tl.arange(0, BLOCK_K)",
             f"    rmask = rows < {rows}",
             f"    cmask = cols < {cols}",
             f"    img = rows // {h * width}",
             f"    hw = rows % {h * width}",
             f"    hh = hw // {width}",
             f"    ww = hw % {width}",
             "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)"]
    given = {}
    for k, t in enumerate(extra):
        s = t.expand(shape).stride()
        if any(s[d] and shape[d] > 1 for d in (0, 2, 3)):
            lines.append(f"    prow{k} = {_row_offset(t, shape)}")
            given[k] = f"tl.load(pin{k}_ptr + prow{k}[:, None] + ch[None, :] * {s[1]}, mask=mask, " \
                       "other=0.0).to(tl.float32)"
        else:  # one value per channel
            given[k] = f"tl.load(pin{k}_ptr + ch * {s[1]}, mask=kmask, other=0.0).to(tl.float32)[None, :]"
    prologue = epilogue_lines(list(before.body), extra, [""] * len(extra), "xv" if before.pieces else None, False,
                              indent=" " * 8, given=given, prefix="p") if before.body else []
    last = f"pv{len(before.body) - 1}" if before.body else "xv"  # `alone`: the input as it lies
    product = [f"        a = tl.where(mask, {last}, 0.0).to({kind})",
               f"        b = tl.load(w_ptr + ch[:, None] * {w.stride(1)} + cols[None, :] * {w.stride(0)}, "
               "mask=kmask[:, None] & cmask[None, :], other=0.0)",
               *(tf32_rounded(v, " " * 8) for v in "ab" if out.dtype == torch.float32 and precision == "tf32"
                 and ROUND_TF32),
               f'        acc = tl.dot(a, b, acc, input_precision="{precision}")'
               if out.dtype == torch.float32 else "        acc = tl.dot(a, b, acc)"]
    starts = [sum(t.shape[1] for t in before.pieces[:j]) for j in range(len(before.pieces))]
    if len(before.pieces) > 1 and all(c % tile[2] == 0 for c in starts):
        # every block of channels lies in one part: one loop, which Triton pipelines, picks the part of each
        lines += [f"    for start in range(0, {channels}, BLOCK_K):",
                  "        ch = start + inner",
                  f"        kmask = ch < {channels}",
                  "        mask = rmask[:, None] & kmask[None, :]",
                  *_pick(before.pieces, starts),
                  "        kk = ch - first",
                  "        xv = tl.load(base + (img * s0 + hh * s2 + ww * s3)[:, None] + kk[None, :] * s1, mask=mask, "
                  "other=0.0).to(tl.float32)",
                  *prologue, *product]
        return _stored(lines, body, out, operands, bias, cols)
    # segments of the input channels: each part of a leading cat, else all of them at once
    segments = [(j, starts[j], t) for j, t in enumerate(before.pieces)] or [(None, 0, x)]
    for j, start, t in segments:
        size = t.shape[1]
        if j is not None:
            lines.append(f"    xrow{j} = {_row_offset(t, tuple(t.shape))}")
        lines += [f"    for start in range(0, {size}, BLOCK_K):",
                  "        kk = start + inner",
                  f"        kmask = kk < {size}",
                  f"        ch = kk + {start}" if start else "        ch = kk",
                  "        mask = rmask[:, None] & kmask[None, :]"]
        if j is not None:
            lines.append(f"        xv = tl.load(x{j}_ptr + xrow{j}[:, None] + kk[None, :] * {t.stride(1)}, mask=mask, "
                         "other=0.0).to(tl.float32)")
        lines += [*prologue, *product]
    return _stored(lines, body, out, operands, bias, cols)


def tf32_rounded(name: str, indent: str) -> str:
    """The line that rounds float32 `name` to the nearest TF32 value, ties away from zero (PTX
    `cvt.rna.tf32.f32`; the result is a float32 whose 13 low bits are zero)."""
    return (f'{indent}{name} = tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [{name}], '
            "dtype=tl.float32, is_pure=True, pack=1)")


def _pick(pieces, starts: list[int]) -> list[str]:
    """Lines that set, for the block of channels at `start`, the part that holds it: `base` its
    pointer, `first` its first channel, `s0` to `s3` its strides."""
    lines = ["        base = x0_ptr", "        first = 0", *(f"        s{d} = {pieces[0].stride(d)}" for d in range(4))]
    for j in range(1, len(pieces)):
        at = f"start >= {starts[j]}"
        lines += [f"        base = tl.where({at}, x{j}_ptr, base)",
                  f"        first = tl.where({at}, {starts[j]}, first)",
                  *(f"        s{d} = tl.where({at}, {pieces[j].stride(d)}, s{d})" for d in range(4))]
    return lines


def _stored(lines: list[str], body: list, out: torch.Tensor, operands: list[torch.Tensor], bias: bool,
            cols: int) -> str:
    """The text of the kernel whose product `lines` accumulated: the convolution's body over each
    tile, stored once (`codegen.finish`)."""
    out_offset, offsets = flat_offsets(out, operands)
    lines += [f"    i = rows[:, None] * {cols} + cols[None, :]",
              "    mask = rmask[:, None] & cmask[None, :]",
              f"    o = {out_offset}"]
    return finish(lines, body, out, operands, offsets, "acc", bias)


def launcher(kernel, tile: tuple = TILES[0]):
    """A launcher for `source`'s kernel with this tile (as `generated.define` returns it)."""
    block_m, block_n, block_k, warps, stages = tile

    def launch(out: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor], before: Before) -> None:
        rows = out.shape[0] * out.shape[2] * out.shape[3]
        programs = -(-rows // block_m) * -(-out.shape[1] // block_n)
        kernel[(programs,)](out, w, *operands, *before.pieces, *before.operands, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k, num_warps=warps, num_stages=stages)

    return launch


class Choices:
    """Per call signature, the tile this kernel runs with, or None where the two ops run apart;
    chosen on the signature's first call outside a capture (a call first seen inside one runs
    them apart), and kept in the cache folder (`recall`) for later loads."""

    def __init__(self):
        self._chosen: dict[tuple, tuple | None] = {}

    def tile(self, key: tuple, out: torch.Tensor, apart, fused, note) -> tuple | None:
        """`apart()` runs the two ops as before into `out`; `fused(tile)` runs this kernel with
        `tile` into `out`, False where it fails to build. The tile kept for this call by an
        earlier load, where its result agrees with the apart one; else the fastest tile whose
        result agrees, where it takes at most `pointwise_slower` of their time; else None. `note(why)`
        records a tile whose result disagrees."""
        if key in self._chosen:
            return self._chosen[key]
        if torch.cuda.is_current_stream_capturing():
            return None
        self._chosen[key] = None
        now = settings.current()
        setting = (key, now.pointwise_tolerance, now.pointwise_slower)
        kept = recall.kept_tile("pointwise", setting, out.device, TILES)
        if kept is None:
            return None  # the two ops apart were faster
        with timing.on_stream(out.device):
            apart()
            ref = out.clone()
            if not bool(torch.isfinite(ref).all()):
                return None  # nothing to check the kernel against
            scale = max(float(ref.abs().max()), 1e-30)

            def agrees(tile) -> bool:
                if not fused(tile):
                    return False
                if float((out.float() - ref.float()).abs().max()) > now.pointwise_tolerance * scale:
                    note(f"the kernel with tile {tile} disagrees with the two ops run apart")
                    return False
                return True
            if kept and agrees(kept):
                self._chosen[key] = kept
                return kept
            times = {tile: timing.graph_us(lambda: fused(tile), out.device)
                     for tile in tiles(out.shape[0] * out.shape[2] * out.shape[3], out.shape[1]) if agrees(tile)}
            if not times:
                return None
            best = min(times, key=times.get)
            theirs = timing.graph_us(apart, out.device)
        self._chosen[key] = best if times[best] <= now.pointwise_slower * theirs else None
        recall.keep_tile("pointwise", setting, out.device, self._chosen[key])
        return self._chosen[key]
