"""The strides of an elementwise op's result: torch's rule
(`torch._prims_common.compute_elementwise_output_strides`) on plain integers, for the shape
rules (`shapes.py`), without the sympy import that torch's version brings on its first call
(0.6 s on the CPU builder)."""

from __future__ import annotations

import torch


def elementwise_strides(operands: list[torch.Tensor], shape: tuple) -> tuple[int, ...]:
    """The strides of an elementwise op's result over `operands` (already broadcast to `shape`):
    torch._prims_common.compute_elementwise_output_strides on plain integers (it imports sympy)."""
    ndim = len(shape)
    if ndim <= 1:
        return (1,) * ndim
    contiguous = all(t.is_contiguous() for t in operands)
    channels_last = ndim == 4 and all(t.is_contiguous(memory_format=torch.channels_last) for t in operands)
    if contiguous and not channels_last:
        perm = list(range(ndim))
    elif channels_last and not contiguous:
        perm = [0, *range(2, ndim), 1]
    else:
        perm = _physical_order(operands, shape)
    strides, step = [0] * ndim, 1
    for k in reversed(range(ndim)):  # contiguous in the physical order
        strides[perm[k]] = step
        step *= max(shape[perm[k]], 1)
    return tuple(strides)


def _physical_order(operands: list[torch.Tensor], shape: tuple) -> list[int]:
    """compute_elementwise_output_logical_to_physical_perm: dimensions sorted, outermost first,
    by the first operand whose strides tell them apart (a broadcast dimension tells nothing)."""
    def ge(p: int, q: int) -> bool:
        return True if q == 0 else False if p == 0 else p >= q or p % q == 0

    def should_swap(i: int, j: int) -> int:
        for t in operands:
            si, sj = t.stride()[i], t.stride()[j]
            if si == 0 or sj == 0:
                continue
            if si == sj:
                if ge(shape[j], shape[i]):
                    continue
                return 1
            if ge(sj, si):
                return -1
            if ge(si, sj):
                return 1
        return 0

    perm = list(reversed(range(len(shape))))
    for i in range(1, len(shape)):
        dim1 = i
        for dim0 in reversed(range(i)):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return list(reversed(perm))


def suggested_format(t: torch.Tensor) -> torch.memory_format:
    """Tensor.suggest_memory_format(): channels_last (channels_last_3d) where a 4-D (5-D) tensor's
    strides run channels fastest, then width, height (depth) and batch, else contiguous
    (torch._prims_common.are_strides_like_channels_last_or_false, which imports sympy)."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(t.dim())
    shape, strides = t.shape, t.stride()
    if order is None or strides[1] == 0:
        return torch.contiguous_format
    least = 0
    for d in order:
        if shape[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return torch.contiguous_format
        least = strides[d] * shape[d]
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
