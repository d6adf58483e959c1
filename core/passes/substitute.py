"""What the rewrite passes share: ops that read one value in place of another, and the graph
rebuilt from the ops a pass keeps."""

from __future__ import annotations

import dataclasses

from ..ir import WEIGHT, Graph, Op, Ref, TensorSpec, Value, map_refs, renumber, with_ordering_edges
from ..ops import arguments, shapes, types


def substitute(op: Op, image, **changes) -> Op:
    """`op` reading and writing `image(id)` wherever it read or wrote value `id` (and with
    `changes` to its other fields)."""
    def ref(r: Ref) -> Ref:
        return Ref(image(r.id))

    kwargs, mutates = tuple((k, map_refs(v, ref)) for k, v in op.kwargs), tuple(image(m) for m in op.mutates)
    return dataclasses.replace(op, args=map_refs(op.args, ref), kwargs=kwargs, mutates=mutates, **changes)


def rebuild(graph: Graph, ops: list[Op], same: dict[int, int] | None = None,
            values: list[Value] | None = None, added: dict[int, list[Value]] | None = None) -> Graph:
    """The graph of `ops` (the ops a pass kept, in order, with their old ids), where every use of a
    value in `same` (graph outputs and aliases included) is a use of its image. `values` replaces
    the graph's values (old ids); `added` places new values (ids past the old ones) just before the
    value they are keyed by. Values that no op, input or output uses any more are dropped, ids are
    made dense, and the ordering edges are worked out again."""
    same = same or {}

    def image(v: int) -> int:
        return same.get(v, v)

    if same:
        ops = [substitute(op, image, after=()) for op in ops]
    else:  # nothing to substitute (a 12,000-op graph's two copies of every op cost 0.3 s)
        ops = [dataclasses.replace(op, after=()) if op.after else op for op in ops]
    outputs = tuple(image(o) for o in graph.outputs)
    used = set(graph.inputs) | set(outputs)
    for op in ops:
        used.update(op.refs())
        used.update(op.outputs)
    every = values if values is not None else graph.values
    alias = {v.id: v.alias_of for v in every}

    def root(v: int) -> int:  # an alias's new root: its image, or the root that image shares storage with
        v = image(v)
        while alias.get(v) is not None and alias[v] != v:
            v = image(alias[v])
        return v

    kept = []
    for v in every:
        kept.extend((added or {}).get(v.id, ()))
        if v.id in used:
            kept.append(v if v.alias_of is None else dataclasses.replace(v, alias_of=root(v.alias_of)))
    return with_ordering_edges(renumber(kept, ops, graph.inputs, outputs))


def in_order(ops: list[Op], before: dict[int, list[Op]]) -> list[Op]:
    """`ops` with each op's new ops in `before` (op id -> ops) just before it."""
    return [new for op in ops for new in (*before.get(op.id, ()), op)]


def read_weights(graph: Graph, weights: dict) -> tuple[Graph, dict]:
    """`graph`, and of `weights` those it still reads (by name)."""
    names = {v.name for v in graph.values if v.kind == WEIGHT}
    return graph, {name: t for name, t in weights.items() if name in names}


def new_weight(weights: dict, name: str, tensor, value_id: int) -> Value:
    """Store `tensor` (made contiguous) in `weights` under `name`, or the first free name after
    it (`free_name`), and return the weight value `value_id` that reads it."""
    name = free_name(name, weights)
    weights[name] = tensor.contiguous()
    return Value(value_id, WEIGHT, TensorSpec(tuple(tensor.shape), types.dtype_name(tensor.dtype),
                                              tuple(weights[name].stride())), name)


def free_name(name: str, weights: dict) -> str:
    """`name`, or `name_1`, `name_2`, ...: the first that no weight has yet."""
    base, n = name, 1
    while name in weights:
        name, n = f"{base}_{n}", n + 1
    return name


def binary_spec(target: str, a: TensorSpec, b: TensorSpec) -> TensorSpec:
    """The result of a broadcasting binary op on `a` and `b`, typed on the meta device: by its
    shape rule where one covers it (`ops/shapes.py`: add, sub and mul in any layout), else by its
    meta kernel. (A process's first meta add or mul imported torch._dynamo and sympy: 2.35 of a
    densenet121's compile seconds in `affine_batch_norm`.)"""
    (result,) = shapes.results(target, [arguments.meta_tensor(a), arguments.meta_tensor(b)], {})
    return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()),
                      result.storage_offset())
