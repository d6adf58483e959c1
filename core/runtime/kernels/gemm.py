"""Float32 matrix products on the tensor cores at float32's accuracy, chosen per call by measurement.

PyTorch multiplies float32 matrices on the FMA units unless TF32 is allowed for matmul, and by
default it is not: cuBLAS then runs its SIMT kernels, about 90 % of a transformer's time at batch 8
(`kernel_diff_transformers_b8_2026-11-25.md`). Here one generated kernel computes
`x @ b (+ bias)` with each product taken as three TF32 products on the tensor cores (Triton's
"tf32x3": every operand split into a TF32 part and the rest, the rest's product with the rest
dropped), accumulating in float32. That keeps float32's accuracy, which plain TF32 (10-bit
operands) does not: at GPT-2's and BERT's shapes on an H200, the largest error against a float64
product was 2.5e-7 to 5e-7 of the result's largest magnitude, against cuBLAS's 6e-7 to 2.2e-6, at
1.3 to 2.1 times cuBLAS's speed (`benchmarks/results/gemm_2026-11-26.md`). The bias is added
before the one store.

Program i computes the BLOCK_M x BLOCK_N tile i of the result (tiles in row-major order), looping
over K in BLOCK_K steps; `TILES` lists the tile shapes each call times. Shapes and strides are
constants of the source; every index is 64-bit where a tensor spans more than 2**31 - 1 elements.
With an `Epilogue` the tile goes through the elementwise op after the product instead
(`pairs.product_pairs`), and only that op's result is stored.

`Gemm` is the substitute of a linear, addmm, mm or matmul op: the first call of a signature
outside a capture builds the kernel with each tile, checks it against PyTorch's product
(the `gemm_tolerance` setting), times them and PyTorch's in a CUDA graph and keeps the fastest (`gemm_slower`).
Choices last for the process. A call first seen inside a capture, a kernel that fails to build or
disagrees, and any call `fits` refuses run as before. The `gemm_kernel` setting off turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir import WEIGHT, Graph, Op, Ref, refs_of
from ...plan.memory import PRODUCTS
from . import generated
from . import recall
from ..base import timing
from ..base.claimed import walking
from .codegen import (HEADER, INT32_LIMIT, TL_KINDS, finish, flat_offsets, needs_wide, overlaps, pointers, program_id,
                      span, strided_offset)
from ..base import settings

FLOAT32_PRODUCTS = "tf32x3"  # as three TF32 products (float32's accuracy); "ieee": on the FMA units
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) each call times: the fastest with 1024 rows, and the
# fastest with 128 or 197 (twice as many programs; H200, `gemm_2026-11-26.md`)
TILES = ((64, 64, 32, 4, 3), (64, 32, 64, 4, 3))

_built: dict[tuple, object] = {}  # (call signature, tile) -> launcher, or None where it failed to build
_chosen: dict[tuple, tuple | None] = {}  # call signature -> the tile this kernel runs with; None: PyTorch's

def applies(graph: Graph, op: Op) -> bool:
    """Whether op is a float32 product this module may run: linear(x, w[, bias]) with no keyword
    arguments, mm(x, w) or matmul(x, w) (run here where both are matrices), or addmm(bias, x, w)
    with beta and alpha 1."""
    if op.target not in PRODUCTS or len(op.outputs) != 1 or graph.values[op.outputs[0]].spec.dtype != "float32":
        return False
    if op.target == "aten::addmm.default":
        return len(op.args) >= 3 and all(a == 1 for a in op.args[3:]) \
            and all(k in ("beta", "alpha") and v == 1 for k, v in op.kwargs)
    return not op.kwargs and all(isinstance(a, Ref) for a in op.args[:2])


def k_major_weights(graph: Graph) -> set[int]:
    """The float32 matrix weights that only products this module runs read, as their right
    operand (mm's and matmul's second argument, addmm's third). The executable stores them
    transposed (strides (1, K)): the tensor cores take a float32 operand only K-major, so a
    row-major one costs a transposition per tile (cuBLAS was faster than the kernel on GPT-2's
    row-major weights). A linear's weight [N, K] is K-major as it is. None where the `gemm_kernel` setting is off."""
    right = {"aten::mm.default": 1, "aten::matmul.default": 1, "aten::addmm.default": 2}
    as_right, elsewhere = set(), set()
    for op in graph.ops:
        position = right.get(op.target) if applies(graph, op) else None
        for i, a in enumerate(op.args):
            for r in refs_of(a):
                (as_right if i == position and isinstance(a, Ref) else elsewhere).add(r)
        elsewhere.update(refs_of(tuple(v for _, v in op.kwargs)))
    return {r for r in as_right - elsewhere - set(graph.outputs)
            if settings.current().gemm_kernel
            and graph.values[r].kind == WEIGHT and graph.values[r].spec.dtype == "float32"
            and len(graph.values[r].spec.shape) == 2 and graph.values[r].spec.is_contiguous}


def operands_of(target: str, args: list, out: torch.Tensor):
    """(x [M, K], b [K, N], bias [N] or None, out [M, N]) of a call, as views of its tensors, or
    None where a tensor is not one this kernel takes (or cannot be seen as a matrix without a copy)."""
    try:
        if target == "aten::linear.default":
            x, w, bias = (list(args) + [None])[:3]
            if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 2):
                return None
            x, b, out = x.view(-1, x.shape[-1]), w.t(), out.view(-1, out.shape[-1])
        elif target == "aten::addmm.default":
            bias, x, b = args[:3]
        elif target in ("aten::mm.default", "aten::matmul.default"):
            (x, b), bias = args[:2], None
        else:
            return None
    except (RuntimeError, ValueError):
        return None  # a view would need a copy
    return (x, b, bias, out) if fits(x, b, bias, out) else None


def fits(x, b, bias, out: torch.Tensor) -> bool:
    """Whether this kernel computes x @ b (+ bias) into `out`: float32 CUDA matrices of matching
    shapes on one device, any strides, bias None or a vector of N."""
    if not (settings.current().gemm_kernel
            and isinstance(x, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor)
            and out.is_cuda):
        return False
    tensors = [x, b, out] + ([bias] if bias is not None else [])
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.dim() == 1):
        return False
    if not all(t.dtype == torch.float32 and t.device == out.device for t in tensors) \
            or x.dim() != 2 or b.dim() != 2 or out.dim() != 2:
        return False
    m, k = x.shape
    n = b.shape[1]
    return b.shape[0] == k and tuple(out.shape) == (m, n) and (bias is None or bias.shape[0] == n) \
        and m > 0 and n > 0 and k > 0


@dataclass
class Epilogue:
    """The elementwise op after a product (`pairs.product_pairs`), run in the product's kernel:
    `body` its nodes with tensors in place, `operands` the tensors they read (first-use order, as
    `FusedKernel.operands` gives them), `at` the index among them of the product's result (never
    loaded: the kernel holds it), `out` the op's planned buffer."""

    body: tuple
    operands: list
    at: int
    out: torch.Tensor


def source(x: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, epilogue: Epilogue | None = None,
           tile: tuple = TILES[0], scatter: torch.Tensor | None = None) -> str:
    """The kernel's text, specialised to these tensors' shapes and strides. With `epilogue`, each
    tile of the product goes through its body, which is stored in `epilogue.out` instead (the
    product itself is never stored). With `scatter` (a tensor of the product's elements, any shape
    and strides), element i of the product in row-major order is stored at element i of
    `scatter` in row-major order, and `out` is not written (the kernel's out_ptr is `scatter`)."""
    m, k = x.shape
    n = b.shape[1]
    block_m, block_n = tile[:2]
    tiles_n = -(-n // block_n)
    wide = any(span(t) > INT32_LIMIT for t in (x, b, out)) or -(-m // block_m) * tiles_n * block_m > INT32_LIMIT \
        or epilogue is not None and needs_wide(epilogue.out, epilogue.operands) \
        or scatter is not None and span(scatter) > INT32_LIMIT
    first, index = program_id(wide), ".to(tl.int64)" if wide else ""
    xs, bs, os_ = x.stride(), b.stride(), out.stride()
    lines = [*HEADER,
             f"def kernel(x_ptr, b_ptr, out_ptr, bias_ptr, {pointers(epilogue.operands) if epilogue else ''}"
             "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):",
             f"    tile = {first}",
             f"    rows = tile // {tiles_n} * BLOCK_M + tl.arange(0, BLOCK_M){index}",
             f"    cols = tile % {tiles_n} * BLOCK_N + tl.arange(0, BLOCK_N){index}",
             f"    inner = tl.arange(0, BLOCK_K){index}",
             f"    rmask = rows < {m}",
             f"    cmask = cols < {n}",
             "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
             f"    for start in range(0, {k}, BLOCK_K):",
             "        kk = start + inner",
             f"        kmask = kk < {k}",
             f"        a = tl.load(x_ptr + rows[:, None] * {xs[0]} + kk[None, :] * {xs[1]}, "
             "mask=rmask[:, None] & kmask[None, :], other=0.0)",
             f"        w = tl.load(b_ptr + kk[:, None] * {bs[0]} + cols[None, :] * {bs[1]}, "
             "mask=kmask[:, None] & cmask[None, :], other=0.0)",
             f'        acc = tl.dot(a, w, acc, input_precision="{FLOAT32_PRODUCTS}")']
    if bias is not None:
        lines.append(f"    acc += tl.load(bias_ptr + cols * {bias.stride(0)}, mask=cmask, other=0.0)[None, :]")
    if epilogue is not None:  # its buffer: dense, row-major, the product's shape; element i is (i // n, i % n)
        out_offset, offsets = flat_offsets(epilogue.out, epilogue.operands)
        lines += [f"    i = rows[:, None] * {n} + cols[None, :]",
                  "    mask = rmask[:, None] & cmask[None, :]",
                  f"    o = {out_offset}"]
        return finish(lines, list(epilogue.body), epilogue.out, epilogue.operands, offsets, None, False,
                      given={epilogue.at: "acc"})
    if scatter is not None:  # row-major order: the product's and `scatter`'s elements match
        offset = strided_offset(tuple(scatter.shape), scatter.stride(), list(range(scatter.dim())), dense=False)
        lines += [f"    i = rows[:, None] * {n} + cols[None, :]",
                  f"    tl.store(out_ptr + ({offset}), acc, mask=rmask[:, None] & cmask[None, :])",
                  f"# torch {torch.__version__}"]
        return "\n".join(lines) + "\n"
    lines += [f"    tl.store(out_ptr + rows[:, None] * {os_[0]} + cols[None, :] * {os_[1]}, acc, "
              "mask=rmask[:, None] & cmask[None, :])",
              f"# torch {torch.__version__}"]
    return "\n".join(lines) + "\n"


def grid(x: torch.Tensor, b: torch.Tensor, tile: tuple = TILES[0]) -> tuple[int, dict]:
    """The launch grid (one program per tile) and the kernel's constants."""
    block_m, block_n, block_k, warps, stages = tile
    tiles = -(-x.shape[0] // block_m) * -(-b.shape[1] // block_n)
    return tiles, {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps,
                   "num_stages": stages}


def launcher(kernel, tile: tuple = TILES[0]):
    """A launcher for `source`'s kernel with this tile (as `generated.define` returns it)."""
    def launch(x, b, bias, out, epilogue: Epilogue | None = None) -> None:
        g, constants = grid(x, b, tile)
        into, operands = (out, []) if epilogue is None else (epilogue.out, epilogue.operands)
        kernel[(g,)](x, b, into, into if bias is None else bias, *operands, **constants)

    return launch


def _signature(*tensors) -> tuple:
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t for t in tensors) \
        + (tensors[-1].device.index, FLOAT32_PRODUCTS)


def _pytorch(x, b, bias, out) -> None:
    """PyTorch's product as nimble runs it otherwise at its best: cuBLAS's GEMM, then the bias
    added in place (in float32 that beats cuBLASLt's bias epilogue with few rows, and it needs no
    second workspace: `placed/substitutes.BiasedGemm`)."""
    torch.mm(x, b, out=out)
    if bias is not None:
        out.add_(bias)


class Gemm:
    """The substitute of one linear, addmm, mm or matmul op (`applies`): its product by this kernel where
    that was measured faster, else by `fallback` (the substitute it would have had; None: the
    op's out= overload)."""

    def __init__(self, op_id: int, target: str, fallback):
        self.op_id, self.target, self.fallback = op_id, target, fallback
        self._with_epilogues: dict[tuple, object] = {}  # signature -> launcher, or None: run apart

    def __call__(self, args: list, out: torch.Tensor):
        found = operands_of(self.target, args, out)
        if found is not None and self.run(*found):
            return out
        return self.fallback(args, out) if self.fallback is not None else None

    def run(self, x, b, bias, out) -> bool:
        """Whether x @ b (+ bias) was written into `out` by this kernel."""
        key = _signature(x, b, bias, out)
        tile = self._tile(key, x, b, bias, out)
        if tile is None:
            return False
        _built[key, tile](x, b, bias, out)
        return True

    def with_epilogue(self, args: list, out: torch.Tensor, body: tuple, operands: list, into: torch.Tensor,
                      held: torch.Tensor | None = None) -> bool:
        """Whether the product of `args` went through `body` (the elementwise op after it, reading
        `held` among `operands`: `out`, the product's buffer, or `out` reshaped) into `into`, that
        op's buffer, in one kernel; False, with nothing run, where the product runs apart
        (PyTorch's was faster, or the tensors do not fit: `out`, `held` and `into` dense, the last
        two of one shape, `held` the same elements as `out`, `into` in a float dtype and clear
        of the product's inputs). The memory plan holds the product's inputs until the op
        (`memory.held_inputs`); a plan from before that rule may give the op's result the bytes of
        an input that dies at the product, and written while other tiles still read that input,
        it would corrupt them."""
        held = out if held is None else held
        at = [k for k, t in enumerate(operands) if t is held]
        if len(at) != 1 or not out.is_contiguous() or not held.is_contiguous() \
                or not into.is_contiguous() or held.data_ptr() != out.data_ptr() or held.numel() != out.numel() \
                or tuple(into.shape) != tuple(held.shape) or into.dtype not in TL_KINDS or into.device != out.device:
            return False
        planned = self._into(args, out, into)
        if planned is None:
            return False
        x, b, bias, matrix, key, tile = planned
        epilogue = Epilogue(body, operands, at[0], into)
        whole = key + (_signature(into, *operands), at[0])
        return self._launch(whole, lambda t: launcher(generated.define(source(x, b, bias, matrix, epilogue, t)), t),
                            (x, b, bias, matrix, epilogue), f"op {self.op_id} with the elementwise op after it", tile)

    def through(self, args: list, out: torch.Tensor, into: torch.Tensor) -> bool:
        """Whether the product of `args` was stored into `into` (`source`'s `scatter`: its elements
        in row-major order are those of `out`, the product's buffer, which is not written) by one
        kernel; False, with nothing run, where PyTorch's product runs or the tensors do not fit.
        The memory plan holds the product's inputs until the copy whose buffer `into` views
        (`memory.held_inputs`); the kernel declines where they overlap all the same."""
        if into.numel() != out.numel() or into.dtype != torch.float32 or into.device != out.device:
            return False
        planned = self._into(args, out, into)
        if planned is None:
            return False
        x, b, bias, matrix, key, tile = planned
        whole = key + ("through",) + _signature(into)
        return self._launch(whole, lambda t: launcher(generated.define(source(x, b, bias, matrix, tile=t, scatter=into)), t),
                            (x, b, bias, into), f"op {self.op_id} into the copy of its views", tile)

    def _launch(self, whole: tuple, make, operands: tuple, what: str, tile: tuple) -> bool:
        """`generated.launch_once` of the kernel `make(tile)` builds. A prebuild's walk, where
        every tile ties and PyTorch's product never wins, walks each way the load's timing may
        take: this kernel with every tile, and then (False) the product and the op after it
        apart (swin_t's and BERT's loads built those one at a time after the prebuild, 2026-11-29)."""
        if not walking():
            return generated.launch_once(self._with_epilogues, whole, lambda: make(tile), operands, what)
        for other in TILES:
            generated.launch_once(self._with_epilogues, whole + (other,), lambda other=other: make(other), operands, what)
        return False

    def _into(self, args: list, out: torch.Tensor, into: torch.Tensor) -> tuple | None:
        """(x, b, bias, `out` seen as [M, N], the call signature, the tile) where this kernel runs
        the product of `args` and `into`, which its tiles write while others still read the
        product's inputs, is clear of them; else None. An older plan may give `into` the bytes of
        an input that dies at the product."""
        found = operands_of(self.target, args, out)
        if found is None or overlaps(into, found[:3]):
            return None
        key = _signature(*found)
        tile = self._tile(key, *found)
        return None if tile is None else (*found, key, tile)

    def _tile(self, key: tuple, x, b, bias, out) -> tuple | None:
        """The tile this kernel runs this call signature with, or None where PyTorch's product
        runs: measured on the signature's first call outside a capture."""
        if walking():  # a prebuild's walk: the kernel with every tile, nothing compared, timed or kept
            for tile in TILES:
                self._product(key, tile, x, b, bias, out)
            return TILES[0]
        memo = (key, settings.current().digest())  # chosen under these settings
        if memo not in _chosen:
            if torch.cuda.is_current_stream_capturing():
                return None  # chosen in the warm-up; a call first seen in a capture runs PyTorch's way
            with timing.on_stream(out.device):  # PyTorch's reference too: one cuBLAS workspace for all choices
                _chosen[memo] = self._choose(key, x, b, bias, out)
        return _chosen[memo]

    def _product(self, key: tuple, tile: tuple, x, b, bias, out: torch.Tensor) -> bool:
        """`generated.launch_once` of this call's product kernel with `tile` (defined on its first launch)."""
        return generated.launch_once(_built, (key, tile),
                                     lambda: launcher(generated.define(source(x, b, bias, out, tile=tile)), tile),
                                     (x, b, bias, out), f"op {self.op_id} as a float32 product")

    def _choose(self, key: tuple, x, b, bias, out: torch.Tensor) -> tuple | None:
        """The tile kept for this call by an earlier load (`recall`), where its result agrees
        with PyTorch's product, or None where PyTorch's product was kept; else build the kernel
        with each of TILES: the fastest that agrees, where it takes at most `gemm_slower` times
        PyTorch's time, else None, and keep that."""
        now = settings.current()
        setting = (key, now.gemm_tolerance, now.gemm_slower)
        kept = recall.kept_tile("gemm", setting, out.device, TILES)
        if kept is None:
            return None
        _pytorch(x, b, bias, out)
        ref = out.clone()
        if not bool(torch.isfinite(ref).all()):
            return None  # nothing to check the kernel against

        def agrees(tile) -> bool:
            if not self._product(key, tile, x, b, bias, out):
                return False
            if float((out - ref).abs().max()) > now.gemm_tolerance * max(float(ref.abs().max()), 1e-30):
                generated.STATS.fallbacks.append(f"op {self.op_id}: the float32 product disagrees with PyTorch's")
                return False
            return True
        if kept and agrees(kept):
            return kept
        times = {tile: timing.graph_us(lambda: _built[key, tile](x, b, bias, out), out.device)
                 for tile in TILES if agrees(tile)}
        if not times:
            return None
        best = min(times, key=times.get)
        if times[best] > now.gemm_slower * timing.graph_us(lambda: _pytorch(x, b, bias, out), out.device):
            best = None
        recall.keep_tile("gemm", setting, out.device, best)
        return best
