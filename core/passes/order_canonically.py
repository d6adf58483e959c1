"""Every graph: put the ops in one order that follows from the graph's data flow alone, so that the
same model gives the same op list, and so the same fusion and schedule, from either frontend.

TorchScript and torch.export emit a model's ops in different orders (a residual block's shortcut
convolution comes first from one and last from the other). The passes after this one decide by
order where they must pick (which convolution of a residual add leads a fused op, which chain the
matching extends), so they would decide differently for the same model.
"""

from __future__ import annotations

import dataclasses

from ..ir import Graph, renumber


def order_canonically(graph: Graph) -> Graph:
    """Number the ops in post-order of a depth-first walk from the graph outputs, in output order,
    each op's dependencies visited in the order of its arguments, then its ordering edges; ops no
    output reaches (writes into model state) follow, in the order they had. Values are numbered
    inputs first, then weights in the order the ops first read them, then activations in the
    order the ops write them."""
    order: list[int] = []
    done: set[int] = set()
    for start in [graph.values[o].producer for o in graph.outputs] + list(range(len(graph.ops))):
        if start is not None and start not in done:
            _walk(graph, start, done, order)
    ops = [graph.ops[i] for i in order]
    inputs = set(graph.inputs)
    first_read = {}
    for op in ops:
        for r in op.refs():
            for v in (r, graph.root(r)):
                first_read.setdefault(v, len(first_read))
    weights = sorted((v.id for v in graph.values if v.producer is None and v.id not in inputs),
                     key=lambda v: first_read.get(v, len(first_read) + v))
    values = [graph.values[i] for i in [*graph.inputs, *weights, *(o for op in ops for o in op.outputs)]]
    if order == list(range(len(graph.ops))) and [v.id for v in values] == list(range(len(graph.values))):
        return graph
    moved = renumber(values, ops, graph.inputs, graph.outputs)
    return dataclasses.replace(moved, ops=tuple(dataclasses.replace(op, after=tuple(sorted(op.after)))
                                                for op in moved.ops))


def _walk(graph: Graph, start: int, done: set[int], order: list[int]) -> None:
    """Append `start` and every op it depends on, not yet in `done`, to `order` in post-order
    (iteratively: a deep graph would overflow Python's stack)."""
    stack = [(start, iter(_dependencies(graph, start)))]
    done.add(start)
    while stack:
        op, pending = stack[-1]
        for dep in pending:
            if dep not in done:
                done.add(dep)
                stack.append((dep, iter(_dependencies(graph, dep))))
                break
        else:
            stack.pop()
            order.append(op)


def _dependencies(graph: Graph, op_id: int) -> list[int]:
    """The ops `op_id` waits for: the producers of its arguments in argument order, then its
    ordering edges."""
    op = graph.ops[op_id]
    deps: list[int] = []
    for r in op.refs():
        producer = graph.values[r].producer
        if producer is not None and producer not in deps:
            deps.append(producer)
    deps.extend(a for a in op.after if a not in deps)
    return deps
