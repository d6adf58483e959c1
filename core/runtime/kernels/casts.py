"""Generated kernels that cast many tensors at once, on CUDA: `ops/casts.cast_group` into its buffers.

A bf16 training step casts every float32 weight to bfloat16 in its forward and every bfloat16
weight gradient back to float32 at the end of its backward: about 100 copies each way in
vit_b_16, each a kernel of its own in PyTorch, and most of them small. By the copy kernels
PyTorch picks (its unrolled one for a dtype change), vit_b_16's 102 weight casts took 304 us and
its 102 gradient casts 577 us per step on an H200, against 128 and 137 us as one kernel per
dozen tensors here (2026-12-01, torch 2.11, CUDA graphs of the casts
replayed: `tools/cast_bench.py`).

Each launch takes up to `MEMBERS` pairs (source, buffer) of one source dtype and one buffer dtype,
as plain arguments (no table in device memory: a captured step's launch needs nothing but its
arguments), and each program finds its pair by comparing its index with the running count of
programs (`END` arguments). Two kinds:

- FLAT: source and buffer dense with the same strides (both contiguous, say): the elements in
  memory order, `BLOCK` a program.
- COLUMNS: a 2-D buffer, contiguous, of a source that is its transpose's view (strides
  `(1, rows)`: a weight's gradient as a linear's backward computes it, `t(mm(...))`): tiles of
  `TILE` x `TILE`, read along columns and written along rows.

Any other pair (another layout, another device, a dtype outside the floating ones, 2**31 elements
or more) is copied by PyTorch (`copy_`), as the cast would have been. Offsets are 64-bit. The
counts and sizes are not specialised (Triton would make a count of 1 a constant, and the branches
that pick a pair would then give one name two types).
"""

from __future__ import annotations

import torch

from . import generated

MEMBERS = 16  # pairs per launch
BLOCK = 2048  # elements a FLAT program copies
TILE = 64  # a COLUMNS program's tile is TILE x TILE
FLAT, COLUMNS = "flat", "columns"
_ELEMENT = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def source(kind: str, members: int) -> str:
    """The kernel of `kind` over `members` pairs."""
    if kind == FLAT:
        params = ", ".join(f"S{k}, D{k}, N{k}, E{k}" for k in range(members))
        pick = [f"src, dst, n, b = S{k}, D{k}, N{k}, pid - {'E' + str(k - 1) if k else 0}" for k in range(members)]
        body = ("    offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)\n"
                "    mask = offs < n\n"
                "    v = tl.load(src + offs, mask=mask)\n"
                "    tl.store(dst + offs, v.to(dst.dtype.element_ty), mask=mask)\n")
        constants = "BLOCK: tl.constexpr"
    else:
        params = ", ".join(f"S{k}, D{k}, R{k}, C{k}, T{k}, E{k}" for k in range(members))
        pick = [f"src, dst, rows, cols, across, b = S{k}, D{k}, R{k}, C{k}, T{k}, pid - "
                f"{'E' + str(k - 1) if k else 0}" for k in range(members)]
        body = ("    i = (b // across) * TILE + tl.arange(0, TILE)\n"
                "    j = (b % across) * TILE + tl.arange(0, TILE)\n"
                "    i64 = i.to(tl.int64)\n"
                "    j64 = j.to(tl.int64)\n"
                "    mask = (i[:, None] < rows) & (j[None, :] < cols)\n"
                "    v = tl.load(src + i64[:, None] + j64[None, :] * rows, mask=mask)\n"
                "    tl.store(dst + i64[:, None] * cols + j64[None, :], v.to(dst.dtype.element_ty), mask=mask)\n")
        constants = "TILE: tl.constexpr"
    scalars = [name.strip() for name in params.split(",") if name.strip()[0] not in "SD"]
    lines = ["import triton", "import triton.language as tl", "", "", f"@triton.jit(do_not_specialize={scalars!r})",
             f"def kernel({params}, {constants}):", "    pid = tl.program_id(0)"]
    for k, chosen in enumerate(pick):
        if members == 1:
            lines.append(f"    {chosen}")
        elif k == 0:
            lines += [f"    if pid < E{k}:", f"        {chosen}"]
        elif k < members - 1:
            lines += [f"    elif pid < E{k}:", f"        {chosen}"]
        else:
            lines += ["    else:", f"        {chosen}"]
    return "\n".join(lines) + "\n" + body


_KERNELS: dict[tuple[str, int], generated.FixedKernel] = {}


def _kernel(kind: str, members: int) -> generated.FixedKernel:
    found = _KERNELS.get((kind, members))
    if found is None:
        found = _KERNELS[(kind, members)] = generated.FixedKernel(source(kind, members), f"{kind} casts")
    return found


def kind_of(src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """FLAT or COLUMNS where a kernel here copies `src` into `dst`, else None."""
    if not (src.is_cuda and dst.is_cuda and src.device == dst.device and src.dtype in _ELEMENT
            and dst.dtype in _ELEMENT and 0 < src.numel() < 2**31):
        return None
    return layout_kind(src, dst)


def layout_kind(src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """FLAT or COLUMNS by the two tensors' shapes and strides alone, else None."""
    if src.shape != dst.shape:
        return None
    if src.stride() == dst.stride() and _dense(dst):
        return FLAT
    if dst.dim() == 2 and dst.is_contiguous() and src.stride() == (1, src.shape[0]):
        return COLUMNS
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its span of memory once each, in some order of its dims."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def group_into(tensors, dtype: torch.dtype, **buffers) -> tuple[torch.Tensor, ...]:
    """`ops/casts.cast_group` into its buffers (`out0`, `out1`, ...; they have `dtype`)."""
    outs = [buffers[f"out{k}"] for k in range(len(tensors))]
    copy_all(list(tensors), outs)
    return tuple(outs)


def copy_all(sources: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Each source copied into its buffer (converting to the buffer's dtype): the kernels here
    where they apply, a launch per `MEMBERS` pairs of one kind and dtypes, else `copy_`."""
    launches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in zip(sources, buffers):
        kind = kind_of(src, dst)
        if kind is None:
            dst.copy_(src)
        else:
            launches.setdefault((kind, src.dtype, dst.dtype), []).append((src, dst))
    for (kind, _, _), pairs in launches.items():
        for start in range(0, len(pairs), MEMBERS):
            chunk = pairs[start:start + MEMBERS]
            if not _launch(kind, chunk):
                for src, dst in chunk:
                    dst.copy_(src)


def _launch(kind: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    args, end = [], 0
    for src, dst in pairs:
        if kind == FLAT:
            end += -(-src.numel() // BLOCK)
            args += [src, dst, src.numel(), end]
        else:
            rows, cols = dst.shape
            across = -(-cols // TILE)
            end += -(-rows // TILE) * across
            args += [src, dst, rows, cols, across, end]
    constants = {"BLOCK": BLOCK} if kind == FLAT else {"TILE": TILE}
    return _kernel(kind, len(pairs)).launch((end,), *args, **constants, num_warps=4)
