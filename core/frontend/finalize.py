"""Clean-up run once at the end of the frontend: dead-op removal, ordering edges, dense ids."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Op, Value, renumber


def finalize(values: list[Value], ops: list[Op], inputs: list[int], outputs: list[int],
             weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Drop dead ops and values, add ordering edges for in-place writes, renumber densely."""
    state = {v.id for v in values if v.kind == WEIGHT}  # a write to a weight is model state
    live_ops = _live_ops(values, ops, outputs, state)
    ops = [op for op in ops if op.id in live_ops]
    used = set(inputs) | set(outputs)
    for op in ops:
        used.update(op.refs())
        used.update(op.outputs)
    used.update(v.alias_of for v in values if v.id in used and v.alias_of is not None)
    kept = [v for v in values if v.id in used]
    graph = renumber(kept, ops, inputs, outputs)
    graph = dataclasses.replace(graph, ops=tuple(_with_ordering_edges(graph, list(graph.ops))))
    graph.lint()
    names = {v.name for v in graph.values if v.kind == WEIGHT}
    return graph, {k: t for k, t in weights.items() if k in names}


def _live_ops(values: list[Value], ops: list[Op], outputs: list[int], state: set[int]) -> set[int]:
    """Ops whose results reach a graph output, or that write into storage that does or into
    `state` (weights: a training-mode batch-norm counter, say)."""
    def root(v: int) -> int:
        return values[v].alias_of if values[v].alias_of is not None else v

    live_values = set(outputs) | {root(o) for o in outputs} | state
    live_ops: set[int] = set()
    for op in reversed(ops):
        writes_live = any(root(m) in live_values for m in op.mutates)
        if writes_live or any(o in live_values for o in op.outputs):
            live_ops.add(op.id)
            for r in op.refs():
                live_values.update((r, root(r)))
    return live_ops


def _with_ordering_edges(graph: Graph, ops: list[Op]) -> list[Op]:
    """In-place writes and reads through aliases need edges that data flow alone does not give:
    a write waits for earlier readers of the same storage, and later readers wait for the write."""
    root = graph.root

    last_write: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    result = []
    for op in ops:
        data = {graph.values[r].producer for r in op.refs()}
        after: set[int] = set()
        for r in op.refs():
            storage = root(r)
            if storage in last_write:
                after.add(last_write[storage])
            readers.setdefault(storage, []).append(op.id)
        for m in op.mutates:
            storage = root(m)
            after.update(x for x in readers.get(storage, []) if x != op.id)
            readers[storage] = []
            last_write[storage] = op.id
        after -= data | {op.id}
        result.append(dataclasses.replace(op, after=tuple(sorted(after))))
    return result
