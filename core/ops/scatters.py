"""Disjoint slices of one tensor's gradient as one op: what a training step's joint graph holds after
`passes/scatter_slice_gradients.py`, and what it computes (on any device; a step writes the pieces
into its buffer, `runtime/joint.slice_sum_into`).

    out = slice_sum((g0, g1, ...), (slices0, slices1, ...), sizes, covers)

`out` has shape `sizes` and the pieces' dtype; each piece `gk` lies in the view of `out` that its
`slicesk` take, a tuple of (dim, start, end, step) applied in order as `aten::slice` would, and
every element that no piece lies in is zero. No two pieces share an element; `covers` says that
together they cover every element (then nothing needs zeroing first).
"""

from __future__ import annotations

import torch

SLICE_SUM = "nimble::slice_sum"


def view_of(t: torch.Tensor, slices) -> torch.Tensor:
    """`t` sliced by `slices` ((dim, start, end, step), in order), as a view."""
    for dim, start, end, step in slices:
        t = torch.ops.aten.slice.Tensor(t, dim, start, end, step)
    return t


def slice_sum(pieces, slices, sizes, covers: bool) -> torch.Tensor:
    return copied_in(pieces[0].new_zeros(tuple(sizes)), pieces, slices)


def copied_in(out: torch.Tensor, pieces, slices) -> torch.Tensor:
    """`out` with each piece copied into the view its slices take."""
    for piece, where in zip(pieces, slices):
        view_of(out, where).copy_(piece)
    return out
