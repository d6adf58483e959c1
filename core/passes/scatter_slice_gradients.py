"""Training graphs only (`TrainStep` runs it before fusion): the gradient of a tensor that the forward
took apart into strided slices, which autograd sums from one chain of `slice_backward`s per piece
(each a map of zeros the size of what it slices, with the piece copied in), becomes one
`nimble::slice_sum` (`ops/scatters.py`) that copies each piece into its place in one buffer.

    add(add(add(sb(sb(g0, (B, H/2, W, C), 2, 0, end, 2), (B, H, W, C), 1, 0, end, 2), sb(sb(g1, ...)))), ...)
        ->  slice_sum((g0, g1, g2, g3), (((1, 0, end, 2), (2, 0, end, 2)), ...), (B, H, W, C), covers=True)

Swin's patch merging takes every other row and column of its map in four ways and concatenates
them; the backward of each of swin_t's three merges wrote eight maps of zeros and read four of
them again to add them up. Alone at batch 32 in bf16 on an H200, one merge's slice_backwards and
sum took 255 to 268 us, and four copies into one buffer 71 to 74 us
(`benchmarks/results/training_224_h200_2026-11-30.md`, session 21).

Taken where a tree of adds (alpha 1) sums at least two chains of slice_backwards and at most one
other value (a swin_t merge's map also has a gradient from its residual path), nothing else reads
what the chains and the adds beneath the top make, the pieces share no element of the result, and
the result is contiguous; the other value is then added to the pieces' sum. Each element of the
sum is then its one piece's value (or zero) plus the other value, as the adds gave it, bit for bit
but for the sign of a zero. A result that the pieces do not cover is zeroed first.
"""

from __future__ import annotations

import dataclasses
import math

from ..ir import Graph, Op, Ref, TensorSpec
from ..ops import scatters
from .rewrite import readers_of, sole_reader
from .substitute import in_order, rebuild

ADD = "aten::add.Tensor"
SLICE_BACKWARD = "aten::slice_backward.default"
MAX_CELLS = 1 << 16  # elements of the sliced dims whose coverage a rewrite checks, at most


def scatter_slice_gradients(graph: Graph) -> Graph:
    readers = readers_of(graph)
    only_read_by = sole_reader(graph, readers)
    producer = {v: op for op in graph.ops for v in op.outputs}

    def chain(value: int, reader: Op) -> list[Op] | None:
        """The slice_backwards that make `value`, outermost first, where only they do."""
        found = []
        while True:
            op = producer.get(value)
            if op is None or op.target != SLICE_BACKWARD or not only_read_by(value, reader) \
                    or len(op.args) != 6 or op.kwargs or not isinstance(op.args[0], Ref):
                return found or None
            found.append(op)
            value, reader = op.args[0].id, op

    def tree(op: Op) -> tuple[list[Op], list[list[Op]], list[Ref]] | None:
        """The adds at and beneath `op`, the slice_backward chains they sum and the other values
        they add, or None where `op` is no such add."""
        if op.target != ADD or op.kwargs not in ((), (("alpha", 1),)) or len(op.args) != 2 \
                or not all(isinstance(a, Ref) for a in op.args):
            return None
        adds, chains, others = [op], [], []
        for a in op.args:
            below = producer.get(a.id)
            found = chain(a.id, op) if below is not None and below.target == SLICE_BACKWARD else None
            more = tree(below) if below is not None and below.target == ADD and only_read_by(a.id, op) else None
            if found is not None:
                chains.append(found)
            elif more is not None:
                adds.extend(more[0])
                chains.extend(more[1])
                others.extend(more[2])
            else:
                others.append(a)
        return adds, chains, others

    values = list(graph.values)
    dropped: set[int] = set()
    replaced: dict[int, Op] = {}
    before: dict[int, list[Op]] = {}
    for op in reversed(graph.ops):  # an add before those beneath it: the largest tree is taken
        if op.target != ADD or op.id in dropped:
            continue
        found = tree(op)
        if found is None or len(found[1]) < 2 or len(found[2]) > 1:
            continue
        adds, chains, others = found
        # with another value to add, the pieces' sum takes the place (and result) of an add beneath
        at = adds[1] if others else op
        args = _scattered(graph, graph.values[at.outputs[0]].spec, chains)
        if args is None:
            continue
        dropped.update(a.id for a in adds[1:])
        dropped.update(s.id for c in chains for s in c)
        summed = Op(at.id, scatters.SLICE_SUM, args, (), at.outputs, source=at.source)
        if others:
            before[op.id] = [summed]
            values[at.outputs[0]] = dataclasses.replace(values[at.outputs[0]], producer=at.id)
            replaced[op.id] = dataclasses.replace(op, args=(others[0], Ref(at.outputs[0])))
        else:
            replaced[op.id] = summed
    if not replaced:
        return graph
    return rebuild(graph, in_order([replaced.get(op.id, op) for op in graph.ops if op.id not in dropped], before),
                   values=values)


def _scattered(graph: Graph, result: TensorSpec, chains: list[list[Op]]) -> tuple | None:
    """slice_sum's arguments for the pieces `chains` make (each outermost slice_backward first),
    where they lie apart in a contiguous `result` of their dtype, else None."""
    sizes = tuple(result.shape)
    if not result.is_contiguous or result.offset or not all(sizes):
        return None
    pieces, slices = [], []
    for found in chains:
        where, shape = [], sizes
        for sb in found:
            dim, start, end, step = sb.args[2:]
            if tuple(sb.args[1]) != shape or not all(isinstance(v, int) and not isinstance(v, bool)
                                                     for v in (dim, start, end, step)) \
                    or not -len(shape) <= dim < len(shape) or step < 1:
                return None
            dim %= len(shape)
            length = len(range(*slice(start, end, step).indices(shape[dim])))
            shape = shape[:dim] + (length,) + shape[dim + 1:]
            where.append((dim, start, end, step))
        source = graph.values[found[-1].args[0].id].spec
        if tuple(source.shape) != shape or source.dtype != result.dtype:
            return None
        pieces.append(found[-1].args[0])
        slices.append(tuple(where))
    covers = _covers(sizes, slices)
    return None if covers is None else (tuple(pieces), tuple(slices), sizes, covers)


def _covers(sizes: tuple, slices: list[tuple]) -> bool | None:
    """Whether the pieces cover every element once (True), leave some out (False), or share an
    element or are too many to check (None)."""
    dims = sorted({d for where in slices for d, *_ in where})
    if math.prod(sizes[d] for d in dims) > MAX_CELLS:
        return None
    seen: set[tuple] = set()
    for where in slices:
        index = {d: list(range(sizes[d])) for d in dims}
        for d, start, end, step in where:
            index[d] = index[d][slice(start, end, step)]
        cells = {()}
        for d in dims:
            cells = {c + (i,) for c in cells for i in index[d]}
        if cells & seen:
            return None
        seen |= cells
    return len(seen) == math.prod(sizes[d] for d in dims)
