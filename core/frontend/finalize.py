"""Clean-up run once at the end of the frontend: dead-op removal, ordering edges, dense ids."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Op, Ref, Value


def finalize(values: list[Value], ops: list[Op], inputs: list[int], outputs: list[int],
             weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Drop dead ops and values, add ordering edges for in-place writes, renumber densely."""
    state = {v.id for v in values if v.kind == WEIGHT}  # a write to a weight is model state
    live_ops = _live_ops(values, ops, outputs, state)
    every_op = len(live_ops) == len(ops)
    ops = [op for op in ops if op.id in live_ops]
    used = set(inputs) | set(outputs)
    for op in ops:
        used.update(op.refs())
        used.update(op.outputs)
    used.update(v.alias_of for v in values if v.id in used and v.alias_of is not None)
    kept = [v for v in values if v.id in used]
    vmap = {v.id: i for i, v in enumerate(kept)}
    omap = {op.id: i for i, op in enumerate(ops)}

    if every_op and len(kept) == len(values) and all(v.id == i for i, v in enumerate(values)) \
            and all(op.id == i for i, op in enumerate(ops)):
        new_values, new_ops = tuple(values), list(ops)  # nothing dropped, ids dense already
    else:
        new_values = tuple(dataclasses.replace(
            v, id=vmap[v.id],
            producer=None if v.producer is None else omap[v.producer],
            alias_of=None if v.alias_of is None else vmap[v.alias_of]) for v in kept)
        new_ops = [dataclasses.replace(
            op, id=omap[op.id], args=_remap(op.args, vmap),
            kwargs=tuple((k, _remap(a, vmap)) for k, a in op.kwargs),
            outputs=tuple(vmap[o] for o in op.outputs),
            mutates=tuple(vmap[m] for m in op.mutates)) for op in ops]
    graph = Graph(new_values, (), tuple(vmap[i] for i in inputs), tuple(vmap[o] for o in outputs))
    graph = dataclasses.replace(graph, ops=tuple(_with_ordering_edges(graph, new_ops)))
    graph.lint()
    names = {v.name for v in new_values if v.kind == WEIGHT}
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


def _remap(arg, vmap):
    if isinstance(arg, Ref):
        return Ref(vmap[arg.id])
    if isinstance(arg, tuple):
        return tuple(_remap(a, vmap) for a in arg)
    return arg
