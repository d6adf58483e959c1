"""Inference graphs: a convolution, its bias, an optional residual add and a relu become one
fused op, which the runtime maps onto cuDNN's fused convolution kernels."""

from __future__ import annotations

from ..ir import Graph, Ref
from ..ops import fusion
from .rewrite import Facts, fuse


def fuse_conv(graph: Graph) -> Graph:
    """Fuse each 2-D convolution whose one reader is a relu, or an add (alpha 1) of a same-shaped
    tensor whose one reader is a relu. Bias stays an argument of the convolution node; cuDNN adds
    it in the same kernel."""
    facts = Facts(graph)
    groups, taken = [], set()
    for conv in graph.ops:
        leader = _leader(graph, facts, conv)
        if leader is None:
            continue
        out = leader.id
        first = facts.only_reader(out)
        if first is None:
            continue
        op = graph.ops[first]
        if op.target == "aten::relu.default" and op.args[:1] == (Ref(out),) and facts.plain_result(op):
            groups.append([conv.id, op.id])
            taken.add(op.id)
            continue
        if op.target != "aten::add.Tensor" or dict(op.kwargs).get("alpha", 1) != 1 or not facts.plain_result(op):
            continue
        other = [a for a in op.args[:2] if a != Ref(out)]
        if len(other) != 1 or not isinstance(other[0], Ref):
            continue
        z = graph.values[other[0].id]
        if (z.spec.shape, z.spec.dtype) != (leader.spec.shape, leader.spec.dtype) \
                or graph.root(z.id) in facts.mutated or not facts.movable(op):
            continue
        second = facts.only_reader(op.outputs[0])
        relu = graph.ops[second] if second is not None else None
        if relu is not None and relu.target == "aten::relu.default" and relu.args[:1] == (Ref(op.outputs[0]),) \
                and facts.plain_result(relu) and op.id not in taken:
            groups.append([conv.id, op.id, relu.id])  # the first convolution into the add leads
            taken.add(op.id)
    return fuse(graph, groups)


def _leader(graph: Graph, facts: Facts, op):
    """`op`'s result if `op` is a 2-D convolution that may lead a fused body, else None."""
    if op.target not in fusion.CONVOLUTIONS or not facts.movable(op):
        return None
    params = fusion.conv_params(op.target, op.args)
    result = facts.plain_result(op)
    if params is None or result is None or op.kwargs or not isinstance(params["input"], Ref) \
            or not isinstance(params["weight"], Ref):
        return None
    if len(graph.values[params["input"].id].spec.shape) != 4 or len(result.spec.shape) != 4:
        return None
    return result
