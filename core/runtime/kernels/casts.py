"""Many casts at once, on CUDA: `ops/casts.cast_group` into its buffers.

A bf16 training step casts every bfloat16 weight gradient back to float32 at the end of its
backward: about 100 copies in vit_b_16, each a kernel of its own in PyTorch, and a weight's
gradient is read through a transpose (a linear's backward computes it as `t(mm(...))`), which
PyTorch's copy kernels read slowly: 1.02 ms for vit_b_16's gradients, against 0.17 ms here
(H200, torch 2.11, 2026-12-01, CUDA graphs of the casts replayed: `tools/cast_bench.py`).

Pairs (source, buffer) of one source dtype and one buffer dtype go by kind:

- FLAT: source and buffer dense with the same strides (both contiguous, say): all of them in one
  `torch._foreach_copy_`, which copies a few dozen tensors a kernel (vit_b_16's 152 weights cast
  to bfloat16: 0.16 ms, against 0.39 ms a copy each; a generated kernel of the same plan took 0.34).
- COLUMNS: a 2-D buffer, contiguous, of a source that is its transpose's view (strides
  `(1, rows)`): a generated kernel of up to `MEMBERS` pairs a launch, given as plain arguments (no
  table in device memory: a captured step's launch needs nothing but its arguments); each program
  finds its pair by comparing its index with the running count of programs (`E` arguments), and
  copies a tile of `TILE` x `TILE`, read along columns and written along rows.

Any other pair (another layout, another device, a dtype outside the floating ones, 2**31 elements
or more) is copied by PyTorch (`copy_`), as the cast would have been. Offsets are 64-bit. The
counts and sizes are not specialised (Triton would make a count of 1 a constant, and the branches
that pick a pair would then give one name two types).
"""

from __future__ import annotations

import torch

from . import generated

MEMBERS = 16  # COLUMNS pairs a launch
TILE = 64  # a COLUMNS program's tile is TILE x TILE
FLAT, COLUMNS = "flat", "columns"
_ELEMENT = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def source(members: int) -> str:
    """The COLUMNS kernel over `members` pairs."""
    params = ", ".join(f"S{k}, D{k}, R{k}, C{k}, T{k}, E{k}" for k in range(members))
    scalars = [name.strip() for name in params.split(",") if name.strip()[0] not in "SD"]
    lines = ["import triton", "import triton.language as tl", "", "", f"@triton.jit(do_not_specialize={scalars!r})",
             f"def kernel({params}, TILE: tl.constexpr):", "    pid = tl.program_id(0)"]
    for k in range(members):
        chosen = f"src, dst, rows, cols, across, b = S{k}, D{k}, R{k}, C{k}, T{k}, pid - {f'E{k - 1}' if k else 0}"
        if members == 1:
            lines.append(f"    {chosen}")
        else:
            lines += [f"    if pid < E{k}:" if k == 0 else f"    elif pid < E{k}:" if k < members - 1 else "    else:",
                      f"        {chosen}"]
    return "\n".join(lines) + """
    i = (b // across) * TILE + tl.arange(0, TILE)
    j = (b % across) * TILE + tl.arange(0, TILE)
    i64 = i.to(tl.int64)
    j64 = j.to(tl.int64)
    mask = (i[:, None] < rows) & (j[None, :] < cols)
    v = tl.load(src + i64[:, None] + j64[None, :] * rows, mask=mask)
    tl.store(dst + i64[:, None] * cols + j64[None, :], v.to(dst.dtype.element_ty), mask=mask)
"""


_KERNELS: dict[int, generated.FixedKernel] = {}  # pairs a launch -> its kernel


def _kernel(members: int) -> generated.FixedKernel:
    found = _KERNELS.get(members)
    if found is None:
        found = _KERNELS[members] = generated.FixedKernel(source(members), "transposed casts")
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
    """Each source copied into its buffer (converting to the buffer's dtype): by kind and dtypes,
    FLAT pairs in one `_foreach_copy_`, COLUMNS pairs a launch per `MEMBERS`, the rest by `copy_`."""
    launches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in zip(sources, buffers):
        kind = kind_of(src, dst)
        if kind is None:
            dst.copy_(src)
        else:
            launches.setdefault((kind, src.dtype, dst.dtype), []).append((src, dst))
    for (kind, _, _), pairs in launches.items():
        if kind == FLAT:
            torch._foreach_copy_([d for _, d in pairs], [s for s, _ in pairs])
            continue
        for start in range(0, len(pairs), MEMBERS):
            chunk = pairs[start:start + MEMBERS]
            if not _launch(chunk):
                for src, dst in chunk:
                    dst.copy_(src)


def _launch(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """COLUMNS' kernel over `pairs`; False where it cannot be built."""
    args, end = [], 0
    for src, dst in pairs:
        rows, cols = dst.shape
        across = -(-cols // TILE)
        end += -(-rows // TILE) * across
        args += [src, dst, rows, cols, across, end]
    return _kernel(len(pairs)).launch((end,), *args, TILE=TILE, num_warps=4)
