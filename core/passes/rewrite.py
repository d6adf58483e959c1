"""What the fusion passes share: who reads a value, which ops may join a group, and the rewrite
that replaces each group of ops with one fused op (`ops/fusion.py`); and what the gradient passes
share: the one op that reads a value (`sole_reader`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from ..ir import ACTIVATION, Graph, Local, Op, Value, map_refs, renumber
from ..ops import fusion


class Facts:
    """Per-graph facts the passes consult: readers of each value, mutated storage, ordering edges."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.readers: dict[int, set[int]] = defaultdict(set)
        for op in graph.ops:
            for r in op.refs():
                self.readers[r].add(op.id)
        self.outputs = set(graph.outputs)
        self.mutated = {graph.root(m) for op in graph.ops for m in op.mutates}
        self.ordered = {a for op in graph.ops for a in op.after}  # ops some other op must follow
        self.aliased = {v.alias_of for v in graph.values if v.alias_of is not None}

    def only_reader(self, value: int) -> int | None:
        """The one op that reads `value`, if exactly one does and nothing else needs it: it is not a
        graph output, no view shares its storage, and no op writes it."""
        readers = self.readers.get(value, ())
        if len(readers) != 1 or value in self.outputs or value in self.aliased or value in self.mutated:
            return None
        return next(iter(readers))

    def movable(self, op: Op) -> bool:
        """True if `op` may run later, at its group's last op: no ordering edge names it, and no op
        writes the storage it reads (so reading later reads the same data)."""
        return op.id not in self.ordered and not any(self.graph.root(r) in self.mutated for r in op.refs())

    def plain_result(self, op: Op, dtypes=fusion.FLOATS) -> Value | None:
        """`op`'s one result, if it is a fresh activation of one of `dtypes` (floating point unless
        told) that is not a view and not written in place."""
        if len(op.outputs) != 1 or op.mutates:
            return None
        v = self.graph.values[op.outputs[0]]
        if v.kind != ACTIVATION or v.alias_of is not None or v.spec.dtype not in dtypes:
            return None
        return v


def body(graph: Graph, members: list[int]) -> tuple:
    """The fused body of `members` (op ids, in the order the body runs them): a reference to a
    member's result becomes a Local of that member's node."""
    node_of = {graph.ops[m].outputs[0]: k for k, m in enumerate(members)}

    def arg(a):
        return map_refs(a, lambda r: Local(node_of[r.id]) if r.id in node_of else r)

    return tuple((graph.ops[m].target, arg(graph.ops[m].args), tuple((k, arg(v)) for k, v in graph.ops[m].kwargs))
                 for m in members)


def fuse(graph: Graph, groups: list[list[int]]) -> Graph:
    """Replace each group (op ids in body order, its last op's result the group's result) with one
    fused op at the position of the group's last op in program order. The other members and their
    results leave the graph; ids are renumbered densely."""
    if not groups:
        return graph
    final_of = {}
    removed_ops = set()
    for members in groups:
        last = max(members)
        final_of[last] = members
        removed_ops.update(m for m in members if m != last)
    removed_values = {o for m in removed_ops for o in graph.ops[m].outputs}
    ops = []
    for op in graph.ops:  # old ids still; `renumber` makes them dense
        if op.id in removed_ops:
            continue
        members = final_of.get(op.id)
        if members is None:
            ops.append(op)
            continue
        after = tuple(sorted({a for m in members for a in graph.ops[m].after}))
        ops.append(Op(op.id, fusion.FUSED, (body(graph, members),), (), (op.outputs[0],), (), after, op.source))
    return checked(graph, ops, removed_values)


def checked(graph: Graph, ops: list[Op], removed_values: set[int]) -> Graph:
    """`graph` with `ops` (old ids) in place of its ops and without `removed_values`, ids made
    dense, linted, and every fused op's body checked (`fusion.check`)."""
    values = [v for v in graph.values if v.id not in removed_values]
    fused = renumber(values, ops, graph.inputs, graph.outputs)
    fused.lint()
    for op in fused.ops:
        if op.target == fusion.FUSED:
            fusion.check(op)
    return fused


def readers_of(graph: Graph) -> dict[int, list[int]]:
    """Value -> the ops that read it, in order (each once)."""
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for r in set(op.refs()):
            readers.setdefault(r, []).append(op.id)
    return readers


def sole_reader(graph: Graph, readers: dict[int, list[int]]) -> Callable[[int, Op], bool]:
    """`only_read_by(value, op)`: whether `op` is the one op that reads `value` (`readers_of`),
    which is no graph output and no view (the gradient passes take such a value into the op that
    reads it)."""
    outputs = set(graph.outputs)

    def only_read_by(value: int, op: Op) -> bool:
        return readers.get(value) == [op.id] and value not in outputs and graph.values[value].alias_of is None

    return only_read_by
