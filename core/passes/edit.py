"""One pass's edit of a graph, in the spirit of torch.fx's graph methods: new values and ops are
numbered for the pass, placed where it asks, uses of a value replaced, and `finish` makes the
graph (through `substitute.rebuild`: unused values dropped, ids made dense, ordering edges worked
out again). The passes that add values or ops used to repeat that bookkeeping by hand.

    edit = Edit(graph)
    scale = edit.value(WEIGHT, spec, "bn.scale", before=out.id)     # placed before `out`
    product = edit.value(ACTIVATION, spec, "x_scaled", before=out.id)
    mul = edit.op("aten::mul.Tensor", (x, Ref(scale.id)), (), (product,), source)  # its producer
    edit.insert_before(reader.id, mul)   # or hand the ops in order to finish(ops)
    edit.replace_uses(old, new)          # every use of old, outputs and aliases included
    graph = edit.finish(ops)             # or edit.finish() to keep graph.ops with the inserts
"""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Op, Value
from .substitute import new_weight, rebuild


class Edit:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: list[Value] = list(graph.values)  # existing values; `change` replaces one
        self._added: dict[int, list[Value]] = {}  # value id -> new values placed just before it
        self._where: dict[int, tuple[int, int]] = {}  # new value id -> (its key in _added, position)
        self._same: dict[int, int] = {}
        self._before: dict[int, list[Op]] = {}
        self._next_value, self._next_op = len(graph.values), len(graph.ops)
        self._values_changed = False

    @property
    def changed(self) -> bool:
        return bool(self._added or self._same or self._before or self._values_changed)

    def value(self, kind: str, spec, name: str, before: int, alias_of: int | None = None) -> Value:
        """A new value, placed just before value `before` (after the new values placed there
        already); `op` sets its producer."""
        return self._place(Value(self._new_value_id(), kind, spec, name, None, alias_of), before)

    def weight(self, weights: dict, name: str, tensor, before: int) -> Value:
        """A new weight value reading `tensor`, stored (contiguous) in `weights` under `name` or the
        first free name after it (`substitute.new_weight`), placed just before value `before`."""
        return self._place(new_weight(weights, name, tensor, self._new_value_id()), before)

    def op(self, target: str, args: tuple, kwargs: tuple, outputs, source: str = "", mutates: tuple = (),
           op_id: int | None = None) -> Op:
        """A new op writing `outputs` (values or ids), with the next free id unless `op_id` gives
        one; each new value among its outputs gets it as its producer."""
        op = Op(self._new_op_id() if op_id is None else op_id, target, args, kwargs,
                tuple(o.id if isinstance(o, Value) else o for o in outputs), mutates, (), source)
        return self._producing(op)

    def renumbered(self, op: Op, **changes) -> Op:
        """`op` (changed as `changes` say) under the next free id, as a new op; its new outputs
        get that id as their producer."""
        return self._producing(dataclasses.replace(op, id=self._new_op_id(), **changes))

    def _new_value_id(self) -> int:
        self._next_value += 1
        return self._next_value - 1

    def _new_op_id(self) -> int:
        self._next_op += 1
        return self._next_op - 1

    def _place(self, v: Value, before: int) -> Value:
        placed = self._added.setdefault(before, [])
        self._where[v.id] = (before, len(placed))
        placed.append(v)
        return v

    def _producing(self, op: Op) -> Op:
        """`op`, with each new value among its outputs recorded as produced by it."""
        for i in op.outputs:
            if i in self._where:
                key, k = self._where[i]
                self._added[key][k] = dataclasses.replace(self._added[key][k], producer=op.id)
        return op

    def change(self, value: Value) -> None:
        """An existing value replaced (a new spec, a new kind)."""
        self.values[value.id] = value
        self._values_changed = True

    def replace_uses(self, old: int, new: int) -> None:
        self._same[old] = new

    def insert_before(self, op_id: int, op: Op) -> None:
        """`op` issued just before op `op_id` (after the ops inserted there already)."""
        self._before.setdefault(op_id, []).append(op)

    def finish(self, ops: list[Op] | None = None) -> Graph:
        """The edited graph: `ops` in order (default: the graph's own), each with the ops inserted
        before it; the graph itself where no ops are given and nothing changed."""
        if ops is None and not self.changed:
            return self.graph
        ops = list(self.graph.ops) if ops is None else ops
        ordered = [new for op in ops for new in (*self._before.get(op.id, ()), op)]
        return rebuild(self.graph, ordered, same=self._same, values=self.values, added=self._added)
