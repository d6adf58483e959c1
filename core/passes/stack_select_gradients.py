"""Training graphs only (`TrainStep` runs it before fusion): the gradient of a tensor that the
forward took apart with `select` at every index of one dimension, which autograd sums from one
`select_backward` per piece (each a map of zeros the size of the whole, with one slice filled),
becomes one `stack` of the pieces' gradients.

    add(add(select_backward(g0, sizes, d, 0), select_backward(g1, sizes, d, 1)),
        select_backward(g2, sizes, d, 2))  ->  stack([g0, g1, g2], d)

nn.MultiheadAttention's packed input projection is taken apart so (its query, key and value), in
every layer of a vision or language transformer: vit_b_16's step at batch 32 wrote 36 such maps of
zeros, 29 MiB each in bf16, and read them all again to add them up, where the stack writes one.

Taken where the adds (alpha 1) read only select_backwards of one size and dimension and other
such adds, every index of the dimension once, and nothing else reads what the adds and the
select_backwards make but the add above them.
"""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Op, Ref
from .rewrite import readers_of, sole_reader
from .substitute import rebuild

ADD = "aten::add.Tensor"
SELECT_BACKWARD = "aten::select_backward.default"
STACK = "aten::stack.default"


def stack_select_gradients(graph: Graph) -> Graph:
    readers = readers_of(graph)
    only_read_by = sole_reader(graph, readers)
    producer = {v: op for op in graph.ops for v in op.outputs}

    def tree(op: Op) -> list[Op] | None:
        """`op` and the adds and select_backwards beneath it, where it is an add of such, or None."""
        if op.target != ADD or op.kwargs not in ((), (("alpha", 1),)) or len(op.args) != 2 \
                or not all(isinstance(a, Ref) for a in op.args):
            return None
        found = [op]
        for a in op.args:
            below = producer.get(a.id)
            if below is None or not only_read_by(a.id, op):
                return None
            more = [below] if below.target == SELECT_BACKWARD else tree(below)
            if more is None:
                return None
            found.extend(more)
        return found

    dropped: set[int] = set()
    replaced: dict[int, Op] = {}
    for op in graph.ops:
        if op.target != ADD or op.id in dropped or any(
                graph.ops[r].target == ADD for v in op.outputs for r in readers.get(v, ())):
            continue  # the top add of a tree only
        ops = tree(op)
        pieces = [p for p in ops or () if p.target == SELECT_BACKWARD]
        stacked = _stacked(graph, op, pieces) if pieces else None
        if stacked is None:
            continue
        replaced[op.id] = dataclasses.replace(op, target=STACK, args=stacked, kwargs=())
        dropped.update(p.id for p in ops[1:])
    if not replaced:
        return graph
    return rebuild(graph, [replaced.get(op.id, op) for op in graph.ops if op.id not in dropped])


def _stacked(graph: Graph, top: Op, pieces: list[Op]) -> tuple | None:
    """stack's arguments (the pieces' gradients in index order, the dimension) where the
    select_backwards fill every index of one dimension of one size once, else None."""
    if any(len(p.args) != 4 or p.kwargs or not isinstance(p.args[0], Ref) for p in pieces):
        return None
    sizes, dim = tuple(pieces[0].args[1]), pieces[0].args[2]
    if not isinstance(dim, int) or not -len(sizes) <= dim < len(sizes) or not sizes[dim]:
        return None
    dim %= len(sizes)
    if any(tuple(p.args[1]) != sizes or p.args[2] % len(sizes) != dim for p in pieces):
        return None
    index = {p.args[3] % sizes[dim] if isinstance(p.args[3], int) else None: p for p in pieces}
    if None in index or len(index) != len(pieces) or sorted(index) != list(range(sizes[dim])):
        return None
    result = graph.values[top.outputs[0]].spec
    if result.shape != sizes or not result.is_contiguous or result.offset \
            or any(graph.values[p.args[0].id].spec.dtype != result.dtype for p in pieces):
        return None
    return (tuple(index[k].args[0] for k in range(sizes[dim])), dim)

