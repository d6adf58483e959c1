"""Attention as one generated kernel that writes its planned buffer, chosen per call by measurement.

Swin's windows attend over 49 keys with 32 values per head, and an additive mask (its relative
position bias, shifted windows' mask too). PyTorch's scaled-dot-product attention runs them in
float32 as its memory-efficient kernel, whose 64 x 64 tiles suit long sequences: at batch 8 it
took 0.37 ms of swin_t's 3.36 (H100, `kernel_diff_swin_t_b8_2026-11-25.md`), where
torch.compile's softmax kernel and two GEMMs took 0.15. Here one program holds all of one head's
keys: it loads its queries, the keys and the values once, computes the scores, adds the mask
(read through its strides, broadcast dims at stride 0), takes a softmax in float32 and multiplies
by the values, and stores the rows through the result's strides. In float32 each product is
taken as three TF32 products on the tensor cores (`FLOAT32_PRODUCTS`, Triton's "tf32x3"), which
keeps float32's accuracy (plain TF32 would round every operand to 10 bits); half precision uses
the tensor cores and float32 accumulation.

Past MAX_KEYS keys (vit_b_16 attends over 197) a program walks the keys KEY_BLOCK at a time and
keeps, per query, the largest score so far, the sum of exponentials and the weighted values, each
rescaled when the largest score grows (the online softmax of FlashAttention). PyTorch's attention
has no `out=` form: its result is allocated during the capture, in the graph's pool (a 20 MiB
segment at vit_b_16's batch 8), and copied into the head merge's buffer by a second kernel. This
kernel writes that buffer itself.

Which one runs is measured (`Attention`): the first call of a signature outside a capture times
this kernel on each of its tiles (`tiles`) and PyTorch's attention, each in a CUDA graph, checks
every result of the kernel against PyTorch's and keeps the fastest (the `attention_slower` setting). Choices last for
the process; they are not kept in the cache folder, so each process times them again. A call
first seen inside a capture, a kernel that fails to build and one that disagrees all leave
PyTorch's attention in place.
The `attention_kernel` setting off turns it off.
"""

from __future__ import annotations

import math

import torch

from . import generated
from . import recall
from ..base import timing
from ..base.claimed import walking
from .codegen import HEADER, INT32_LIMIT, TL_KINDS, program_id, span
from ..base import settings

MAX_KEYS = 128  # keys one program holds in one tile (its queries: up to 64, `blocks`)
MAX_LONG_KEYS = 4096  # keys a program walks KEY_BLOCK at a time, past MAX_KEYS
KEY_BLOCK = 64
TILES = ((32, 32, 4), (32, 64, 4), (64, 32, 4), (128, 32, 8))  # timed beside `blocks`' own (`tiles`)
MAX_DIM = 128  # elements of a query, key or value row
FLOAT32_PRODUCTS = "tf32x3"  # float32 products as three TF32 ones (float32's accuracy); "ieee": on the FMA units

_built: dict[tuple, object] = {}  # call signature -> launcher, or None where it failed to build
_chosen: dict[tuple, bool] = {}  # call signature -> whether this kernel runs


def blocks(queries: int, keys: int, dim: int) -> tuple[int, int, int]:
    """(queries, keys, row elements) of one program's tiles: powers of two of at least 16 (the
    smallest tile a dot product takes), queries at most 64 per program, keys KEY_BLOCK at a time
    past MAX_KEYS."""
    def up(n: int) -> int:
        return max(16, 1 << (n - 1).bit_length())
    return min(64, up(queries)), up(keys) if keys <= MAX_KEYS else KEY_BLOCK, up(dim)


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, out: torch.Tensor, dropout, causal,
         scale, gqa) -> bool:
    """Whether this kernel computes `scaled_dot_product_attention(q, k, v, mask, dropout, causal,
    scale=scale, enable_gqa=gqa)` into `out`: 4-D CUDA tensors of one float dtype, (batch, heads,
    queries, row) with keys and values of the same batch, heads and row, at most MAX_LONG_KEYS keys
    and MAX_DIM elements a row, no dropout, no grouped-query heads, and a mask, if any, a float
    tensor of that dtype that broadcasts to (batch, heads, queries, keys), never with `causal`
    (PyTorch refuses the two together)."""
    if not (settings.current().attention_kernel
            and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(out, torch.Tensor) and out.is_cuda):
        return False
    if dropout not in (0, 0.0) or causal not in (True, False) or gqa not in (False, None) \
            or not (scale is None or isinstance(scale, (int, float)) and math.isfinite(scale)):
        return False
    if not all(t.dim() == 4 and t.dtype == q.dtype and t.device == out.device for t in (k, v, out)) \
            or q.dtype not in TL_KINDS or q.dim() != 4:
        return False
    b, h, lq, d = q.shape
    lk = k.shape[2]
    if tuple(k.shape) != (b, h, lk, d) or tuple(v.shape) != (b, h, lk, d) or tuple(out.shape) != (b, h, lq, d):
        return False
    if not (0 < lk <= MAX_LONG_KEYS and 0 < d <= MAX_DIM and lq > 0 and b * h > 0):
        return False
    if mask is not None:
        if causal or not isinstance(mask, torch.Tensor) or mask.dtype != q.dtype or mask.device != out.device \
                or mask.dim() > 4:
            return False
        try:
            mask.expand(b, h, lq, lk)
        except RuntimeError:
            return False
    return True


def _strides(t: torch.Tensor, shape: tuple) -> tuple[int, ...]:
    return tuple(t.expand(shape).stride())


def source(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, out: torch.Tensor, causal: bool,
           scale: float) -> str:
    """The kernel's text, specialised to these tensors' shapes and strides: program (i, j) computes
    queries j * BLOCK_M ... of batch-and-head i. Up to MAX_KEYS keys it holds them all in one
    tile; past that it walks them BLOCK_N at a time, keeping each row's running maximum, sum and
    weighted values (the online softmax). Every index is 64-bit where a tensor spans more than
    2**31 - 1 elements through its strides (a view of a larger buffer may)."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    tensors = [q, k, v, out] + ([mask.expand(b, h, lq, lk)] if mask is not None else [])
    wide = any(span(t) > INT32_LIMIT for t in tensors) or b * h > INT32_LIMIT
    first, index = program_id(wide), ".to(tl.int64)" if wide else ""
    kind = TL_KINDS[q.dtype]
    precision = f', input_precision="{FLOAT32_PRODUCTS}"' if q.dtype == torch.float32 else ""
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()

    def base(s):
        return f"bh // {h} * {s[0]} + bh % {h} * {s[1]}"

    def scores(pad: str) -> list[str]:
        """`pad`-indented lines that load the keys of `cols` and leave their masked, scaled scores in s."""
        lines = [f"{pad}k = tl.load(k_ptr + ({base(ks)}) + cols[:, None] * {ks[2]} + d[None, :] * {ks[3]}, "
                 "mask=cmask[:, None] & dmask[None, :], other=0.0)",
                 f"{pad}s = tl.dot(q, tl.trans(k){precision}) * {float(scale)!r}"]
        if mask is not None:
            ms = _strides(mask, (b, h, lq, lk))
            lines.append(f"{pad}s = s + tl.load(mask_ptr + ({base(ms)}) + rows[:, None] * {ms[2]} + cols[None, :] * "
                         f"{ms[3]}, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)")
        keep = "cmask[None, :] & (cols[None, :] <= rows[:, None])" if causal else "cmask[None, :]"
        return lines + [f"{pad}s = tl.where({keep}, s, float('-inf'))"]

    def values(pad: str) -> str:
        return (f"{pad}v = tl.load(v_ptr + ({base(vs)}) + cols[:, None] * {vs[2]} + d[None, :] * {vs[3]}, "
                "mask=cmask[:, None] & dmask[None, :], other=0.0)")

    lines = [*HEADER,
             "def kernel(q_ptr, k_ptr, v_ptr, out_ptr, mask_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, "
             "BLOCK_D: tl.constexpr):",
             f"    bh = {first}",
             f"    rows = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)){index}",
             f"    d = tl.arange(0, BLOCK_D){index}",
             f"    rmask = rows < {lq}",
             f"    dmask = d < {d}",
             f"    q = tl.load(q_ptr + ({base(qs)}) + rows[:, None] * {qs[2]} + d[None, :] * {qs[3]}, "
             "mask=rmask[:, None] & dmask[None, :], other=0.0)"]
    if lk <= MAX_KEYS:  # every key in one tile
        lines += [f"    cols = tl.arange(0, BLOCK_N){index}",
                  f"    cmask = cols < {lk}",
                  *scores("    "),
                  "    top = tl.max(s, axis=1)",
                  "    top = tl.where(top == float('-inf'), 0.0, top)",  # a row with every key masked gives zeros
                  "    p = tl.exp(s - top[:, None])",
                  "    total = tl.sum(p, axis=1)",
                  values("    "),
                  f"    o = tl.dot(p.to({kind}), v{precision})"]
    else:  # BLOCK_N keys at a time: the scores so far rescaled by exp(old maximum - new maximum)
        lines += ["    top = tl.full([BLOCK_M], float('-inf'), tl.float32)",
                  "    total = tl.zeros([BLOCK_M], tl.float32)",
                  "    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)",
                  f"    for start in range(0, {lk}, BLOCK_N):",
                  f"        cols = (start + tl.arange(0, BLOCK_N)){index}",
                  f"        cmask = cols < {lk}",
                  *scores("        "),
                  "        new = tl.maximum(top, tl.max(s, axis=1))",
                  "        shift = tl.where(new == float('-inf'), 0.0, new)",  # no key kept yet: nothing to scale
                  "        p = tl.exp(s - shift[:, None])",
                  "        kept = tl.exp(top - shift)",
                  "        total = total * kept + tl.sum(p, axis=1)",
                  values("        "),
                  f"        o = o * kept[:, None] + tl.dot(p.to({kind}), v{precision})",
                  "        top = new"]
    lines += ["    o = tl.where(total[:, None] > 0.0, o / total[:, None], 0.0)",
              f"    tl.store(out_ptr + ({base(os_)}) + rows[:, None] * {os_[2]} + d[None, :] * {os_[3]}, "
              f"o.to({kind}), mask=rmask[:, None] & dmask[None, :])",
              f"# torch {torch.__version__}"]
    return "\n".join(lines) + "\n"


def grid(q: torch.Tensor, k: torch.Tensor, tile: tuple[int, int, int] | None = None) -> tuple[tuple[int, int], dict]:
    """The launch grid and the kernel's block constants for these queries and keys: `blocks`'
    tiles, or `tile` (queries per program, keys per step past MAX_KEYS, warps; one of `tiles`)."""
    b, h, lq, d = q.shape
    block_m, block_n, block_d = blocks(lq, k.shape[2], d)
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    if tile is not None:
        block_m, warps = tile[0], tile[2]
        block_n = tile[1] if k.shape[2] > MAX_KEYS else block_n
    return (b * h, -(-lq // block_m)), {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                                         "num_warps": warps}


def tiles(q: torch.Tensor, k: torch.Tensor) -> list[tuple[int, int, int]]:
    """The tiles timed for a call beside `blocks`' own: (queries per program, keys per step,
    warps). On the H200, fp32 at vit_b_16's 197 keys, 12 heads of 64, batch 8: 32 queries and 32
    keys a step on 4 warps took 47 us where 64 and 64 took 67 (PyTorch's attention and the copy
    into the merged heads: 56); at batch 1 32 by 64 took 14 us against 23; at 128 keys, batch 8,
    32 queries on 4 warps or 128 on 8 took 13 to 14 us where 64 on 8 took 23. Half precision
    liked 64 by 32 on 4 warps. Tiles past the queries there are, and keys per step that do not
    change the kernel (every key in one tile), are left out."""
    lq, lk = q.shape[2], k.shape[2]
    most = max(16, 1 << (lq - 1).bit_length())
    chosen = []
    for tile in TILES:
        block_m, block_n, warps = tile
        tile = (min(block_m, most), block_n if lk > MAX_KEYS else 0, warps)
        if tile not in chosen:
            chosen.append(tile)
    return chosen


def launcher(kernel, tile: tuple[int, int, int] | None = None):
    """A launcher for `source`'s kernel (as `generated.define` returns it), on `tile` (see `grid`)."""
    def launch(q, k, v, mask, out) -> None:
        g, constants = grid(q, k, tile)
        kernel[g](q, k, v, out, out if mask is None else mask, **constants)

    return launch


class Attention:
    """`scaled_dot_product_attention` of one op, written into a given tensor by this kernel where
    it was measured faster (see the module docstring). `kwargs` are the op's keyword constants.
    Choices and kernels are kept for the process under the call's signature, so the same
    attention in another op, tuning candidate or load is not timed again."""

    def __init__(self, op_id: int, kwargs: dict):
        self.op_id = op_id
        self.scale, self.gqa = kwargs.get("scale"), kwargs.get("enable_gqa", False)

    def __call__(self, args: list, out: torch.Tensor) -> bool:
        """Whether the attention of `args` (the op's positional arguments) was written into `out`
        by this kernel; False, with nothing run, where PyTorch's attention runs instead."""
        q, k, v, mask, dropout, causal = (list(args) + [None, 0.0, False])[:6]
        if not fits(q, k, v, mask, out, dropout, causal, self.scale, self.gqa):
            return False
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        key = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t
                    for t in (q, k, v, mask, out)) + (out.device.index, bool(causal), float(scale), FLOAT32_PRODUCTS,
                                             settings.current().digest())
        chosen = _chosen.get(key) if not walking() else \
            self._choose(key, q, k, v, mask, out, bool(causal), float(scale))  # a walk tries every tile, keeps none
        if chosen is None:
            if torch.cuda.is_current_stream_capturing():
                return False  # chosen in the warm-up; a call first seen in a capture runs PyTorch's way
            chosen = _chosen[key] = self._choose(key, q, k, v, mask, out, bool(causal), float(scale))
        if chosen:
            _built[key](q, k, v, mask, out)
        return chosen

    def _choose(self, key: tuple, q, k, v, mask, out: torch.Tensor, causal: bool, scale: float) -> bool:
        """Whether this kernel runs this call. An earlier load's choice (`recall`) where one was
        kept: PyTorch's attention, or the kernel on the kept tile where its result agrees with
        PyTorch's. Else build the kernel and keep its fastest tile that agrees; whether that takes
        at most `attention_slower` times PyTorch's time (its result copied into `out` included), which is kept."""
        def pytorch() -> torch.Tensor:
            if walking():  # it launches no generated kernel; on claimed tensors its math path imports
                return torch.empty_like(out)  # torch._dynamo and sympy (3 s of BERT's walk on the CPU builder)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale=scale)

        now = settings.current()
        setting = (key, now.attention_tolerance, now.attention_half_tolerance, now.attention_slower)
        kept = recall.recalled("attention", setting, out.device) or {}
        if kept.get("runs") is False:
            return False
        ref = pytorch()
        if not bool(torch.isfinite(ref).all()):
            return False  # nothing to check the kernel against
        kernel = generated.define(source(q, k, v, mask, out, causal, scale))
        if not generated.launch_once(_built, key, lambda: launcher(kernel), (q, k, v, mask, out),
                                   f"op {self.op_id} as generated attention"):
            return False
        tolerance = now.attention_tolerance if q.dtype == torch.float32 else now.attention_half_tolerance

        def agrees() -> bool:
            return float((out.float() - ref.float()).abs().max()) <= tolerance * max(float(ref.abs().max()), 1e-6)
        if not agrees():
            generated.STATS.fallbacks.append(f"op {self.op_id}: generated attention disagrees with PyTorch's")
            return False
        if kept.get("runs") is True and (kept.get("tile") is None or recall.known_tile(kept["tile"], tiles(q, k))):
            launch = _built[key] if kept.get("tile") is None else _tried(kernel, tuple(kept["tile"]),
                                                                         (q, k, v, mask, out), agrees)
            if launch is not None:
                _built[key] = launch
                return True
        ours, best = timing.graph_us(lambda: _built[key](q, k, v, mask, out), out.device), None
        for tile in tiles(q, k):  # each checked; one this GPU cannot hold (shared memory) is passed over
            launch = None if grid(q, k, tile) == grid(q, k) else _tried(kernel, tile, (q, k, v, mask, out), agrees)
            if launch is None:
                continue
            us = timing.graph_us(lambda: launch(q, k, v, mask, out), out.device)
            if us < ours:
                ours, best, _built[key] = us, tile, launch
        runs = ours <= now.attention_slower * timing.graph_us(lambda: out.copy_(pytorch()), out.device)
        recall.keep("attention", setting, out.device, {"runs": runs, "tile": None if best is None else list(best)})
        return runs


def _tried(kernel, tile: tuple, args: tuple, agrees):
    """The kernel's launcher on `tile`, where it ran this call and its result agrees; else None."""
    launch = launcher(kernel, tile)
    try:
        launch(*args)
    except Exception:
        return None
    return launch if agrees() else None
