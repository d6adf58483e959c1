"""Every graph: drop the ops whose work nobody reads, and the values only they used."""

from __future__ import annotations

import dataclasses

from ..ir import Graph, renumber, with_ordering_edges


def eliminate_dead_ops(graph: Graph) -> Graph:
    """Keep the ops whose results reach a graph output, or that write into storage that does or
    into a weight (model state: a training-mode batch-norm counter, say); keep the values they
    use, and number the result densely."""
    live_ops = _live_ops(graph)
    ops = [dataclasses.replace(op, after=()) for op in graph.ops if op.id in live_ops]  # edges: worked out again
    used = set(graph.inputs) | set(graph.outputs)
    for op in ops:
        used.update(op.refs())
        used.update(op.outputs)
    used.update(v.alias_of for v in graph.values if v.id in used and v.alias_of is not None)
    kept = [v for v in graph.values if v.id in used]
    return with_ordering_edges(renumber(kept, ops, graph.inputs, graph.outputs))


def _live_ops(graph: Graph) -> set[int]:
    root = graph.root
    live_values = set(graph.outputs) | {root(o) for o in graph.outputs} | set(graph.weights)
    live_ops: set[int] = set()
    for op in reversed(graph.ops):
        if any(root(m) in live_values for m in op.mutates) or any(o in live_values for o in op.outputs):
            live_ops.add(op.id)
            for r in op.refs():
                live_values.update((r, root(r)))
    return live_ops
