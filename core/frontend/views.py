"""Ops that are views by another name, as torch's joint trace writes them: the builder lowers
each as the view (or reshape) it is, so that it gets no buffer and no copy of its own, and a
training step's layout choice sees its input as viewed (`runtime/assemble/choice.viewed`).

- `_unsafe_view(x, shape)`: autograd's reshape of a result it made. vit_b_16's step has 120 of
  them, 1.5 GiB at batch 32, each of which was computed and then copied.
- `as_strided(x, size, stride[, 0])` laid densely over all of `x` from its first element, row-major
  (a dimension of one may have any stride): average pooling to 1x1 restrides its mean so where its
  input has channels-last strides (ConvNeXt, which a step refused at this op).
- `as_strided_scatter(base, src, size, stride[, 0])` of such a region: all of its result is `src`,
  reshaped to `base`'s shape (the joint trace's backward of that restride, into zeros).

Any other use of these ops is left as it is, and the allowlist refuses it.
"""

from __future__ import annotations

import math

from ..ir import Ref

UNSAFE_VIEW = "aten::_unsafe_view.default"
AS_STRIDED, AS_STRIDED_SCATTER = "aten::as_strided.default", "aten::as_strided_scatter.default"


def as_view(meta: dict, target: str, ins: list) -> tuple[str, list] | None:
    """(target, inputs) of the view or reshape that `target` on `ins` (schema order; `meta`: value
    id -> its meta tensor) is, or None where it is not one."""
    if target == UNSAFE_VIEW and _viewable(meta, ins):
        return "aten::view.default", [ins[0], list(ins[1])]
    if target in (AS_STRIDED, AS_STRIDED_SCATTER) and _dense_restride(meta, target, ins):
        if target == AS_STRIDED:
            return "aten::view.default", [ins[0], list(ins[1])]
        return "aten::reshape.default", [ins[1], list(meta[ins[0].id].shape)]
    return None


def _viewable(meta: dict, ins: list) -> bool:
    """Whether `_unsafe_view(*ins)` can be a view of its input."""
    try:
        return isinstance(ins[0], Ref) and meta[ins[0].id].view(ins[1]) is not None
    except (RuntimeError, TypeError):
        return False


def _dense_restride(meta: dict, target: str, ins: list) -> bool:
    """Whether `as_strided(x, size, stride, offset)` (or `as_strided_scatter(base, src, size, ...)`)
    lays its size over all of a dense value from its first element, row-major (strides of
    dimensions of one ignored)."""
    base, rest = ins[0], ins[2:] if target == AS_STRIDED_SCATTER else ins[1:]
    size, stride, offset = (list(rest) + [None])[:3]
    if not isinstance(base, Ref) or offset not in (None, 0) or not _ints(size) or not _ints(stride) \
            or len(size) != len(stride):
        return False
    m = meta[base.id]
    if m.storage_offset() or not m.is_contiguous() or m.numel() != math.prod(size):
        return False
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    if target == AS_STRIDED_SCATTER:
        src = meta.get(ins[1].id) if isinstance(ins[1], Ref) else None
        return src is not None and tuple(src.shape) == tuple(size) and src.dtype == m.dtype
    return True


def _ints(values) -> bool:
    """A list or tuple of plain ints (a crafted program may give anything)."""
    return isinstance(values, (list, tuple)) and all(type(v) is int for v in values)
