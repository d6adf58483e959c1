"""The text of nimble's generated Triton kernels: each fused body's nodes as Triton expressions,
and the kernels around them (`FusedKernel` in `kernels.py` launches them; `fused_mean.py` and
`reductions.py` build on the same pieces).

- `elementwise_source`: one program per BLOCK elements of the output, in its memory order; each
  operand is read through its own strides, broadcast to the output's shape. A leading
  convolution's result is read from the output buffer, where it was written first.
- `norm_source`: one program per row; the body over the row, stored where anything else reads
  it, then the row normalised as a layer norm into another buffer.
- `concat_source`: a body led by a cat (`passes/fuse_concats.py`), whose result is never written:
  each program covers a tile that lies in one part, found from its program id, and reads the
  part where it lies (`ConcatTiles`).
- `epilogue_lines`: the statements every kernel shares (operand loads, the leading
  convolution's value, the nodes), for any indexing scheme.

Index arithmetic is 32-bit where every element offset the kernel can form stays below 2**31, and
64-bit otherwise (`needs_wide`), so no kernel can address outside its buffers. NaN propagates
through relu, clamps, maximum and minimum as it does in torch. Every text ends with the torch
version, which its cache key thereby names.
"""

from __future__ import annotations

import math

import torch

from ...ir import Local, contiguous_strides
from ...ops import fusion

BLOCK = 1024  # elements of one program of an elementwise kernel
INT32_LIMIT = 2**31 - 1
TL_KINDS = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}
HEADER = ["import triton", "import triton.language as tl", "", "", "@triton.jit"]  # the lines before `def kernel`


def _num(x) -> str:
    x = float(x)
    return repr(x) if math.isfinite(x) else f"float('{x}')"


def _at_least(x: str, lo: str) -> str:
    """max(x, lo) that keeps a NaN x, as torch does (tl.maximum would give lo)."""
    return f"tl.where({x} < {lo}, {lo}, {x})"


def _at_most(x: str, hi: str) -> str:
    return f"tl.where({x} > {hi}, {hi}, {x})"


_HARD_SIGMOID = _at_most(_at_least("{x} + 3.0", "0.0"), "6.0") + " / 6.0"
# Ops of one operand and no other arguments: their Triton expression over {x}.
_UNARY = {
    "relu.default": _at_least("{x}", "0.0"), "sigmoid.default": "tl.sigmoid({x})",
    "silu.default": "({x} * tl.sigmoid({x}))", "hardswish.default": f"({{x}} * ({_HARD_SIGMOID}))",
    "hardsigmoid.default": f"({_HARD_SIGMOID})", "tanh.default": "(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",
    "neg.default": "(-{x})", "exp.default": "tl.exp({x})", "sqrt.default": "tl.sqrt({x})",
    "rsqrt.default": "tl.rsqrt({x})", "reciprocal.default": "(1.0 / {x})", "abs.default": "tl.abs({x})",
    "erf.default": "tl.erf({x})",
}


_POWERS = {2.0: "({x} * {x})", 3.0: "({x} * {x} * {x})", 0.5: "tl.sqrt({x})", -0.5: "tl.rsqrt({x})",
           -1.0: "(1.0 / {x})", -2.0: "(1.0 / ({x} * {x}))"}


def _expr(target: str, a: list[str], args, kwargs: dict) -> str:
    """One body node as a Triton expression over the fp32 values `a` (its tensor operands)."""
    x = a[0]
    extra = list(args)

    def arg(i, name, default):
        if name in kwargs:
            return kwargs[name]
        return extra[i] if i < len(extra) and extra[i] is not None else default

    name = target.split("::")[1]
    if name in ("relu6.default", "hardtanh.default"):
        lo, hi = (0.0, 6.0) if name == "relu6.default" else (arg(1, "min_val", -1.0), arg(2, "max_val", 1.0))
        return _at_most(_at_least(x, _num(lo)), _num(hi))
    if name in ("clamp.default", "clamp_min.default", "clamp_max.default"):
        lo = arg(1, "min", None) if name != "clamp_max.default" else None
        hi = arg(2, "max", None) if name == "clamp.default" else arg(1, "max", None) if name == "clamp_max.default" \
            else None
        out = x if lo is None else _at_least(x, _num(lo))
        return out if hi is None else _at_most(out, _num(hi))
    if name == "leaky_relu.default":
        return f"tl.where({x} > 0, {x}, {x} * {_num(arg(1, 'negative_slope', 0.01))})"
    if name == "gelu.default":
        if arg(1, "approximate", "none") == "tanh":
            inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
            return f"(0.5 * {x} * (1.0 + (2.0 * tl.sigmoid(2.0 * ({inner})) - 1.0)))"
        return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"
    if name in _UNARY:
        return _UNARY[name].format(x=x)
    if target in fusion.LOGICAL:  # booleans held as 0.0 and 1.0
        return f"tl.where(({x} != 0) & ({a[1]} != 0), 1.0, 0.0)"
    if name == "where.Scalar":
        return f"tl.where({x} != 0, {_num(extra[1])}, {_num(extra[2])})"
    if name == "where.self":
        return f"tl.where({x} != 0, {a[1]}, {a[2]})"
    if name == "threshold_backward.default":  # relu's backward: 0 where its result is at most the threshold
        return f"tl.where({a[1]} <= {_num(extra[2])}, 0.0, {x})"
    if name == "pow.Tensor_Scalar":  # fusion.POWERS, as PyTorch's CUDA kernel computes them
        return _POWERS[float(extra[1])].format(x=x)
    op, kind = name.split(".")
    y = a[1] if kind == "Tensor" or kind == "default" else _num(extra[1])
    alpha = arg(2, "alpha", 1)
    if op in ("add", "sub"):
        scaled = y if alpha == 1 else f"({y} * {_num(alpha)})"
        return f"({x} {'+' if op == 'add' else '-'} {scaled})"
    if op in ("mul", "div"):
        return f"({x} {'*' if op == 'mul' else '/'} {y})"
    if op in ("maximum", "minimum"):  # a NaN on either side gives NaN, as in torch
        return f"tl.where(({x} != {x}) | ({y} != {y}), {x} + {y}, tl.{op}({x}, {y}))"
    raise NotImplementedError(f"no Triton expression for {target}")


def strided_offset(shape, strides, order, dense: bool) -> str:
    """The element offset of index `i` (counted in the output's memory order) in a tensor of
    these strides; `order` lists the output's dims from outermost to innermost."""
    if dense:
        return "i"
    terms, step = [], 1
    for d in reversed(order):
        n = shape[d]
        if n > 1 and strides[d]:
            coord = f"(i // {step})" if step > 1 else "i"
            coord = f"({coord} % {n})" if step * n < math.prod(shape) else coord
            terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
        step *= n
    return " + ".join(terms) or "i * 0"  # a block, as `i` is: Triton loads a block only through one


def layouts(*tensors: torch.Tensor) -> tuple:
    """Each tensor's shape, strides and dtype: what a kernel specialised to them depends on."""
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors)


def body_signature(nodes, operands) -> tuple:
    """What a kernel's text takes from these body nodes: each node's target and constants, each
    tensor named by its place among `operands` (-1: none of them), lists and tuples walked."""
    return tuple((node[0], _constant(node[1], operands), _constant(node[2], operands)) for node in nodes)


def _constant(a, operands) -> object:
    """`a` as `body_signature` keeps it. A module function, not a closure: a recursive closure is
    a reference cycle, which would hold `operands` (views of the arena) until the garbage collector
    runs, and so keep the arena reserved after the executable closes."""
    if isinstance(a, torch.Tensor):
        return ("operand", next((k for k, t in enumerate(operands) if t is a), -1))
    if isinstance(a, (list, tuple)):
        return tuple(_constant(b, operands) for b in a)
    return a if isinstance(a, (int, float, bool, str, type(None), Local)) else repr(a)


def program_id(wide: bool) -> str:
    """The program's id along the grid's first axis, 64-bit where `wide` (`needs_wide`)."""
    return "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"


def pointers(operands: list) -> str:
    """The kernel parameters of a body's operands: `in0_ptr, in1_ptr, ` and so on."""
    return "".join(f"in{k}_ptr, " for k in range(len(operands)))


def span(t: torch.Tensor) -> int:
    """The offset of `t`'s farthest element from its first, through its strides."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)


def overlaps(out: torch.Tensor, tensors) -> bool:
    """Whether the bytes `out` spans (its first element to its farthest) meet those of any of
    `tensors` on its device (None skipped): a kernel that reads them while it writes `out`
    elsewhere than element for element would read what it wrote."""
    def ends(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + (span(t) + 1) * t.element_size()
    lo, hi = ends(out)
    return any(t is not None and t.device == out.device and ends(t)[0] < hi and lo < ends(t)[1] for t in tensors)


def needs_wide(out: torch.Tensor, operands: list[torch.Tensor]) -> bool:
    """Whether an index or element offset of this kernel can pass 2**31 - 1, so that its index
    arithmetic must be 64-bit: the launch's last index, or the farthest element of any operand as
    broadcast to the output's shape."""
    if out.numel() + BLOCK > INT32_LIMIT:
        return True
    for t in (out, *operands):
        strides = t.expand(out.shape).stride() if t is not out else t.stride()
        if sum((n - 1) * st for n, st in zip(out.shape, strides)) > INT32_LIMIT:
            return True
    return False


def elementwise_source(body: list, out: torch.Tensor, operands: list[torch.Tensor], leads: bool, bias: bool) -> str:
    """The kernel's source. `body` is the op's body as the runtime passes it (tensors in place of
    Refs), and `operands` the distinct tensors it reads."""
    first = program_id(needs_wide(out, operands))
    out_offset, offsets = flat_offsets(out, operands)
    lines = [*HEADER,
             f"def kernel(out_ptr, {pointers(operands)}N: tl.constexpr, "
             "BLOCK: tl.constexpr):",
             f"    i = {first} * BLOCK + tl.arange(0, BLOCK)",
             "    mask = i < N",
             f"    o = {out_offset}"]
    return finish(lines, body, out, operands, offsets, loaded("out_ptr + o") if leads else None, bias)


def finish(lines: list[str], body: list, out: torch.Tensor, operands: list[torch.Tensor], offsets: list[str],
           lead: str | None, bias: bool, given: dict[int, str] | None = None) -> str:
    """The text of a kernel that has set `i`, `mask` and `o` in `lines`: the body
    (`epilogue_lines`, with `given`), its result stored at `out_ptr + o`, and the torch version."""
    lines = [*lines, *epilogue_lines(body, operands, offsets, lead, bias, given=given),
             f"    tl.store(out_ptr + o, v{len(body) - 1}.to({TL_KINDS[out.dtype]}), mask=mask)",
             f"# torch {torch.__version__}"]
    return "\n".join(lines) + "\n"


def loaded(pointer: str) -> str:
    """The float32 value a kernel's lanes (`mask`) read at `pointer`."""
    return f"tl.load({pointer}, mask=mask).to(tl.float32)"


def flat_offsets(out: torch.Tensor, operands: list[torch.Tensor]) -> tuple[str, list[str]]:
    """The element offsets, in `out` and in each operand broadcast to its shape, of index `i`
    counted in `out`'s memory order: plain `i` where a tensor is dense in that order."""
    shape = tuple(out.shape)
    order = sorted(range(out.dim()), key=lambda d: (-out.stride(d), d))  # outermost first
    dense_strides, step = [0] * out.dim(), 1
    for d in reversed(order):
        dense_strides[d] = step
        step *= shape[d]
    out_dense = all(out.stride(d) == dense_strides[d] or shape[d] == 1 for d in range(out.dim()))
    offsets = []
    for t in operands:
        strides = t.expand(shape).stride()
        dense = out_dense and all(strides[d] == dense_strides[d] or shape[d] == 1 for d in range(out.dim()))
        offsets.append(strided_offset(shape, strides, order, dense))
    return strided_offset(shape, out.stride(), order, out_dense), offsets


class ConcatTiles:
    """How `concat_source` tiles a cat's result, where it can: the result and every part dense in
    one order of dims (the result's memory order), so that in that order part j is, for each
    index `row` of the dims outside the cat's, one run of `runs[j]` elements at `row * width +
    starts[j]` of the result and at `row * runs[j]` of the part. A program covers `rows` rows of
    `cols` elements of one part's runs; part j's programs are `first[j]` onwards."""

    def __init__(self, out: torch.Tensor, pieces: list[torch.Tensor], dim: int):
        shape = tuple(out.shape)
        order = sorted(range(out.dim()), key=lambda d: (-out.stride(d), d))  # outermost first
        self.fits = out.numel() > 0 and _dense_in(out, order) and all(
            t.dim() == out.dim() and t.dtype == pieces[0].dtype and _dense_in(t, order)
            and all(n == m for d, (n, m) in enumerate(zip(t.shape, shape)) if d != dim) for t in pieces) \
            and sum(t.shape[dim] for t in pieces) == shape[dim]
        if not self.fits:
            return
        inner = math.prod(shape[d] for d in order[order.index(dim) + 1:])
        self.width = shape[dim] * inner
        self.outer = out.numel() // self.width
        self.parts = [k for k, t in enumerate(pieces) if t.shape[dim]]  # empty parts have no tiles
        self.runs = [pieces[k].shape[dim] * inner for k in self.parts]
        self.starts = [sum(t.shape[dim] for t in pieces[:k]) * inner for k in self.parts]
        self.cols = min(BLOCK, max(16, 1 << (min(self.runs) - 1).bit_length()))
        self.rows = max(1, min(BLOCK // self.cols, 1 << (self.outer - 1).bit_length()))
        self.col_tiles = [-(-run // self.cols) for run in self.runs]
        row_tiles = -(-self.outer // self.rows)
        self.first = [0]
        for n in self.col_tiles:
            self.first.append(self.first[-1] + row_tiles * n)

    @property
    def programs(self) -> int:
        return self.first[-1]


def _dense_in(t: torch.Tensor, order: list[int]) -> bool:
    """Whether `t` is dense with its dims laid out in `order` (outermost first); dims of one
    element may have any stride."""
    step = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != step:
            return False
        step *= t.shape[d]
    return True


def concat_source(body: list, out: torch.Tensor, pieces: list[torch.Tensor], tiles: ConcatTiles,
                  operands: list[torch.Tensor]) -> str:
    """The kernel of a body led by a cat of `pieces` (see `ConcatTiles`, which must fit): each
    program picks its part by comparing its id with the parts' first programs, reads its tile of
    the part, applies the rest of the body and stores the tile where it lies in the result.
    `operands` are the distinct tensors the rest of the body reads."""
    parts = [f"p{k}_ptr" for k in range(len(pieces))]
    wide = needs_wide(out, operands) or (tiles.outer + tiles.rows) * tiles.width > INT32_LIMIT  # masked rows too
    first = program_id(wide)
    lines = [*HEADER, f"def kernel(out_ptr, {', '.join(parts)}, {pointers(operands)}):",
             f"    p = {first}",
             f"    base = {parts[tiles.parts[0]]}",
             "    first = 0",
             f"    run = {tiles.runs[0]}",
             f"    start = {tiles.starts[0]}",
             f"    col_tiles = {tiles.col_tiles[0]}"]
    for j in range(1, len(tiles.parts)):
        at = f"p >= {tiles.first[j]}"
        lines += [f"    base = tl.where({at}, {parts[tiles.parts[j]]}, base)",
                  f"    first = tl.where({at}, {tiles.first[j]}, first)",
                  f"    run = tl.where({at}, {tiles.runs[j]}, run)",
                  f"    start = tl.where({at}, {tiles.starts[j]}, start)",
                  f"    col_tiles = tl.where({at}, {tiles.col_tiles[j]}, col_tiles)"]
    lines += ["    q = p - first",
              f"    row = (q // col_tiles) * {tiles.rows} + tl.arange(0, {tiles.rows})[:, None]",
              f"    col = (q % col_tiles) * {tiles.cols} + tl.arange(0, {tiles.cols})[None, :]",
              f"    mask = (row < {tiles.outer}) & (col < run)",
              f"    i = row * {tiles.width} + start + col",
              f"    joined = {loaded('base + row * run + col')}"]
    out_offset, offsets = flat_offsets(out, operands)
    lines.append(f"    o = {out_offset}")
    return finish(lines, body, out, operands, offsets, "joined", False)


def epilogue_lines(body: list, operands: list[torch.Tensor], offsets: list[str], lead: str | None, bias: bool,
                   indent: str = "    ", given: dict[int, str] | None = None, prefix: str = "") -> list[str]:
    """A generated body's statements, each at `indent`, where `mask` says which lanes are real:
    each operand loaded as `in<k>` from its element `offsets[k]`, except those `given` (operand
    index -> a float32 expression the kernel already holds); with `lead` (the float32 value
    of a leading convolution: read back from the buffer it wrote, or computed in the kernel), `v0`
    that value, plus the bias (the last operand) where `bias`; then `v<k> = ...` for every other
    node, its Triton expression over the values before it and the operands. Every name the lines
    set starts with `prefix` (`<prefix>in0`, `<prefix>v0`), so that two bodies can share a kernel."""
    given = given or {}
    lines = [f"{indent}{prefix}in{k} = {given[k] if k in given else loaded(f'in{k}_ptr + ({offset})')}"
             for k, offset in enumerate(offsets)]
    start = 0
    if lead is not None:
        lines.append(f"{indent}{prefix}v0 = {lead} + {prefix}in{len(operands) - 1}" if bias
                     else f"{indent}{prefix}v0 = {lead}")
        start = 1
    names = {id(t): f"{prefix}in{k}" for k, t in enumerate(operands)}
    for k in range(start, len(body)):
        target, args, kwargs = body[k]
        tensors = [f"{prefix}v{args[pos].index}" if isinstance(args[pos], Local) else names[id(args[pos])]
                   for pos in fusion.POINTWISE[target]]
        lines.append(f"{indent}{prefix}v{k} = {_expr(target, tensors, args, dict(kwargs))}")
    return lines


def norm_source(body: list, x: torch.Tensor, operands: list[torch.Tensor], norm) -> str:
    """A row kernel: the body over one row of `x` (row-major), its result stored where
    `norm.store`, then that row normalised as `norms.LAYER_NORM` does (float32 mean and
    variance of the values as stored) into `norm.out`."""
    shape = tuple(x.shape)
    order = list(range(x.dim()))
    dense_strides = contiguous_strides(shape)
    row = program_id(needs_wide(x, operands))
    kind = TL_KINDS[x.dtype]
    lines = [*HEADER,
             f"def kernel(x_ptr, y_ptr, w_ptr, b_ptr, {pointers(operands)}eps, "
             "N: tl.constexpr, BLOCK: tl.constexpr):",
             f"    row = {row}",
             "    cols = tl.arange(0, BLOCK)",
             "    mask = cols < N",
             "    i = row * N + cols"]
    offsets = []
    for t in operands:
        strides = t.expand(shape).stride()
        dense = all(strides[d] == dense_strides[d] or shape[d] == 1 for d in range(x.dim()))
        offsets.append(strided_offset(shape, strides, order, dense))
    lines += epilogue_lines(body, operands, offsets, None, False)
    lines.append(f"    stored = v{len(body) - 1}.to({kind})")
    if norm.store:
        lines.append("    tl.store(x_ptr + i, stored, mask=mask)")
    lines += ["    v = tl.where(mask, stored.to(tl.float32), 0.0)",
              "    mean = tl.sum(v, axis=0) / N",
              "    d = tl.where(mask, v - mean, 0.0)",
              "    var = tl.sum(d * d, axis=0) / N",
              "    y = d * tl.rsqrt(var + eps)"]
    if norm.weight is not None:
        lines.append("    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)")
    if norm.bias is not None:
        lines.append("    y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)")
    lines.append(f"    tl.store(y_ptr + i, y.to({kind}), mask=mask)")
    lines.append(f"# torch {torch.__version__}")
    return "\n".join(lines) + "\n"


def pointwise_operands(body, skip_first: bool) -> list[torch.Tensor]:
    """The distinct tensors the pointwise nodes read, in first-use order."""
    seen: list[torch.Tensor] = []
    for k, (target, args, _) in enumerate(body):
        if k == 0 and skip_first:
            continue
        for pos in fusion.POINTWISE[target]:
            a = args[pos]
            if isinstance(a, torch.Tensor) and not any(a is s for s in seen):
                seen.append(a)
    return seen
