"""Training graphs: thread ops that read only weights into program order."""

from __future__ import annotations

import dataclasses

from ..ir import WEIGHT, Graph


def chain_loose_ops(graph: Graph) -> Graph:
    """Thread each op that reads only weights, or nothing (a batch-norm counter's `add_`, a random `empty`)
    into program order: after the op before it, and before the op after it. Left loose, each
    would be a chain, and so a stream, of its own: one per batch-norm layer in training mode."""
    loose = {op.id for op in graph.ops if op.id and not graph.deps(op)
             and all(graph.values[r].kind == WEIGHT for r in op.refs())}  # reads no input either
    ops = []
    for op in graph.ops:
        after = set(op.after)
        if op.id in loose:
            after.add(op.id - 1)
        if op.id - 1 in loose:
            after.add(op.id - 1)
        ops.append(dataclasses.replace(op, after=tuple(sorted(after))))
    chained = dataclasses.replace(graph, ops=tuple(ops))
    chained.lint()
    return chained
