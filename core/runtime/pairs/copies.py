"""Copy pairs: an op without an out= kernel, a view of its result and the copy of that view (the
head merge after attention: sdpa, transpose(1, 2), contiguous or reshape). The computed result,
or a writer's, goes through the view straight into the copy's buffer: one copy where there were
two."""

from __future__ import annotations

from typing import Sequence

import torch

from ...ir import ACTIVATION, Graph, Op
from ...ops import arguments
from ..placed.placement import PlacedOp
from ..placed.substitutes import reshape_copy
from .common import next_on_stream, views_of

COPYING_READERS = frozenset({"aten::contiguous.default", "aten::reshape.default", "aten::flatten.using_ints"})


def copy_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, PlacedOp]]:
    """op -> (a view of its result, the op that copies that view into a buffer) where the op has no
    out= kernel (its result is computed, then copied in), that view is its result's one reader and
    the copy the view's, and the view and the copy are the next ops on its stream, waiting for
    nothing. `through_view` (or `by_writer`) then copies the result through the view straight
    into the copy's buffer (sdpa's result is already laid out as the merged heads), and the op's
    own buffer is never written: only that view, then the copy, read it."""
    following = next_on_stream(order, stream_of)
    readers: dict[int, set[int]] = {}
    for op in graph.ops:
        for r in op.refs():
            readers.setdefault(r, set()).add(op.id)
    outputs = set(graph.outputs)
    views = views_of(graph)
    pairs = {}
    for p in placed:
        op = p.op
        if p.substitute is not None or p.out_fn is not None or len(op.outputs) != 1 or op.mutates \
                or graph.values[op.outputs[0]].alias_of is not None or graph.values[op.outputs[0]].kind != ACTIVATION:
            continue
        value = op.outputs[0]
        view = following.get(op.id)
        copy = following.get(view) if view is not None else None
        if copy is None or readers.get(value, set()) != {view} or value in outputs or waits[view] or waits[copy]:
            continue
        seen = graph.ops[view].outputs
        if len(seen) != 1 or graph.ops[view].mutates or views.get(value) != {seen[0]} or seen[0] in outputs \
                or seen[0] in views or readers.get(seen[0], set()) != {copy} \
                or graph.ops[copy].target not in COPYING_READERS \
                or graph.values[graph.ops[copy].outputs[0]].alias_of is not None:
            continue
        pairs[op.id] = (placed[view], placed[copy])
    return pairs


def by_writer(issue, p: PlacedOp, args, out: torch.Tensor) -> bool:
    """Whether `p`'s writer wrote its result into the copy's buffer seen back through the view
    (`unviewed`), so that the copy has nothing left to do; else into `out`."""
    view, copy = issue.pairs.copies[p.op.id]
    target = issue.views.get(copy.op.outputs[0])
    into = unviewed(view.op, target, out) if target is not None else None
    if into is None:
        return p.writer(args, out)
    if not p.writer(args, into):
        return False
    issue.written.add(copy.op.id)
    return True


def through_view(issue, p: PlacedOp, result: torch.Tensor) -> bool:
    """`result` seen through the view after `p`, copied into the buffer of the copy after that;
    False, with nothing written, where that buffer does not fit."""
    view, copy = issue.pairs.copies[p.op.id]
    target = issue.views.get(copy.op.outputs[0])
    if target is None or target.dtype != result.dtype:
        return False
    issue.env[p.op.outputs[0]] = result
    args, kwargs = arguments.op_arguments(view.op, issue.env, issue.device)
    seen = view.fn(*args, **kwargs)
    if not isinstance(seen, torch.Tensor) or reshape_copy([seen], target) is None:
        return False
    issue.written.add(copy.op.id)
    return True


def unviewed(view: Op, target: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """`target` (the buffer of a copy of `view`'s result) seen in `out`'s shape, where `view` is
    a transpose or permutation of `out`: what writing `out` through the view into `target` writes.
    None where the view is another op, or the shapes or dtypes do not match."""
    if target.dtype != out.dtype or target.device != out.device:
        return None
    if view.target == "aten::transpose.int" and len(view.args) == 3:
        d0, d1 = view.args[1], view.args[2]
        seen, back = out.transpose(d0, d1), (lambda t: t.transpose(d0, d1))
    elif view.target == "aten::permute.default" and len(view.args) == 2:
        dims = [d % out.dim() for d in view.args[1]]
        seen, back = out.permute(dims), (lambda t: t.permute(sorted(range(len(dims)), key=dims.__getitem__)))
    else:
        return None
    if tuple(target.shape) != tuple(seen.shape):
        if not target.is_contiguous() or target.numel() != out.numel():
            return None
        target = target.view(seen.shape)
    into = back(target)
    return into if tuple(into.shape) == tuple(out.shape) else None
