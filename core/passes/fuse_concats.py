"""Inference graphs: a cat whose one reader is elementwise (a pointwise fused op, or a lone
elementwise op) leads that reader's body, so the cat's result is never written: the runtime's
generated kernel reads each element from the part that holds it (`codegen.concat_source`).

densenet121 is the case. Each dense layer concatenates every feature map before it, then batch
norm and ReLU (one fused op) read the result. Before this pass every layer copied all of them
(58 copy kernels, a quarter of the model's time at batch 8), and the plan gave each cat a buffer
of its own. Runs after the other fusion passes, on the fused ops they made.
"""

from __future__ import annotations

from ..ir import ACTIVATION, Graph, Local, Op, Ref, map_refs
from ..ops import fusion
from .fuse_pointwise import elementwise
from .rewrite import Facts, checked

CAT = "aten::cat.default"


def fuse_concats(graph: Graph) -> Graph:
    """Each cat that qualifies (`_joins`) becomes node 0 of its reader's body, and leaves the graph."""
    facts = Facts(graph)
    cat_of: dict[int, Op] = {}  # reader op id -> the cat it takes in
    for op in graph.ops:
        reader = _joins(graph, facts, op)
        if reader is not None:
            cat_of[reader.id] = op
    if not cat_of:
        return graph
    taken = {cat.id for cat in cat_of.values()}
    ops = []
    for op in graph.ops:
        if op.id in taken:
            continue
        cat = cat_of.get(op.id)
        ops.append(op if cat is None else _led_by(graph, cat, op))
    return checked(graph, ops, {graph.ops[c].outputs[0] for c in taken})


def _joins(graph: Graph, facts: Facts, cat: Op) -> Op | None:
    """The reader `cat` may lead: `cat` joins at most MAX_PIECES graph values of one floating
    dtype, each laid out as the result will be (`_laid_out_alike`), along a constant dimension,
    may run at its reader's place (`Facts.movable`), and its
    result, read by nothing else, has the reader's shape and dtype; the reader is a pointwise
    fused op, or an elementwise op that `fuse_pointwise.elementwise` accepts, and no op orders
    after the cat. None where any of this fails."""
    if cat.target != CAT or cat.kwargs or len(cat.args) != 2 or not isinstance(cat.args[0], tuple) \
            or not isinstance(cat.args[1], int) or isinstance(cat.args[1], bool) or len(cat.outputs) != 1 \
            or cat.mutates or not 1 <= len(cat.args[0]) <= fusion.MAX_PIECES \
            or not all(isinstance(a, Ref) for a in cat.args[0]) or not facts.movable(cat):
        return None
    result = facts.plain_result(cat)
    reader_id = facts.only_reader(cat.outputs[0])
    if result is None or reader_id is None:
        return None
    if any(graph.values[a.id].spec.dtype != result.spec.dtype or not _laid_out_alike(graph, facts, a.id)
           for a in cat.args[0]):
        return None
    reader = graph.ops[reader_id]
    if reader.target == fusion.FUSED:
        if not fusion.is_pointwise(fusion.body_of(reader)) or len(fusion.body_of(reader)) >= fusion.MAX_NODES:
            return None
    elif elementwise(graph, facts, reader) is None:
        return None
    out = graph.values[reader.outputs[0]].spec
    return reader if out.shape == result.spec.shape and out.dtype == result.spec.dtype \
        and _laid_out_alike(graph, facts, reader.outputs[0]) else None


def _laid_out_alike(graph: Graph, facts: Facts, value: int) -> bool:
    """Whether `value` is a dense activation of its own that every layout chosen at load lays out
    as it lays out the cat's other parts and result: no view, input or weight (a class token
    expanded over the batch has a stride of 0), and, if it is 4-D, no view of it either
    (`tuning.channels_last_values` re-strides exactly those). The kernel needs every part and the
    result dense in one order of dims (`codegen.ConcatTiles`)."""
    v = graph.values[value]
    return v.kind == ACTIVATION and v.alias_of is None and v.spec.is_contiguous and not v.spec.offset \
        and (len(v.spec.shape) != 4 or value not in facts.aliased)


def _led_by(graph: Graph, cat: Op, reader: Op) -> Op:
    """`reader` as a fused op whose body is `cat` (node 0), then the reader's nodes, each Local
    one later and each read of the cat's result now Local(0)."""
    joined = cat.outputs[0]
    nodes = fusion.body_of(reader) if reader.target == fusion.FUSED else ((reader.target, reader.args, reader.kwargs),)

    def moved(a):
        if isinstance(a, Local):
            return Local(a.index + 1)
        if isinstance(a, tuple):
            return tuple(moved(x) for x in a)
        return map_refs(a, lambda r: Local(0) if r.id == joined else r)

    dim = cat.args[1] % len(graph.values[joined].spec.shape)
    body = ((CAT, (cat.args[0], dim), ()),
            *((target, moved(args), tuple((k, moved(v)) for k, v in kwargs)) for target, args, kwargs in nodes))
    after = tuple(sorted({*cat.after, *reader.after}))
    return Op(reader.id, fusion.FUSED, (body,), (), reader.outputs, (), after, reader.source)
