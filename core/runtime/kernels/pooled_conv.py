"""A 1x1 convolution of a 1x1 map and the body after it, as one generated kernel.

Squeeze-and-excitation convolves the pooled map: [N, C, 1, 1] in, [N, C', 1, 1] out, a matrix
product of N rows by a C' x C weight (efficientnet_b0: 16 blocks, two each, C up to 1152, C'
down to 8). cuDNN runs each as an implicit-GEMM kernel sized for large maps, and the body after it
(bias, SiLU) as a second kernel over a few thousand numbers: two launches of about 2 us for work
that takes far less. Here program (n, j) computes output channels j * BLOCK ... of image n as
float32 dot products of the input's channels with the weight's rows, then the rest of the body
(`codegen.epilogue_lines`), and stores the result: one launch, nothing written twice, no
workspace. The sums are float32 over the channels in order of blocks, as exact as cuDNN's
(which may round its inputs to TF32).

Only convolutions small enough to be bound by their launch qualify (`fits`); larger ones stay
with cuDNN. A linear layer of the same size (a conv net's classifier: [N, 1280] by 1000 x 1280
for efficientnet_b0) is the same product and runs as the same kernel (`SmallLinear`): then no
cuBLAS call is left in the model, and no stream needs cuBLAS's 32 MiB workspace.
The `pooled_kernel` setting (`base/settings.py`) off turns both off, for comparisons.
"""

from __future__ import annotations

import torch

from .codegen import (HEADER, INT32_LIMIT, TL_KINDS, finish, flat_offsets, layouts, needs_wide, pointers, program_id,
                      span)
from ..base import settings

MAX_TILE = 4096  # weight elements one program holds at once
PROGRAMS = 512  # programs a launch aims for, where the output has room: several per multiprocessor
MIN_BLOCK = 2  # output channels of one program at least


def fits(p: dict, out: torch.Tensor) -> bool:
    """Whether convolution `p` (`fusion.conv_params`, tensors in place) is one this kernel runs:
    2-D, ungrouped, a 1x1 kernel over a 1x1 map with no padding, float operands of one dtype,
    at most `max_pooled_products` multiply-adds, its result `out`'s shape."""
    x, w, bias = p["input"], p["weight"], p["bias"]
    if not (settings.current().pooled_kernel and out.is_cuda and x.dim() == 4 and w.dim() == 4 and out.dim() == 4
            and p["groups"] == 1):
        return False
    if out.dtype not in TL_KINDS or x.dtype != out.dtype or w.dtype != out.dtype \
            or bias is not None and bias.dtype != out.dtype:
        return False
    n, c, h, width = x.shape
    return (h, width) == (1, 1) and tuple(w.shape[1:]) == (c, 1, 1) and tuple(p["padding"]) == (0, 0) \
        and tuple(out.shape) == (n, w.shape[0], 1, 1) and 0 < n * w.shape[0] * c \
        <= settings.current().max_pooled_products


def linear_fits(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor) -> bool:
    """Whether linear(x, w, bias) into `out` is one this kernel runs: x [M, K], w [N, K], an
    optional bias [N], out [M, N], float operands of one dtype, at most `max_pooled_products` multiply-adds."""
    if not (settings.current().pooled_kernel and out.is_cuda and x.dim() == 2 and w.dim() == 2 and out.dim() == 2):
        return False
    if out.dtype not in TL_KINDS or x.dtype != out.dtype or w.dtype != out.dtype \
            or bias is not None and (bias.dtype != out.dtype or tuple(bias.shape) != (w.shape[0],)):
        return False
    m, k = x.shape
    return w.shape[1] == k and tuple(out.shape) == (m, w.shape[0]) and 0 < m * w.shape[0] * k \
        <= settings.current().max_pooled_products


def blocks(out: torch.Tensor, channels: int) -> tuple[int, int]:
    """(output channels, input channels) one program spans: enough programs to fill the GPU where
    the output allows, and a weight tile of at most MAX_TILE elements."""
    n, c_out = out.shape[:2]
    per_program = max(1, n * c_out // PROGRAMS)
    block = min(64, max(MIN_BLOCK, 1 << (per_program.bit_length() - 1)))
    return block, min(max(32, MAX_TILE // block), max(32, 1 << (channels - 1).bit_length()))


def source(body: list, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor],
           bias: bool) -> str:
    """The kernel's text. `body` is the op's body as the runtime passes it; `operands` the tensors
    its other nodes read, the convolution's bias last where `bias`."""
    c_out, c_in = out.shape[1], x.shape[1]  # [N, C', 1, 1] of [N, C, 1, 1], or [M, N] of [M, K]
    wide = needs_wide(out, operands) or max(span(x), span(w)) > INT32_LIMIT  # the inputs may be views
    first = program_id(wide)
    out_offset, offsets = flat_offsets(out, operands)
    lines = [*HEADER,
             f"def kernel(out_ptr, x_ptr, w_ptr, {pointers(operands)}"
             "BLOCK: tl.constexpr, BLOCK_CI: tl.constexpr):",
             f"    n = {first}",
             "    co = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
             f"    mask = co < {c_out}",
             f"    i = n * {c_out} + co",
             "    acc = tl.zeros([BLOCK], dtype=tl.float32)",
             f"    for c0 in range(0, {c_in}, BLOCK_CI):",
             "        ci = c0 + tl.arange(0, BLOCK_CI)",
             f"        cmask = ci < {c_in}",
             f"        xv = tl.load(x_ptr + n * {x.stride(0)} + ci * {x.stride(1)}, mask=cmask, other=0.0)",
             f"        wv = tl.load(w_ptr + co[:, None] * {w.stride(0)} + ci[None, :] * {w.stride(1)},",
             "                     mask=mask[:, None] & cmask[None, :], other=0.0)",
             "        acc += tl.sum(wv.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)",
             f"    o = {out_offset}"]
    return finish(lines, body, out, operands, offsets, "acc", bias)


def launcher(kernel):
    """A launcher for `source`'s kernel (as `generated.define` returns it)."""
    def launch(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, operands: list[torch.Tensor]) -> None:
        block, block_ci = blocks(out, x.shape[1])
        kernel[(out.shape[0], -(-out.shape[1] // block))](out, x, w, *operands, BLOCK=block, BLOCK_CI=block_ci)

    return launch


LINEAR = ("aten::linear.default", (), ())  # the body of a linear: its product alone


class SmallLinear:
    """linear(x, w, bias) as `source`'s kernel where it fits (`linear_fits`), else as `fallback`
    (the substitute it would have had; None: PyTorch's op). `product` is M x N x K, from the
    graph, so the executable knows before any op runs that this op will call no cuBLAS. A kernel
    that fails to build falls back from then on, and `generated.STATS` records why."""

    def __init__(self, op_id: int, fallback, product: int):
        self.op_id, self.fallback, self.product = op_id, fallback, product
        self._launch: dict[tuple, object] = {}  # call signature -> launcher, or None: fall back

    def __call__(self, args: list, out: torch.Tensor):
        from . import generated

        x, w, bias = (list(args) + [None])[:3]
        if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and linear_fits(x, w, bias, out):
            operands = [] if bias is None else [bias]
            key = layouts(out, x, w, *operands)
            if generated.launch_once(self._launch, key, lambda: launcher(generated.define(source(
                    [LINEAR], out, x, w, operands, bias is not None))), (out, x, w, operands),
                    f"op {self.op_id} as a small linear"):
                return out
        return self.fallback(args, out) if self.fallback is not None else None

    @property
    def calls_cublas(self) -> bool:
        """Whether this op may multiply through cuBLAS: where it does not fit, or falls back."""
        now = settings.current()
        return not (now.pooled_kernel and 0 < self.product <= now.max_pooled_products) \
            or any(v is None for v in self._launch.values())
