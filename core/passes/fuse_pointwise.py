"""Inference graphs: chains and trees of elementwise ops become one fused op, which the runtime
runs as one generated kernel. A convolution whose one reader joins such a group leads it: the
runtime then runs the convolution and the rest of the group (its bias included) as its epilogue."""

from __future__ import annotations

from ..ir import Graph, Op, Ref
from ..ops import fusion
from .fuse_conv import _leader
from .rewrite import Facts, fuse

MAX_OPERANDS = 16  # distinct graph values one group reads
BOOLEAN = frozenset({"bool"})


def fuse_pointwise(graph: Graph) -> Graph:
    """Grow each group from its last op backwards: an elementwise op takes in the group of each
    operand that it alone reads, then a group takes in each operand's group that only its members
    read. Groups of one op stay as they are."""
    facts = Facts(graph)
    group: dict[int, list[int]] = {}  # op id -> the members of the group it ends
    conv_of: dict[int, int | None] = {}  # op id -> the convolution leading its group, if any
    for op in graph.ops:
        result = elementwise(graph, facts, op)
        if result is None:
            continue
        members, conv = [op.id], None
        for pos in fusion.POINTWISE[op.target]:
            a = op.args[pos] if pos < len(op.args) else None
            if not isinstance(a, Ref) or graph.values[a.id].producer is None:
                continue
            producer = graph.ops[graph.values[a.id].producer]
            if facts.only_reader(a.id) != op.id or not facts.movable(producer) or producer.id in members:
                continue
            if producer.id in group:  # an elementwise group ending at the producer
                theirs, their_conv = group[producer.id], conv_of[producer.id]
            elif _leader(graph, facts, producer) is not None:
                theirs, their_conv = [producer.id], producer.id
            else:
                continue
            if their_conv is not None and _smaller_unbiased(graph, graph.ops[their_conv], result):
                theirs, their_conv = [m for m in theirs if m != their_conv], None  # it runs alone
                if not theirs:
                    continue
            if their_conv is not None and (conv is not None or graph.values[graph.ops[their_conv].outputs[0]].spec.shape
                                           != result.spec.shape):
                continue  # one convolution per group, and it computes the group's whole result
            if len(members) + len(theirs) > fusion.MAX_NODES \
                    or len(_operands(graph, members + theirs)) > MAX_OPERANDS:
                continue
            members += theirs
            conv = their_conv if their_conv is not None else conv
            group.pop(producer.id, None)
        group[op.id], conv_of[op.id] = members, conv
    _take_shared_operands(graph, facts, group, conv_of)
    ordered = []
    for last, members in group.items():
        if len(members) > 1 and graph.values[graph.ops[last].outputs[0]].spec.dtype in fusion.FLOATS:
            conv = conv_of[last]
            ordered.append(([conv] if conv is not None else []) + sorted(m for m in members if m != conv))
    return fuse(graph, ordered)


def elementwise(graph: Graph, facts: Facts, op: Op):
    """`op`'s result if `op` may join a group: an elementwise op in the fused set whose operands
    share its floating dtype and broadcast to its result. An and of booleans (`fusion.LOGICAL`)
    reads and gives booleans, and a selection's condition is boolean; a group whose result is a
    boolean is never made (`fuse_pointwise`), so they join a group that selects by them."""
    if op.target not in fusion.POINTWISE or not facts.movable(op) \
            or fusion.pointwise_problem((op.target, op.args, op.kwargs)) is not None:
        return None
    logical = op.target in fusion.LOGICAL
    result = facts.plain_result(op, BOOLEAN if logical else fusion.FLOATS)
    if result is None or op.kwargs and op.target != "aten::gelu.default" and \
            not all(k == "alpha" for k, _ in op.kwargs):
        return None
    tensors = set(fusion.POINTWISE[op.target])
    for pos, a in enumerate(op.args):
        if pos in tensors:
            if not isinstance(a, Ref):
                return None
            spec = graph.values[a.id].spec
            want = "bool" if logical or op.target in fusion.SELECTIONS and pos == 0 else result.spec.dtype
            if spec.dtype != want or len(spec.shape) > len(result.spec.shape) or any(
                    n not in (1, m) for n, m in zip(reversed(spec.shape), reversed(result.spec.shape))):
                return None
        elif not (a is None or isinstance(a, (int, float, str)) and not isinstance(a, bool)):
            return None
    return result


def _smaller_unbiased(graph: Graph, conv: Op, result) -> bool:
    """True if `conv`, leading the group of an operand, has no bias and a result smaller than
    `result`: the group's elementwise ops then join `result`'s group without it
    (`bias_into_broadcast` moved its bias into them), and it runs alone."""
    return (len(conv.args) < 3 or conv.args[2] is None) \
        and graph.values[conv.outputs[0]].spec.numel < result.spec.numel


def _operands(graph: Graph, members: list[int]) -> set[int]:
    inside = {graph.ops[m].outputs[0] for m in members}
    return {r for m in members for r in graph.ops[m].refs() if r not in inside}


def _take_shared_operands(graph: Graph, facts: Facts, group: dict[int, list[int]], conv_of: dict) -> None:
    """A group takes in the group that computes one of its operands when that operand is read by
    several members and by nothing else (GELU's tanh form reads its input three times, and the
    bias add before it then joins it). Groups led by a convolution are not taken in."""
    changed = True
    while changed:
        changed = False
        for last in list(group):
            members = group.get(last)
            if members is None:
                continue
            inside = set(members)
            for v in sorted(_operands(graph, members)):
                producer = graph.values[v].producer
                if producer is None or producer not in group or producer in inside or conv_of[producer] is not None:
                    continue
                readers = facts.readers.get(v, set())
                if len(readers) < 2 or not readers <= inside or v in facts.outputs or v in facts.aliased \
                        or graph.root(v) in facts.mutated:
                    continue
                theirs = group[producer]
                if len(members) + len(theirs) > fusion.MAX_NODES \
                        or len(_operands(graph, members + theirs)) > MAX_OPERANDS:
                    continue
                members = members + theirs
                inside.update(theirs)
                group.pop(producer)
                changed = True
            group[last] = members
