"""What the finders of every pair kind share: who reads a value, its views, the op issued next on
a stream, the pairs of a second op issued right after its producer (`after`), and the kernel that
runs an elementwise op with something after it."""

from __future__ import annotations

from typing import Sequence

from ...ir import Graph, Op, Ref
from ...ops import fusion
from ..kernels.fused import FusedKernel
from ..placed.placement import PlacedOp


def readers_of(graph: Graph) -> tuple[dict[int, set[int]], set[int], set[int]]:
    """(root value -> the ops that read it or a view of it, the roots of the graph's outputs, the
    roots that have views)."""
    return graph.readers(), {graph.root(o) for o in graph.outputs}, set(views_of(graph))


def views_of(graph: Graph) -> dict[int, set[int]]:
    """root value -> the values that are views of it."""
    views: dict[int, set[int]] = {}
    for v in graph.values:
        if v.alias_of is not None:
            views.setdefault(v.alias_of, set()).add(v.id)
    return views


def next_on_stream(order: Sequence[int], stream_of: Sequence[int]) -> dict[int, int]:
    """op -> the op issued next on its stream."""
    following, last = {}, {}
    for op in order:
        if stream_of[op] in last:
            following[last[stream_of[op]]] = op
        last[stream_of[op]] = op
    return following


def after(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int], waits: Sequence,
          seconds: Sequence[Op], kernel_of) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """producer -> (the op of `seconds` that reads its result as its first argument and no
    other, whether anything else reads that result, `kernel_of(graph, producer)`), where that op
    is the next issued on the producer's stream, waits for nothing, and the kernel is not None."""
    following = next_on_stream(order, stream_of)
    readers, outputs, aliased = readers_of(graph)
    pairs = {}
    for second in seconds:
        if not isinstance(second.args[0], Ref):
            continue
        x = second.args[0].id
        producer = graph.values[x].producer
        if producer is None or graph.values[x].alias_of is not None or waits[second.id] \
                or following.get(producer) != second.id or any(isinstance(a, Ref) and a.id == x
                                                               for a in second.args[1:]):
            continue
        kernel = kernel_of(graph, placed[producer])
        if kernel is None:
            continue
        store = readers.get(x, set()) != {second.id} or x in outputs or x in aliased
        pairs[producer] = (placed[second.id], store, kernel)
    return pairs


def elementwise_kernel(graph: Graph, p: PlacedOp) -> FusedKernel | None:
    """The kernel that computes `p` with an op after it: its own, for an elementwise fused op; one
    made for it, for a lone elementwise op the fusion left alone (Swin's residual adds, which read
    a copying reshape); None for anything else."""
    op = p.op
    if isinstance(p.substitute, FusedKernel):
        return p.substitute if fusion.is_pointwise(fusion.body_of(op)) else None
    if op.target not in fusion.POINTWISE or op.mutates or len(op.outputs) != 1 \
            or graph.values[op.outputs[0]].spec.dtype not in fusion.FLOATS \
            or fusion.pointwise_problem((op.target, op.args, op.kwargs)) is not None:
        return None
    return FusedKernel(Op(op.id, fusion.FUSED, (((op.target, op.args, op.kwargs),),), (), op.outputs, (), (),
                          op.source))


def body_of_call(op: Op, args, kwargs) -> tuple:
    """The body a generated kernel computes for `op` called with these arguments: a fused op's
    own, or the lone elementwise op as a body of one node."""
    return args[0] if op.target == fusion.FUSED else ((op.target, tuple(args), tuple(kwargs.items())),)


def op_ids(obj) -> set[int]:
    """The ops of every PlacedOp in `obj` (a pair's tuple, lists within it)."""
    if isinstance(obj, PlacedOp):
        return {obj.op.id}
    return set().union(*(op_ids(o) for o in obj)) if isinstance(obj, (tuple, list)) else set()
